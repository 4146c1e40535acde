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
from asyncrl.train.engine import HFTrainEngine, auto_pads
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


def test_auto_layout_packs_unless_padding_is_cheap_on_a_cpu():
    """auto on a CPU: padded rows while they compute at most PAD_AT_MOST positions per real
    token, else one packed row (on CUDA always packed: the engine cannot be built here); the
    model's attention serves both (varlen for packed rows, SDPA with its masks for padded)."""
    assert auto_pads([30, 28, 31, 29]) and not auto_pads([16, 512, 200, 90])
    engine = HFTrainEngine(model_for("qwen3"), TrainEngineConfig(device="cpu",
                                                                 share_prefixes=False))
    assert not engine.padded and engine.model.config._attn_implementation == NAME
    even, spread = samples_of([30, 28, 31, 29]), samples_of([16, 120, 60, 40])
    assert engine._pads(engine._plan(even, None)[0][0])
    assert not engine._pads(engine._plan(spread, None)[0][0])
    for batch in (even, spread):  # each layout gives the padded layout's logprobs
        ref = HFTrainEngine(model_for("qwen3"), TrainEngineConfig(
            device="cpu", attention_layout="padded", share_prefixes=False)).forward(batch)
        for got, want in zip(engine.forward(batch), ref):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def samples_of(lengths: list[int]) -> list[Sample]:
    return [Sample(input_ids=[(7 * i + j) % 300 + 3 for j in range(n)], loss_mask=[0] + [1] * (n - 1),
                   logprobs=[0.0] * n, versions=[-1] + [0] * (n - 1))
            for i, n in enumerate(lengths)]


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


def test_chunked_head_in_the_engine_equals_full_logits(monkeypatch):
    """The chunked head on every micro-batch (its size threshold set to 0: the tiny vocabulary's
    logits never reach the default 256 MiB)."""
    import copy

    import asyncrl.train.engine as engine_module

    model = model_for("qwen3")
    batch = samples()
    ref_values, ref_grads = outputs_and_grads(copy.deepcopy(model), "packed", 0, batch)
    monkeypatch.setattr(engine_module, "CHUNK_ABOVE_BYTES", 0)
    values, grads = outputs_and_grads(copy.deepcopy(model), "packed", 16, batch)
    for a, b in zip(values, ref_values):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    for name in grads:  # fp32 in another summation order: within 1e-6 of the tensor's scale
        scale = max(1.0, ref_grads[name].abs().max().item())
        assert (grads[name] - ref_grads[name]).abs().max().item() <= 1e-6 * scale, name


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd keeps for the backward of `fn()`: what a forward
    holds until its backward, the bulk of a step's peak."""
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.sum().backward()
    return sum(seen.values())


def test_chunked_head_holds_a_fraction_of_the_full_logits_memory():
    """What each head keeps for its backward on 4,096 tokens of a 32k vocabulary (the [N, V] fp32
    logits: 512 MiB): the full head at least those logits, the chunked one the hidden states, the
    output matrix and per-token numbers. (Peak RSS growth of a forward + backward, each in its own
    process, measured on this machine: 252 MiB chunked against 2,571 MiB full.)"""
    torch.manual_seed(0)
    n, d, v = 4096, 64, 32768
    hidden = torch.randn(n, d, requires_grad=True)
    weight = torch.randn(v, d, requires_grad=True)
    labels = torch.randint(0, v, (n,))
    full = saved_bytes(lambda: gather_logprobs(hidden @ weight.t(), labels))
    chunked = saved_bytes(lambda: chunked_logprobs(hidden, weight, labels, chunk=256)[0])
    assert full >= n * v * 4, full
    assert chunked < n * v * 4 / 16, (chunked, full)


def test_split_output_head_names_what_it_cannot_split():
    model = model_for("qwen3")
    trunk, head = split_output_head(model)
    assert trunk is model.model and head is model.lm_head
    model.config.final_logit_softcapping = 30.0
    assert "final_logit_softcapping=30.0" in split_output_head(model)
    engine = HFTrainEngine(model, TrainEngineConfig(device="cpu"))
    assert engine.trunk is None and engine.chunked is None


def test_the_chunked_head_serves_micro_batches_with_large_logits(monkeypatch):
    """Above the threshold the trunk and the chunked head run; below, the whole model."""
    import asyncrl.train.engine as engine_module

    engine = HFTrainEngine(model_for("qwen3"), TrainEngineConfig(device="cpu"))
    assert isinstance(engine.chunked, ChunkedLogprobHead)
    vocab = engine.chunked.lm_head.weight.shape[0]
    monkeypatch.setattr(engine_module, "CHUNK_ABOVE_BYTES", 100 * vocab * 4)
    assert engine._head_for(100) is engine.head and engine._head_for(101) is engine.chunked


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


def fake_varlen(version: str):
    """torch's varlen_attn as each torch version's signature takes it (2.10: is_causal; 2.11:
    scale, window_size; 2.12: enable_gqa), computed with SDPA per sample on the CPU: the flash
    kernel needs a GPU. Checks how `_flash_call` maps a layer onto each signature."""
    import torch.nn.functional as F

    def attend(q, k, v, cu, cu_k, max_q, max_k, scale=None, window=None, gqa=False):
        out = []
        for a, b in zip(cu.tolist()[:-1], cu.tolist()[1:]):
            qs, ks, vs = (t[a:b].transpose(0, 1) for t in (q, k, v))
            if ks.shape[0] != qs.shape[0]:
                assert gqa, "GQA inputs without enable_gqa"
            i = torch.arange(b - a)
            mask = (i[:, None] >= i[None, :]) & (
                True if window is None or window[0] < 0 else i[:, None] - i[None, :] <= window[0])
            out.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale,
                                                      enable_gqa=gqa).transpose(0, 1))
        return torch.cat(out)

    if version == "2.10":
        def fn(q, k, v, cu, cu_k, max_q, max_k, is_causal=False, return_aux=None):
            assert is_causal
            return attend(q, k, v, cu, cu_k, max_q, max_k)
    elif version == "2.11":
        def fn(q, k, v, cu, cu_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1)):
            return attend(q, k, v, cu, cu_k, max_q, max_k, scale, window_size)
    else:
        def fn(q, k, v, cu, cu_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False):
            return attend(q, k, v, cu, cu_k, max_q, max_k, scale, window_size, enable_gqa)
    return fn


@pytest.mark.parametrize("version", ["2.10", "2.11", "2.12"])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("scaling", [None, 0.3])
def test_each_torch_varlen_signature_gets_the_layer_or_declines(version, window, scaling,
                                                               monkeypatch):
    import inspect

    import asyncrl.train.varlen_attention as va

    fn = fake_varlen(version)
    monkeypatch.setattr(va, "_flash_varlen",
                        lambda: (fn, frozenset(inspect.signature(fn).parameters)))
    torch.manual_seed(0)
    q, k, v = torch.randn(19, 4, 8), torch.randn(19, 2, 8), torch.randn(19, 2, 8)
    cu = torch.tensor([0, 5, 13, 19], dtype=torch.int32)
    got = va._flash_call(q, k, v, cu, 8, scaling, window)
    if version == "2.10" and (window is not None or scaling is not None):
        assert got is None  # declined: the per-sample SDPA path serves it
        return
    module = torch.nn.Module().eval()
    want, _ = va.varlen_attention(module, q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                  v.transpose(0, 1)[None], None, scaling=scaling,
                                  sliding_window=window, cu_seq_lens_q=cu, max_length_q=8)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=0)
