"""asyncrl's stand-in for SGLang's `sgl_kernel`, installed into the venv by sglang_venv.py.

It replaces the sglang-kernel wheel, whose PyPI builds are CUDA-only (the CPU build of its C++
ops is not published): with SGLANG_USE_CPU_ENGINE=1, sglang imports
`sgl_kernel.assign_req_to_token_pool_cpu` at start-up and calls it on every batch, so that op is
written here in PyTorch. Every other op falls back to sglang's own torch code for a plain float32
Qwen2 model, because no `torch.ops.sgl_kernel` ops are registered (sglang then leaves its Intel AMX
path off). Any other name imported from this module raises a NotImplementedError when called, so a
code path that needs a real sgl_kernel op fails saying so instead of computing something wrong.
"""

from __future__ import annotations

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Write each request's new KV-cache slots into its row of the request-to-token table.

    Request i of the batch owns row `req_pool_indices[i]` of `req_to_token` and gets
    `end_offset[i] - start_offset[i]` new tokens at columns start..end; their slots are the next
    ones in `out_cache_loc`, which holds the batch's new slots request after request (what the
    Triton kernel `assign_req_to_token_pool` in sglang/srt/mem_cache/allocation.py does).
    `pool_len` is the row length, `req_to_token.shape[1]`, unused here.
    """
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    taken = 0
    for row, start, end in zip(rows, starts, ends):
        req_to_token[row, start:end] = out_cache_loc[taken:taken + end - start].to(
            req_to_token.dtype)
        taken += end - start


def __getattr__(name: str):
    if name.startswith("__"):  # keep Python's own protocol look-ups (__path__, __all__) normal
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} is not implemented: this sgl_kernel is asyncrl's CPU stand-in "
            "(tests/integration/sglang_standins), which has only assign_req_to_token_pool_cpu")

    missing.__name__ = name
    return missing
