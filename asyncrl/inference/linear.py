"""The matmuls of a decoder layer, with three interchangeable implementations.

`PlainMatmuls` is torch BLAS calls on the stored weights (any device: CUDA runs it). The two fast
paths exist only for weights on the CPU: they prepack the weights once (again after every weight
update) and fuse the layer's elementwise tail into the matmul epilogue: the q/k/v bias,
act(gate) * up (SiLU, or Gemma's tanh-GELU) and both residual adds (a residual of None: no add,
for Gemma's norm after each block).

- `KernelMatmuls` (fp32, AVX-512 builds): the C++ kernel of `csrc/gemm.cpp` on weights packed into
  32-column panels. On the 6M-parameter benchmark model a batch-64 decode step's matmuls run about
  20% faster than oneDNN's (as fast as a large square matmul on the same machine), partly because
  a call costs ~4 us of setup instead of ~14; `forward` runs a whole decode step in one call.
- `OneDNNMatmuls` (fp32 and bf16): oneDNN's blocked layout through the private
  `torch.ops.mkldnn._linear_pointwise` ops that torch.compile's CPU backend relies on; about 25%
  faster than `F.linear` at batch 64.

Fast paths are cross-checked against the plain path on random inputs before use; anything unexpected
falls back to the next one.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from asyncrl.inference.kernels import CpuKernels, LayerTable, ModelDims

PANEL = 32  # output columns per packed panel of KernelMatmuls (kPanel in gemm.cpp)


class LayerWeights(Protocol):
    ln1: torch.Tensor  # [D]
    ln2: torch.Tensor
    qkv_w: torch.Tensor  # [(H + 2K) * hd, D]
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor  # [D, H * hd]
    gate_up_w: torch.Tensor  # [2 * I, D]
    down_w: torch.Tensor  # [D, I]


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class Matmuls(Protocol):
    MIN_ROWS: int  # below this many rows the plain path is used instead

    def qkv(self, i: int, h: torch.Tensor) -> torch.Tensor: ...

    def o_proj_add(self, i: int, attn: torch.Tensor, residual: torch.Tensor | None
                   ) -> torch.Tensor: ...

    def mlp_add(self, i: int, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor: ...

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...


def _linear_add(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w) if residual is None else torch.addmm(residual, x, w.t())


class PlainMatmuls:
    MIN_ROWS = 0

    def __init__(self, layers: list[LayerWeights], lm_head: torch.Tensor,
                 activation: str = "silu") -> None:
        self.layers, self.lm_head, self.act = layers, lm_head, ACTIVATIONS[activation]

    def qkv(self, i: int, h: torch.Tensor) -> torch.Tensor:
        w = self.layers[i]
        return F.linear(h, w.qkv_w, w.qkv_b)

    def o_proj_add(self, i: int, attn: torch.Tensor, residual: torch.Tensor | None
                   ) -> torch.Tensor:
        return _linear_add(attn, self.layers[i].o_w, residual)

    def mlp_add(self, i: int, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        w = self.layers[i]
        inter = w.down_w.shape[1]
        gate_up = F.linear(h, w.gate_up_w)
        return _linear_add(self.act(gate_up[:, :inter]) * gate_up[:, inter:], w.down_w, residual)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.lm_head)


class OneDNNMatmuls:
    # Below this many rows the packed call's fixed overhead outweighs its faster kernel.
    MIN_ROWS = 16

    # oneDNN's names for the fused activations: (attr, algorithm)
    ATTRS = {"silu": ("swish", ""), "gelu_tanh": ("gelu", "tanh")}

    def __init__(self, layers: list[LayerWeights], lm_head: torch.Tensor, rows_hint: int,
                 activation: str = "silu") -> None:
        self.layers, self.lm_head, self.rows_hint = layers, lm_head, rows_hint
        self.attr, self.algorithm = self.ATTRS[activation]
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

    @staticmethod
    def _add(x: torch.Tensor, packed: torch.Tensor, residual: torch.Tensor | None
             ) -> torch.Tensor:
        lp = torch.ops.mkldnn._linear_pointwise
        if residual is None:
            return lp(x, packed, None, "none", [], "")
        return lp.binary(x, residual, packed, None, "add")

    def o_proj_add(self, i: int, attn: torch.Tensor, residual: torch.Tensor | None
                   ) -> torch.Tensor:
        return self._add(attn, self.packed[i]["o"], residual)

    def mlp_add(self, i: int, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        p, lp = self.packed[i], torch.ops.mkldnn._linear_pointwise
        gate = lp(h, p["gate"], None, self.attr, [], self.algorithm)  # swish == SiLU
        act = lp.binary(h, gate, p["up"], None, "mul")
        return self._add(act, p["down"], residual)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(h, self.lm_packed, None, "none", [], "")


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [ceil(N / 32), K, 32]: panel p holds output columns 32p.. (zero-padded)."""
    n, k = w.shape
    w = F.pad(w, (0, 0, 0, -n % PANEL))
    return w.reshape(-1, PANEL, k).transpose(1, 2).contiguous()


