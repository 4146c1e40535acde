"""The matmuls of a decoder layer, with two interchangeable implementations.

`PlainMatmuls` is torch BLAS calls on the stored weights (any device). `OneDNNMatmuls` is the CPU
fast path: weights prepacked once into oneDNN's blocked layout (repacked after every weight
update), and the layer's elementwise tail fused into the matmul epilogue: the q/k/v bias, the
SiLU of the gate, the gate * up product and both residual adds. On the 6M-parameter benchmark model
this makes a batch-64 decode layer's matmuls about 25% faster than `F.linear`, and saves the
separate elementwise passes. It uses the private `torch.ops.mkldnn._linear_pointwise` ops that
torch.compile's CPU backend relies on, so availability is probed and results are cross-checked
against the plain path before use; anything unexpected falls back to `PlainMatmuls`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F


class LayerWeights(Protocol):
    qkv_w: torch.Tensor  # [(H + 2K) * hd, D]
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor  # [D, H * hd]
    gate_up_w: torch.Tensor  # [2 * I, D]
    down_w: torch.Tensor  # [D, I]


class PlainMatmuls:
    def __init__(self, layers: list[LayerWeights], lm_head: torch.Tensor) -> None:
        self.layers, self.lm_head = layers, lm_head

    def qkv(self, i: int, h: torch.Tensor) -> torch.Tensor:
        w = self.layers[i]
        return F.linear(h, w.qkv_w, w.qkv_b)

    def o_proj_add(self, i: int, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.addmm(residual, attn, self.layers[i].o_w.t())

    def mlp_add(self, i: int, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        w = self.layers[i]
        inter = w.down_w.shape[1]
        gate_up = F.linear(h, w.gate_up_w)
        return torch.addmm(residual, F.silu(gate_up[:, :inter]) * gate_up[:, inter:], w.down_w.t())

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.lm_head)


class OneDNNMatmuls:
    # Below this many rows the packed call's fixed overhead outweighs its faster kernel.
    MIN_ROWS = 16

    def __init__(self, layers: list[LayerWeights], lm_head: torch.Tensor, rows_hint: int) -> None:
        self.layers, self.lm_head, self.rows_hint = layers, lm_head, rows_hint
        self.packed: list[dict[str, torch.Tensor]] = []
        self.lm_packed: torch.Tensor | None = None
        self.repack()

    @staticmethod
    def available() -> bool:
        mkldnn = torch.backends.mkldnn
        return mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")

    def repack(self) -> None:
        """Rebuild the packed copies from the stored weights (after any weight update)."""

        def pack(w: torch.Tensor) -> torch.Tensor:
            return torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), self.rows_hint)

        self.packed = []
        for w in self.layers:
            inter = w.down_w.shape[1]
            self.packed.append({
                "qkv": pack(w.qkv_w), "o": pack(w.o_w), "down": pack(w.down_w),
                "gate": pack(w.gate_up_w[:inter]), "up": pack(w.gate_up_w[inter:]),
            })
        self.lm_packed = pack(self.lm_head)

    def qkv(self, i: int, h: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            h, self.packed[i]["qkv"], self.layers[i].qkv_b, "none", [], ""
        )

    def o_proj_add(self, i: int, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise.binary(
            attn, residual, self.packed[i]["o"], None, "add"
        )

    def mlp_add(self, i: int, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        p, lp = self.packed[i], torch.ops.mkldnn._linear_pointwise
        gate = lp(h, p["gate"], None, "swish", [], "")  # swish == SiLU
        act = lp.binary(h, gate, p["up"], None, "mul")
        return lp.binary(act, residual, p["down"], None, "add")

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(h, self.lm_packed, None, "none", [], "")


def make_fast_matmuls(
    layers: list[LayerWeights], lm_head: torch.Tensor, rows_hint: int
) -> OneDNNMatmuls | None:
    """The oneDNN path if it exists here and agrees with plain torch on random inputs, else None."""
    if lm_head.device.type != "cpu" or not OneDNNMatmuls.available():
        return None
    try:
        fast = OneDNNMatmuls(layers, lm_head, rows_hint)
        plain = PlainMatmuls(layers, lm_head)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(OneDNNMatmuls.MIN_ROWS, lm_head.shape[1], generator=g).to(lm_head.dtype)
        a = torch.randn(x.shape[0], layers[0].o_w.shape[1], generator=g).to(lm_head.dtype)
        pairs = [
            (fast.qkv(0, x), plain.qkv(0, x)),
            (fast.o_proj_add(0, a, x), plain.o_proj_add(0, a, x)),
            (fast.mlp_add(0, x, x), plain.mlp_add(0, x, x)),
        ]
    except (RuntimeError, AttributeError, NotImplementedError):  # op missing in this build
        return None
    tol = 1e-4 if lm_head.dtype == torch.float32 else 5e-2
    ok = all(torch.allclose(f.float(), p.float(), rtol=tol, atol=tol) for f, p in pairs)
    return fast if ok else None
