"""A mixture-of-experts layer's MLP in the compact decoder (decoder.py): routing, then the experts.

`route`: the router's logits, softmax in fp32, the top-k experts of each row (their probabilities
renormalised to sum to 1 where the model says so), as transformers' Qwen3-MoE and Mixtral routers
compute them. `run_experts`: each chosen expert once over the rows routed to it (rows sorted by
expert: one gather, two matmuls and one index_add per expert hit, no per-token loop), its
weighted output added into its rows in ascending expert order, as transformers sums them. The
per-expert row counts are read on the host once per layer (so a CUDA graph cannot capture it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from asyncrl.inference.decoder_args import MoeArgs


def route(moe: MoeArgs, router_w: torch.Tensor, h: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k] in fp32, experts [n, k]) of rows h [n, D] under router_w [E, D]."""
    probs = F.linear(h, router_w).float().softmax(-1)
    top_w, top_i = probs.topk(moe.top_k, -1)
    if moe.norm_topk_prob:
        top_w = top_w / top_w.sum(-1, keepdim=True)
    return top_w, top_i


def run_experts(moe: MoeArgs, gate_up: torch.Tensor, down: torch.Tensor, h: torch.Tensor,
                top_w: torch.Tensor, top_i: torch.Tensor,
                act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The sparse MLP's output [n, D]: gate_up [E, 2I, D] (gate first), down [E, D, I]; the
    routing weights are rounded to h's dtype first."""
    weights = top_w.to(h.dtype).reshape(-1)
    flat = top_i.reshape(-1)  # (row, choice) pairs, grouped by expert below
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
    rows = order // moe.top_k
    weights = weights[order, None]
    inputs = h[rows]
    out = torch.zeros_like(h)
    inter, start = moe.intermediate_size, 0
    for e, count in enumerate(counts):
        if not count:
            continue
        part = slice(start, start + count)
        start += count
        mid = F.linear(inputs[part], gate_up[e])
        y = F.linear(act(mid[:, :inter]) * mid[:, inter:], down[e])
        out.index_add_(0, rows[part], y * weights[part])
    return out
