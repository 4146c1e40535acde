"""The trainer computes no padding: packed rows with per-sample (varlen) attention equal the padded
layout in values and gradients, for each decoder architecture the engine serves; the chunked
logprob head equals the full logits' head in values and gradients and holds a fraction of its
memory; AdamW is fused on CUDA (CPU here: the fused flag is checked off) and the GPU micro-batch
default follows the card's memory.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from arch_configs import configs
from asyncrl.api.trajectory import Sample
from asyncrl.train.chunked_logprobs import chunked_logprobs
from asyncrl.train.config import TrainEngineConfig, default_gpu_micro_batch
from asyncrl.train.engine import HFTrainEngine
from asyncrl.train.heads import ChunkedLogprobHead, split_output_head
from asyncrl.train.logprobs import gather_logprobs
from asyncrl.train.regularizers import entropy_from_logits
from asyncrl.train.varlen_attention import NAME

ARCHS = ["qwen2", "qwen3", "llama3", "mistral", "gemma3", "qwen2-sliding"]


def model_for(arch: str) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = (transformers.Qwen2Config(**{**configs()["qwen3"].to_dict(), "model_type": "qwen2"})
           if arch == "qwen2" else configs()[arch])
    if arch == "gemma3" and transformers.__version__ < "5":
        pytest.skip("Gemma 3's config shape needs transformers >= 5")
    cfg.attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()


def samples(n: int = 5) -> list[Sample]:
    """Mixed lengths, some longer than the 8-position windows, with a loss mask on the tail."""
    rng = random.Random(1)
    out = []
    for _ in range(n):
        length = rng.randint(3, 21)
        ids = [rng.randrange(3, 300) for _ in range(length)]
        prompt = rng.randint(1, length - 1)
        out.append(Sample(input_ids=ids, loss_mask=[0] * prompt + [1] * (length - prompt),
                          logprobs=[0.0] * length, versions=[-1] * prompt + [0] * (length - prompt)))
    return out


def outputs_and_grads(model: torch.nn.Module, layout: str, chunk: int,
                      batch: list[Sample]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    engine = HFTrainEngine(model, TrainEngineConfig(attention_layout=layout, device="cpu",
                                                    share_prefixes=False, autocast_dtype="none",
                                                    logprob_chunk_tokens=chunk, max_tokens_per_mb=64))
    values = []
    engine.model.zero_grad()
    for mb in engine._plan(batch, None)[0]:
        lp, ent = engine._token_outputs(mb, with_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        values += [lp.detach(), ent.detach()]
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}
    return values, grads


@pytest.mark.parametrize("arch", ARCHS)
def test_packed_rows_equal_padded_rows_in_values_and_gradients(arch):
    import copy

    model = model_for(arch)
    batch = samples()
    ref_values, ref_grads = outputs_and_grads(copy.deepcopy(model), "padded", 0, batch)
    packed = copy.deepcopy(model)
    values, grads = outputs_and_grads(packed, "packed", 0, batch)
    assert packed.config._attn_implementation == NAME
    for a, b in zip(values, ref_values):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4, msg=name)


def test_auto_layout_packs_text_models():
    engine = HFTrainEngine(model_for("qwen3"), TrainEngineConfig(device="cpu"))
    assert not engine.padded and engine.model.config._attn_implementation == NAME


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_equals_the_full_head(temperature):
    """In float64 (both sides compute in the input's precision), against log_softmax."""
    torch.manual_seed(0)
    n, d, v = 37, 16, 50
    hidden = torch.randn(n, d, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, d, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    gl, ge = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)

    log_p = torch.log_softmax(hidden @ weight.t() / temperature, -1)
    full_lp = log_p.gather(1, labels[:, None])[:, 0]
    full_ent = -(log_p.exp() * log_p).sum(-1)
    (full_lp * gl + full_ent * ge).sum().backward()
    ref = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    lp, ent = chunked_logprobs(hidden, weight, labels, temperature, chunk=8, with_entropy=True)
    (lp * gl + ent * ge).sum().backward()
    for got, want in [(lp, full_lp), (ent, full_ent), (hidden.grad, ref[0]),
                      (weight.grad, ref[1])]:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_chunked_head_in_the_engine_equals_full_logits():
    import copy

    model = model_for("qwen3")
    batch = samples()
    ref_values, ref_grads = outputs_and_grads(copy.deepcopy(model), "packed", 0, batch)
    values, grads = outputs_and_grads(copy.deepcopy(model), "packed", 16, batch)
    for a, b in zip(values, ref_values):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for name in grads:  # fp32 in another summation order: within 1e-6 of the tensor's scale
        scale = max(1.0, ref_grads[name].abs().max().item())
        assert (grads[name] - ref_grads[name]).abs().max().item() <= 1e-6 * scale, name


PEAK = """
import resource, sys, torch
from asyncrl.train.chunked_logprobs import chunked_logprobs
from asyncrl.train.logprobs import gather_logprobs
torch.manual_seed(0)
n, d, v = 4096, 64, 32768
hidden = torch.randn(n, d, requires_grad=True)
weight = torch.randn(v, d, requires_grad=True)
labels = torch.randint(0, v, (n,))
hidden.grad, weight.grad = torch.zeros_like(hidden), torch.zeros_like(weight)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if sys.argv[1] == "full":
    gather_logprobs(hidden @ weight.t(), labels).sum().backward()
else:
    chunked_logprobs(hidden, weight, labels, chunk=256)[0].sum().backward()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


def test_chunked_head_holds_a_fraction_of_the_full_logits_memory():
    """Growth of the peak RSS over one forward + backward of the head on 4,096 tokens of a 32k
    vocabulary (the [N, V] fp32 logits: 512 MiB), each in its own process."""
    import subprocess
    import sys

    def peak(kind: str) -> int:
        out = subprocess.run([sys.executable, "-c", PEAK, kind], capture_output=True, text=True,
                             check=True)
        return int(out.stdout.split()[-1])

    full, chunked = peak("full"), peak("chunked")
    assert full >= 4096 * 32768 * 4, full
    assert chunked < full / 8, (chunked, full)


def test_split_output_head_names_what_it_cannot_split():
    model = model_for("qwen3")
    trunk, head = split_output_head(model)
    assert trunk is model.model and head is model.lm_head
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping=30.0" in split_output_head(model)
    engine = HFTrainEngine(model, TrainEngineConfig(device="cpu"))
    assert engine.trunk is None and not isinstance(engine.head, ChunkedLogprobHead)


def test_adamw_is_fused_only_on_cuda_and_the_gpu_micro_batch_follows_the_card():
    engine = HFTrainEngine(model_for("qwen3"), TrainEngineConfig(device="cpu"))
    assert not engine.optimizer.defaults["fused"]
    assert engine.micro_batch_tokens == 1024
    gib = 1024 ** 3
    qwen05b = 40 * 24 * 896  # bytes per token: 40 x layers x hidden
    assert default_gpu_micro_batch(80 * gib, qwen05b) == 32768
    assert default_gpu_micro_batch(24 * gib, qwen05b) == 8192
    assert default_gpu_micro_batch(80 * gib, 40 * 28 * 3584) == 4096  # a 7B model
    assert default_gpu_micro_batch(8 * gib, 40 * 80 * 8192) == 1024  # never below


@pytest.mark.gpu
def test_packed_rows_on_cuda_in_bf16_match_padded():
    """On a GPU: the varlen kernel (torch's varlen_attn) against the padded SDPA rows in bf16."""
    import copy

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch sees none)")
    model = model_for("qwen3").cuda()
    batch = samples()

    def run(layout):
        engine = HFTrainEngine(copy.deepcopy(model), TrainEngineConfig(
            attention_layout=layout, share_prefixes=False, autocast_dtype="bfloat16"))
        assert engine.optimizer.defaults["fused"]
        return [engine._token_outputs(mb, False)[0].float().cpu()
                for mb in engine._plan(batch, None)[0]]

    for a, b in zip(run("packed"), run("padded")):
        torch.testing.assert_close(a, b, atol=5e-2, rtol=0)
