"""The compact decoder's weights: each layer's tensors (fused q/k/v and gate/up; a mixture-of-
experts layer's router and stacked experts instead of a dense MLP), allocated once, and the
Hugging Face name each checkpoint tensor is copied into (a view of those tensors)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from asyncrl.inference.decoder_args import DecoderArgs


@dataclass
class Layer:
    ln1: torch.Tensor  # before the attention
    qkv_w: torch.Tensor  # [(H + 2K) * hd, D]: q, k, v stacked
    qkv_b: torch.Tensor | None
    o_w: torch.Tensor
    ln2: torch.Tensor  # before the MLP
    gate_up_w: torch.Tensor  # [2 * I, D]: gate, up stacked
    down_w: torch.Tensor
    q_norm: torch.Tensor | None = None  # [hd]: Qwen3, Gemma 3
    k_norm: torch.Tensor | None = None
    post_attn: torch.Tensor | None = None  # Gemma 3: after the attention, before the residual
    post_mlp: torch.Tensor | None = None  # Gemma 3: after the MLP, before the residual
    router_w: torch.Tensor | None = None  # [E, D]: a mixture-of-experts layer's router
    experts_gate_up: torch.Tensor | None = None  # [E, 2 * I, D]: gate, up stacked per expert
    experts_down: torch.Tensor | None = None  # [E, D, I]


def empty_layers(a: DecoderArgs, empty: Callable[..., torch.Tensor]) -> list[Layer]:
    """Every layer's tensors, zeros of `empty(*shape)`."""
    d, hd, inter = a.hidden_size, a.head_dim, a.intermediate_size
    q_dim, kv_dim = a.num_heads * hd, a.num_kv_heads * hd
    sparse = a.moe.sparse if a.moe is not None else (False,) * a.num_layers

    def mlp(i: int) -> dict[str, torch.Tensor]:
        if not sparse[i]:
            return {"gate_up_w": empty(2 * inter, d), "down_w": empty(d, inter)}
        e, mi = a.moe.num_experts, a.moe.intermediate_size
        return {"gate_up_w": empty(0, d), "down_w": empty(d, 0), "router_w": empty(e, d),
                "experts_gate_up": empty(e, 2 * mi, d), "experts_down": empty(e, d, mi)}

    return [Layer(ln1=empty(d), qkv_w=empty(q_dim + 2 * kv_dim, d),
                  qkv_b=empty(q_dim + 2 * kv_dim) if a.attention_bias else None,
                  o_w=empty(d, q_dim), ln2=empty(d),
                  q_norm=empty(hd) if a.qk_norm else None,
                  k_norm=empty(hd) if a.qk_norm else None,
                  post_attn=empty(d) if a.gemma else None,
                  post_mlp=empty(d) if a.gemma else None, **mlp(i))
            for i in range(a.num_layers)]


def hf_names(layers: list[Layer], embed: torch.Tensor, lm_head: torch.Tensor,
             norm: torch.Tensor, args: DecoderArgs) -> dict[str, torch.Tensor]:
    """HF parameter name -> the (view of the) tensor it is copied into."""
    q, kv = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
    inter = args.intermediate_size
    m = {"model.embed_tokens.weight": embed, "model.norm.weight": norm}
    if not args.tie_word_embeddings:
        m["lm_head.weight"] = lm_head
    for i, w in enumerate(layers):
        p = f"model.layers.{i}."
        m[p + "input_layernorm.weight"] = w.ln1
        if args.gemma:  # its post_attention_layernorm follows the attention
            m[p + "post_attention_layernorm.weight"] = w.post_attn
            m[p + "pre_feedforward_layernorm.weight"] = w.ln2
            m[p + "post_feedforward_layernorm.weight"] = w.post_mlp
        else:
            m[p + "post_attention_layernorm.weight"] = w.ln2
        if w.q_norm is not None:
            m[p + "self_attn.q_norm.weight"] = w.q_norm
            m[p + "self_attn.k_norm.weight"] = w.k_norm
        parts = (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, None)))
        for name, sl in parts:
            m[p + f"self_attn.{name}_proj.weight"] = w.qkv_w[sl]
            if w.qkv_b is not None:
                m[p + f"self_attn.{name}_proj.bias"] = w.qkv_b[sl]
        m[p + "self_attn.o_proj.weight"] = w.o_w
        if w.router_w is None:
            m[p + "mlp.gate_proj.weight"] = w.gate_up_w[:inter]
            m[p + "mlp.up_proj.weight"] = w.gate_up_w[inter:]
            m[p + "mlp.down_proj.weight"] = w.down_w
            continue
        mi = args.moe.intermediate_size  # per expert, as checkpoints name them
        m[p + "mlp.gate.weight"] = w.router_w
        for e in range(args.moe.num_experts):
            m[p + f"mlp.experts.{e}.gate_proj.weight"] = w.experts_gate_up[e, :mi]
            m[p + f"mlp.experts.{e}.up_proj.weight"] = w.experts_gate_up[e, mi:]
            m[p + f"mlp.experts.{e}.down_proj.weight"] = w.experts_down[e]
    return m
