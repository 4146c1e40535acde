"""Rotary frequencies of a decoder, as transformers' own rotary module computes them.

Every RoPE variant transformers ships (default, linear, dynamic, yarn, longrope, llama3, ...)
comes from its `<Model>RotaryEmbedding` class, built here from the model's config object: its
inverse frequencies and post-scaling factor per layer type (Gemma 3 rotates its sliding-window
layers with one base and its global layers with another). The engine turns them into cos/sin
tables with the arithmetic transformers' forward uses, so the rotations are the trainer's.

Two variants change their frequencies with the length of the sequence being computed: `dynamic`
(beyond max_position_embeddings) and `longrope` (beyond original_max_position_embeddings). A
cache holds keys rotated at earlier lengths while the trainer rotates the whole sequence at its
final length, so these are served exactly only while every sequence stays below the threshold:
`length_limit` says how long that is.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

DEFAULT_KIND = ""  # the one rope of a model without per-layer-type rotations


@dataclass(frozen=True)
class RopeFrequencies:
    inv_freq: torch.Tensor  # fp32 [head_dim / 2 (times partial_rotary_factor)]
    scaling: float  # cos and sin are multiplied by it (yarn's and longrope's attention factor)


def rotary_class(config: Any) -> type:
    """transformers' `<Model>RotaryEmbedding` for `config`'s causal LM."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    module = importlib.import_module(model_cls.__module__)
    name = model_cls.__name__.replace("ForCausalLM", "RotaryEmbedding")
    cls = getattr(module, name, None)
    if cls is None:
        raise ValueError(f"{module.__name__} has no {name}")
    return cls


def rope_frequencies(config: Any) -> dict[str, RopeFrequencies]:
    """{layer type (DEFAULT_KIND when the model has one rope): its frequencies} of `config`."""
    with torch.device("cpu"):  # whatever default device the caller set: host tables
        rotary = rotary_class(config)(config=config)
    kinds = sorted(getattr(rotary, "rope_type", {}) or {}) if isinstance(
        getattr(rotary, "rope_type", None), dict) else [DEFAULT_KIND]
    out = {}
    for kind in kinds:
        prefix = f"{kind}_" if kind else ""
        inv_freq = getattr(rotary, f"{prefix}inv_freq")
        scaling = float(getattr(rotary, f"{prefix}attention_scaling", 1.0))
        out[kind] = RopeFrequencies(inv_freq.detach().float().cpu(), scaling)
    return out


def layer_rope_kinds(config: Any, num_layers: int, kinds: list[str]) -> tuple[str, ...]:
    """The rope kind each layer rotates with."""
    if kinds == [DEFAULT_KIND]:
        return (DEFAULT_KIND,) * num_layers
    return tuple(config.layer_types)


def _params_by_kind(config: Any) -> dict[str, dict]:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        return params
    return {DEFAULT_KIND: params}


def rope_types(config: Any) -> set[str]:
    return {p.get("rope_type", p.get("type", "default")) for p in _params_by_kind(config).values()}


def length_limit(config: Any) -> int | None:
    """The longest sequence whose rotations do not depend on its length (None: any)."""
    limits = []
    for p in _params_by_kind(config).values():
        kind = p.get("rope_type", p.get("type", "default"))
        if kind == "dynamic":
            limits.append(config.max_position_embeddings)
        elif kind == "longrope":
            limits.append(p.get("original_max_position_embeddings")
                          or getattr(config, "original_max_position_embeddings", None)
                          or config.max_position_embeddings)
    return min(limits) if limits else None


def cos_sin(freqs: RopeFrequencies, positions: torch.Tensor, head_dim: int,
            dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin with rotate_half's sign folded in: [-sin, sin]) rows [len(positions), head_dim]
    in `dtype`, computed as transformers' rotary forward does (fp32 angles, the scaling, then
    the cast); dims past the rotated part (partial rotary) get cos 1, sin 0."""
    angles = positions.float()[:, None] * freqs.inv_freq.to(positions.device)[None]
    emb = torch.cat([angles, angles], -1)
    cos = (emb.cos() * freqs.scaling).to(dtype)
    sin = (emb.sin() * freqs.scaling).to(dtype)
    half = sin.shape[-1] // 2
    sin = torch.cat([-sin[:, :half], sin[:, half:]], -1)
    rotated = cos.shape[-1]
    if rotated != head_dim:
        raise ValueError(f"partial rotary embeddings ({rotated} of {head_dim} dims) are not "
                         "supported")
    return cos, sin
