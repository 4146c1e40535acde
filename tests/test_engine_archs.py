"""The built-in engine's own decoder on the architectures people train: Qwen3, Llama 3.x, Gemma 3,
Mistral's sliding window, Qwen2's sliding-window layers, every RoPE scaling transformers ships
for them, and the mixture-of-experts Qwen3-MoE (sparse and dense layers) and Mixtral. Each is a tiny random instance built from transformers' own config class; the engine's
logprobs must equal transformers' full forward within 1e-4 (fp32, CPU) for prompts of mixed
lengths (longer than the sliding windows), on the C++ kernels and on the torch path, before and
after a weight update that lands mid-generation; and the trainer trains each main architecture
for 3 steps with `inference.engine.backend=native`.
"""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from arch_configs import CONFIGS, VOCAB, build_instances, three_step_job

from asyncrl import Trainer
from asyncrl.api import GenerationConfig, ModelRequest
from asyncrl.inference.decoder_args import DecoderArgs, unsupported_reason
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.inference.model_runner import (
    HFModelRunner,
    ModelRunner,
    NativeUnsupportedError,
    read_hf_config,
)
from asyncrl.launch.train_config import TrainRunConfig

OLD_TRANSFORMERS = int(transformers.__version__.split(".")[0]) < 5
GEMMA_SKIP = pytest.mark.skipif(OLD_TRANSFORMERS, reason="the native decoder reads Gemma 3 with "
                                "transformers >= 5 (its per-layer-type RoPE); older ones fall back")


def params(names):
    return [pytest.param(n, marks=GEMMA_SKIP) if n == "gemma3" else n for n in names]


MAIN = ["qwen3", "llama3", "gemma3", "mistral", "qwen3-moe", "mixtral"]
MAX_SEQ_LEN = 64  # within the dynamic and longrope thresholds
LENGTHS = [3, 11, 25, 6]  # around and past the windows of 8


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{name: (model dir, transformers model)}: weights saved with the tiny byte tokenizer."""
    return build_instances(list(CONFIGS), tmp_path_factory)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, 101, (n,), generator=g).tolist() for n in LENGTHS]


pytestmark = pytest.mark.usefixtures("one_thread")


def engine(path, **kw) -> LLMEngine:
    kw.setdefault("backend", "native")
    return LLMEngine(EngineConfig(model_path=str(path), max_seq_len=MAX_SEQ_LEN, device="cpu",
                                  max_num_seqs=8, **kw))


def full_logprobs(model, prompt, output):
    ids = torch.tensor([prompt + output])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(output)[:, None])[:, 0]


def check(model, prompt, out, lo=0, hi=None):
    got = torch.tensor(out.output_logprobs)[lo:hi]
    ref = full_logprobs(model, prompt, out.output_tokens)[lo:hi]
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


@pytest.mark.parametrize("name", params(CONFIGS))
def test_every_architecture_runs_natively(name, built):
    path, _ = built[name]
    assert unsupported_reason(read_hf_config(path), MAX_SEQ_LEN) is None
    assert isinstance(engine(path).runner, ModelRunner)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("name", params(CONFIGS))
def test_logprobs_equal_transformers_for_mixed_lengths(name, cpu_kernels, built, prompts):
    path, model = built[name]
    eng = engine(path, cpu_kernels=cpu_kernels)
    outs = eng.generate([ModelRequest(p, GenerationConfig(max_new_tokens=14, seed=i))
                         for i, p in enumerate(prompts)])
    for p, out in zip(prompts, outs):
        assert len(out.output_tokens) == 14
        check(model, p, out)


def perturbed(model) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g)
            for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", params(MAIN + ["qwen2-sliding"]))
def test_a_weight_update_mid_generation_splits_versions_exactly(name, built, prompts):
    path, model = built[name]
    eng = engine(path)
    for p in prompts:
        eng.add_request(ModelRequest(p, GenerationConfig(max_new_tokens=16, seed=3)))
    for _ in range(7):  # one prefill, then 6 decode steps
        eng.step()
    new_sd = perturbed(model)
    storage = {k: t.data_ptr() for k, t in eng.runner.model._targets.items()}
    eng.update_weights_from_state_dict(new_sd, version=1)
    # copied in place: every parameter keeps its storage (what a captured CUDA graph reads)
    assert {k: t.data_ptr() for k, t in eng.runner.model._targets.items()} == storage
    done = []
    while eng.has_unfinished():
        done += eng.step()
    new = transformers.AutoModelForCausalLM.from_config(CONFIGS[name]).eval()
    new.load_state_dict(new_sd)
    by_prompt = {tuple(o.input_tokens): o for o in done}
    for p in prompts:
        out = by_prompt[tuple(p)]
        assert out.output_versions == [0] * 7 + [1] * 9
        check(model, p, out, 0, 7)  # tokens sampled before the update: the old weights
        check(new, p, out, 7)  # after it: the new ones, over the old tokens' cache


@pytest.mark.parametrize("name", params(MAIN))
def test_the_trainer_trains_it_with_the_native_engine(name, built, tmp_path):
    path, _ = built[name]
    cfg = TrainRunConfig.load(None, [*three_step_job(path, tmp_path / "run"),
                                     "inference.engine.backend=native"])
    result = Trainer(cfg).train()
    assert result.steps == 3


def test_length_dependent_rope_past_its_threshold_falls_back_and_says_why(built, caplog):
    """longrope switches to its long factors past original_max_position_embeddings (64 here,
    of 128 positions): served natively only with max_seq_len <= 64. (dynamic's threshold is
    max_position_embeddings, which the engine never passes: always native.)"""
    path, _ = built["llama-longrope"]
    reason = unsupported_reason(read_hf_config(path), 128)
    assert "longrope" in reason and "inference.engine.max_seq_len <= 64" in reason
    assert unsupported_reason(read_hf_config(built["llama-dynamic"][0]), None) is None
    with caplog.at_level(logging.WARNING):
        eng = LLMEngine(EngineConfig(model_path=str(path), device="cpu", backend="auto"))
    assert isinstance(eng.runner, HFModelRunner)
    assert "through transformers" in caplog.text and "longrope" in caplog.text
    with pytest.raises(NativeUnsupportedError, match=r"inference.engine.backend='native' "
                       r"cannot serve .*longrope.*set inference.engine.backend to 'auto'"):
        LLMEngine(EngineConfig(model_path=str(path), device="cpu", backend="native"))


def test_an_architecture_it_does_not_implement_is_named(tmp_path):
    cfg = transformers.GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=128)
    reason = unsupported_reason({**cfg.to_dict(), "architectures": ["GPTNeoXForCausalLM"]})
    assert "GPTNeoXForCausalLM" in reason and "Qwen3ForCausalLM" in reason


def test_the_parameter_count_matches_transformers(built):
    for name in [n for n in MAIN if not (OLD_TRANSFORMERS and n == "gemma3")]:
        path, model = built[name]
        args = DecoderArgs.from_hf_config(read_hf_config(path), MAX_SEQ_LEN)
        assert args.num_parameters() == model.num_parameters(), name
