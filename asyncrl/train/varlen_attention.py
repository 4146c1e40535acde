"""Attention over a packed row without padding: each sample attends to itself only.

A packed micro-batch is one row of N tokens holding k samples (`PackedMicroBatch.cu_seqlens`).
Read as one dense [N, N] masked matrix it costs N^2 per layer; padded to k rows of the longest
length L it costs k * L^2 and every linear layer computes the padding too. This attention
function computes exactly the k causal blocks: on CUDA with torch's `varlen_attn` (FlashAttention
over `cu_seqlens`, torch >= 2.10; a window or a non-default scale needs a torch whose
`varlen_attn` takes them) for half-precision inputs, elsewhere one `scaled_dot_product_attention`
call per sample. Nothing outside the samples is computed, by the
attention or by the linear layers around it.

It is registered with transformers under `NAME` (AttentionInterface and AttentionMaskInterface).
Outside `packed_rows()` it is transformers' SDPA attention with SDPA's masks, so a model switched
to it serves every other caller unchanged. Inside, the mask function builds no mask and the
attention reads the boundaries from transformers' own packed-sequence keyword arguments
(`cu_seq_lens_q`, `max_length_q` ...), which every decoder layer forwards to its attention
function (and activation checkpointing keeps for the recompute). Sliding windows (Mistral, Qwen2,
Gemma 3's local layers) are honoured.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

NAME = "asyncrl_varlen"
_PACKED = contextvars.ContextVar("asyncrl_packed_rows", default=False)


@contextlib.contextmanager
def packed_rows() -> Iterator[None]:
    """While open, models on `NAME` build no attention mask: the forward is one packed row whose
    boundaries travel as `packed_kwargs`."""
    token = _PACKED.set(True)
    try:
        yield
    finally:
        _PACKED.reset(token)


def packed_kwargs(cu_seqlens: torch.Tensor) -> dict[str, Any]:
    """The forward keyword arguments that carry a packed row's sample boundaries [k + 1]."""
    cu = cu_seqlens.to(torch.int32)
    longest = int((cu[1:] - cu[:-1]).max()) if len(cu) > 1 else 0
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest,
            "max_length_k": longest}


def _window_mask(n: int, window: int, device: torch.device) -> torch.Tensor:
    """Bool [n, n]: query i sees key j when 0 <= i - j < window (transformers' convention)."""
    i = torch.arange(n, device=device)
    d = i[:, None] - i[None, :]
    return (d >= 0) & (d < window)


@functools.cache
def _flash_varlen() -> tuple[Any, frozenset[str]] | None:
    """torch's varlen_attn and the keyword arguments this torch's version takes (2.10: is_causal;
    2.11: scale and window_size; 2.12: enable_gqa), or None before 2.10."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _flash_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor,
                longest: int, scaling: float | None, window: int | None) -> torch.Tensor | None:
    """varlen_attn over [N, H, D] inputs, or None where this torch's version cannot express the
    layer (a window or a scale it does not take)."""
    found = _flash_varlen()
    if found is None:
        return None
    fn, params = found
    kw: dict[str, Any] = {}
    default_scale = q.shape[-1] ** -0.5
    if scaling is not None and abs(scaling - default_scale) > 1e-12 * default_scale:
        if "scale" not in params:
            return None
        kw["scale"] = scaling
    if "window_size" in params:
        kw["window_size"] = (-1, 0) if window is None else (window - 1, 0)
    elif window is None and "is_causal" in params:
        kw["is_causal"] = True
    else:
        return None
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return fn(q, k, v, cu, cu, longest, longest, **kw)


def varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask: torch.Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None,
                     sliding_window: int | None = None, softcap: float | None = None,
                     cu_seq_lens_q: torch.Tensor | None = None, max_length_q: int | None = None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, H, N, D], key/value
    [1, Hkv, N, D] -> ([1, N, H, D], None)."""
    if cu_seq_lens_q is None:  # not a packed row: transformers' SDPA attention, SDPA's mask
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask,
                                               dropout=dropout, scaling=scaling,
                                               sliding_window=sliding_window, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"attention {NAME!r} takes one packed row, got a batch of "
                         f"{query.shape[0]}")
    if softcap is not None:
        raise ValueError(f"attention {NAME!r} has no logit soft-capping (this model sets "
                         f"{softcap}); use train.attention_layout=padded")
    if attention_mask is not None and attention_mask.dtype == torch.bool and not bool(
            attention_mask.all()):
        raise ValueError(f"attention {NAME!r} got a padding mask; a packed row has none")
    p = dropout if module.training else 0.0
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [N, H, D]
    groups = q.shape[1] // k.shape[1]
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and p == 0.0:
        out = _flash_call(q, k, v, cu_seq_lens_q, int(max_length_q), scaling, sliding_window)
        if out is not None:
            return out[None], None
    pieces = []
    bounds = cu_seq_lens_q.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))  # [H, n, D]
        n = end - start
        if sliding_window is not None and sliding_window < n:
            mask = _window_mask(n, sliding_window, q.device)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, dropout_p=p,
                                               scale=scaling, enable_gqa=groups > 1)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, dropout_p=p,
                                               scale=scaling, enable_gqa=groups > 1)
        pieces.append(o.transpose(0, 1))
    out = torch.cat(pieces)
    return out[None], None


def _mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask function of `NAME`: none for a packed row (its boundaries travel as keyword
    arguments), else SDPA's."""
    if _PACKED.get():
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](*args, **kwargs)


def register() -> str:
    """Registers `NAME` with transformers (idempotent) and returns it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention)
    AttentionMaskInterface.register(NAME, _mask)
    return NAME


def use_packed_attention(model: torch.nn.Module) -> None:
    """Switches `model` (a transformers model, or a module whose `.model` is one) to `NAME`,
    unless it runs a flash-attention kernel, which reads the same keyword arguments itself."""
    target = model if hasattr(model, "set_attn_implementation") else getattr(model, "model")
    if "flash" in str(getattr(target.config, "_attn_implementation", "")):
        return
    target.set_attn_implementation(register())