def pack_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """[I, K] each -> [I / 16, K, 32]: panel p holds gate then up columns 16p..16p+15."""
    inter, k = gate.shape
    halves = [gate.reshape(inter // 16, 16, k), up.reshape(inter // 16, 16, k)]
    return torch.cat(halves, 1).transpose(1, 2).contiguous()


class KernelMatmuls:
    MIN_ROWS = 1

    def __init__(
        self, layers: list[LayerWeights], lm_head: torch.Tensor, kernels: CpuKernels
    ) -> None:
        self.layers, self.lm_head, self.k = layers, lm_head, kernels
        self.packed: list[dict[str, torch.Tensor | None]] = []
        self.lm_packed: torch.Tensor | None = None
        self.repack()

    @staticmethod
    def supports(layers: list[LayerWeights], lm_head: torch.Tensor, activation: str) -> bool:
        inter = layers[0].down_w.shape[1]
        return (lm_head.device.type == "cpu" and lm_head.dtype == torch.float32
                and inter % 16 == 0 and activation == "silu")  # the epilogue is SiLU(gate) * up

    def repack(self) -> None:
        self.packed = []
        for w in self.layers:
            inter = w.down_w.shape[1]
            bias = w.qkv_b
            self.packed.append({
                "qkv": pack_panels(w.qkv_w),
                "qkv_b": None if bias is None else F.pad(bias, (0, -bias.shape[0] % PANEL)),
                "o": pack_panels(w.o_w),
                "gate_up": pack_gate_up(w.gate_up_w[:inter], w.gate_up_w[inter:]),
                "down": pack_panels(w.down_w),
            })
        self.lm_packed = pack_panels(self.lm_head)
        # Raw pointers for the fused forward (layers.cpp); self.packed keeps them alive.
        self.table = (LayerTable * len(self.layers))(*(
            LayerTable(*(None if t is None else t.data_ptr() for t in (
                w.ln1, p["qkv"], p["qkv_b"], p["o"], w.ln2, p["gate_up"], p["down"]
            )))
            for w, p in zip(self.layers, self.packed)
        ))

    def qkv(self, i: int, h: torch.Tensor) -> torch.Tensor:
        p = self.packed[i]
        return self.k.gemm(h, p["qkv"], self.layers[i].qkv_w.shape[0], bias=p["qkv_b"])

    def o_proj_add(self, i: int, attn: torch.Tensor, residual: torch.Tensor | None
                   ) -> torch.Tensor:
        w = self.layers[i]
        return self.k.gemm(attn, self.packed[i]["o"], w.o_w.shape[0], residual=residual)

    def mlp_add(self, i: int, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        w, p = self.layers[i], self.packed[i]
        act = self.k.gemm(h, p["gate_up"], w.gate_up_w.shape[0], silu_mul=True)
        return self.k.gemm(act, p["down"], w.down_w.shape[0], residual=residual)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.k.gemm(h, self.lm_packed, self.lm_head.shape[0])

    def forward(
        self, x: torch.Tensor, norm: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor,
        dims: ModelDims,
    ) -> torch.Tensor:
        """A whole decode step in one C++ call (layers.cpp): embeddings x [n, D] (overwritten)
        -> logits [n, V]; row i is cache slot i at positions[i] (int64)."""
        return self.k.forward(
            self.table, dims, norm, self.lm_packed, self.lm_head.shape[0], x, cache, positions
        )


def _agrees(fast: Matmuls, layers: list[LayerWeights], lm_head: torch.Tensor,
            activation: str) -> bool:
    """Whether `fast` matches the plain path on random inputs (a broken op raises or differs)."""
    plain = PlainMatmuls(layers, lm_head, activation)
    g = torch.Generator().manual_seed(0)  # CPU: the fast paths exist only there
    rows, dt = OneDNNMatmuls.MIN_ROWS, lm_head.dtype
    x = torch.randn(rows, lm_head.shape[1], generator=g, device="cpu").to(dt)
    a = torch.randn(rows, layers[0].o_w.shape[1], generator=g, device="cpu").to(dt)
    pairs = [
        (fast.qkv(0, x), plain.qkv(0, x)),
        (fast.o_proj_add(0, a, x), plain.o_proj_add(0, a, x)),
        (fast.mlp_add(0, x, x), plain.mlp_add(0, x, x)),
        (fast.mlp_add(0, x, None), plain.mlp_add(0, x, None)),
        (fast.o_proj_add(0, a, None), plain.o_proj_add(0, a, None)),
        (fast.logits(x), plain.logits(x)),
    ]
    tol = 1e-4 if lm_head.dtype == torch.float32 else 5e-2
    return all(torch.allclose(f.float(), p.float(), rtol=tol, atol=tol) for f, p in pairs)


def make_fast_matmuls(
    layers: list[LayerWeights], lm_head: torch.Tensor, rows_hint: int,
    kernels: CpuKernels | None = None, activation: str = "silu",
) -> Matmuls | None:
    """The C++ kernel path (fp32, when `kernels` is given), else oneDNN, if it exists here and
    agrees with plain torch on random inputs; None if neither does."""
    if lm_head.device.type != "cpu":
        return None
    if (kernels is not None and kernels.gemm_preferred
            and KernelMatmuls.supports(layers, lm_head, activation)):
        fast = KernelMatmuls(layers, lm_head, kernels)
        if _agrees(fast, layers, lm_head, activation):
            return fast
    if not OneDNNMatmuls.available():
        return None
    try:
        fast = OneDNNMatmuls(layers, lm_head, rows_hint, activation)
        return fast if _agrees(fast, layers, lm_head, activation) else None
    except (RuntimeError, AttributeError, NotImplementedError):  # op missing in this build
        return None
