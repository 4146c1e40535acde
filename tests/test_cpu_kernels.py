"""The C++ kernels against plain torch: attention over the slot cache, RMSNorm, packed matmuls with
their epilogues, the fused forward, and the fall back to torch when no kernel can be built."""

import logging

import pytest
import torch
import torch.nn.functional as F

from asyncrl.inference import kernels
from asyncrl.inference.linear import pack_gate_up, pack_panels

LIB = kernels.load()
needs_lib = pytest.mark.skipif(
    LIB is None, reason="the C++ kernels cannot be built here (see the log): torch path only"
)


def rope_ref(x, cos, sin):
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def rope_tables(hd, max_pos=64):
    inv = 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd)
    freqs = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat([freqs.cos()] * 2, -1), torch.cat([-freqs.sin(), freqs.sin()], -1)


def attention_ref(qkv, cache, slots, positions, heads, cos, sin):
    """Per row: RoPE, write k/v at its slot and position, causal GQA attention over the slot."""
    _, kvh, _, hd = cache[0].shape
    cache = cache.clone()
    q, k, v = qkv.float().split([heads * hd, kvh * hd, kvh * hd], -1)
    c, s = cos[positions, None], sin[positions, None]
    q = rope_ref(q.view(-1, heads, hd), c, s)
    k = rope_ref(k.view(-1, kvh, hd), c, s).to(cache.dtype)
    cache[0][slots, :, positions] = k
    cache[1][slots, :, positions] = v.view(-1, kvh, hd).to(cache.dtype)
    out = []
    for r in range(qkv.shape[0]):
        t = int(positions[r]) + 1
        keys = cache[0][slots[r], :, :t].float().repeat_interleave(heads // kvh, 0)
        vals = cache[1][slots[r], :, :t].float().repeat_interleave(heads // kvh, 0)
        p = (q[r, :, None] @ keys.transpose(1, 2) * hd**-0.5).softmax(-1)
        out.append((p @ vals).reshape(-1))
    return torch.stack(out), cache


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kvh", "hd"), [(4, 2, 64), (2, 2, 128), (8, 2, 32)])
def test_attention_matches_reference(dtype, heads, kvh, hd):
    g = torch.Generator().manual_seed(0)
    rows, slots_n, max_len = 9, 5, 40
    cache = torch.randn(2, slots_n, kvh, max_len, hd, generator=g).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kvh) * hd, generator=g).to(dtype)
    # Rows of a prefill (slot 3, positions 0..3) and decode rows in other slots.
    slots = torch.tensor([3, 3, 3, 3, 0, 4, 1, 2, 0][:rows]) % slots_n
    positions = torch.tensor([0, 1, 2, 3, 17, 39, 5, 30, 0][:rows])
    slots[8], positions[8] = 0, 18  # a second row of slot 0: sees the first row's new k/v
    cos, sin = rope_tables(hd)
    want, want_cache = attention_ref(qkv, cache, slots, positions, heads, cos, sin)
    k = kernels.CpuKernels(LIB, dtype)
    got_cache = cache.clone()
    got = k.attention(qkv, got_cache[0], got_cache[1], cos, sin, slots, positions, heads)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(got_cache.float(), want_cache.float(), rtol=tol, atol=tol)


@needs_lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch(dtype):
    g = torch.Generator().manual_seed(1)
    for rows in (1, 64, 300):  # 300 rows take the multithreaded branch
        x = torch.randn(rows, 256, generator=g).to(dtype)
        w = torch.randn(256, generator=g).to(dtype)
        got = kernels.CpuKernels(LIB, dtype).rms_norm(x, w, 1e-6)
        # HF order: normalise in fp32, round to the dtype, then scale by the weight.
        normed = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6))
        want = w * normed.to(dtype)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@needs_lib
@pytest.mark.parametrize("m", [1, 7, 64, 137])  # row remainders and several row blocks
def test_gemm_epilogues(m):
    g = torch.Generator().manual_seed(2)
    k = kernels.CpuKernels(LIB, torch.float32)
    a = torch.randn(m, 96, generator=g)
    w = torch.randn(80, 96, generator=g)  # 80 columns: a partial last panel
    bias = torch.randn(80, generator=g)
    res = torch.randn(m, 80, generator=g)
    padded = F.pad(bias, (0, 16))
    torch.testing.assert_close(k.gemm(a, pack_panels(w), 80, bias=padded), F.linear(a, w, bias))
    torch.testing.assert_close(k.gemm(a, pack_panels(w), 80, residual=res), res + a @ w.t())
    gate, up = torch.randn(48, 96, generator=g), torch.randn(48, 96, generator=g)
    got = k.gemm(a, pack_gate_up(gate, up), 96, silu_mul=True)
    # Products of two ~10-sized sums: fp32 rounding of different summation orders is ~1e-5.
    torch.testing.assert_close(got, F.silu(a @ gate.t()) * (a @ up.t()), rtol=1e-5, atol=1e-4)
    strided = torch.randn(m, 200, generator=g)[:, 10:106]  # row stride 200
    torch.testing.assert_close(k.gemm(strided, pack_panels(w), 80), strided @ w.t())


@pytest.fixture
def fresh_load(monkeypatch):
    """`kernels.load` without its per-process cache, restored afterwards."""
    kernels.load.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    kernels.load.cache_clear()


def test_missing_compiler_falls_back_to_torch(fresh_load, tmp_path, caplog):
    fresh_load.setenv("ASYNCRL_CACHE", str(tmp_path))
    fresh_load.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert kernels.load() is None
    assert "torch path" in caplog.text and not list(tmp_path.iterdir())


@needs_lib
def test_cold_build_into_empty_cache(fresh_load, tmp_path):
    fresh_load.setenv("ASYNCRL_CACHE", str(tmp_path))
    lib = kernels.load()
    assert lib is not None and lib.asyncrl_kernels_abi() == kernels.ABI
    assert [p.suffix for p in (tmp_path / "kernels").iterdir()] == [".so"]  # no temp left over
    fresh_load.setenv("ASYNCRL_KERNELS", "0")
    kernels.load.cache_clear()
    assert kernels.load() is None
