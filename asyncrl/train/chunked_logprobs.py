"""Per-token logprobs (and entropies) from hidden states without the [tokens, vocab] logits.

A policy's head turns N hidden states [N, D] into N x V logits; at a real vocabulary (152k for
Qwen) and a long micro-batch that fp32 tensor, its softmax and their gradients are the largest
thing a training step holds. `chunked_logprobs` computes, `chunk` tokens at a time, the logits of
the chunk, the logprob of each next token and optionally the entropy, and keeps only the per-token
log-normaliser; the backward recomputes each chunk's logits and accumulates the gradients of the
hidden states and of the output matrix. Values and gradients are those of
`gather_logprobs` / `entropy_from_logits` on the full logits (same convention: log_softmax(z / T)).
"""

from __future__ import annotations

import torch


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, temperature: float) -> torch.Tensor:
    """[n, V] logits / T (fp32, or fp64 for fp64 inputs) of hidden rows `h` under the output
    matrix `w` [V, D], multiplied in the autocast dtype when one is active, as the model's own
    lm_head would."""
    z = h @ w.t()
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z / temperature if temperature != 1.0 else z


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                temperature: float, chunk: int, with_entropy: bool):
        n = hidden.shape[0]
        dtype = torch.promote_types(hidden.dtype, torch.float32)
        logprobs = hidden.new_empty(n, dtype=dtype)
        entropy = hidden.new_empty(n if with_entropy else 0, dtype=dtype)
        lse = hidden.new_empty(n, dtype=dtype)
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            z = _chunk_logits(hidden[start:end], weight, temperature)
            lse[start:end] = torch.logsumexp(z, -1)
            picked = z.gather(1, labels[start:end, None])[:, 0]
            logprobs[start:end] = picked - lse[start:end]
            if with_entropy:
                p = torch.softmax(z, -1)
                entropy[start:end] = lse[start:end] - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, labels, lse, entropy)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        ctx.autocast = torch.is_autocast_enabled(hidden.device.type)
        ctx.autocast_dtype = torch.get_autocast_dtype(hidden.device.type)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_lp: torch.Tensor, grad_ent: torch.Tensor):
        hidden, weight, labels, lse, entropy = ctx.saved_tensors
        t = ctx.temperature
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=lse.dtype) if ctx.needs_input_grad[1] else None
        with torch.autocast(hidden.device.type, dtype=ctx.autocast_dtype, enabled=ctx.autocast):
            for start in range(0, hidden.shape[0], ctx.chunk):
                end = min(start + ctx.chunk, hidden.shape[0])
                h = hidden[start:end]
                z = _chunk_logits(h, weight, t)
                log_p = z - lse[start:end, None]
                p = log_p.exp()
                # d logprob / d z = onehot - p;  d entropy / d z = -p (log p + H)
                g = -p * grad_lp[start:end, None]
                g.scatter_add_(1, labels[start:end, None], grad_lp[start:end, None])
                if ctx.with_entropy:
                    g -= p * (log_p + entropy[start:end, None]) * grad_ent[start:end, None]
                g = g / t if t != 1.0 else g
                if grad_h is not None:
                    grad_h[start:end] = (g.to(h.dtype) @ weight.to(h.dtype)).to(hidden.dtype)
                if grad_w is not None:
                    grad_w += g.t() @ h.to(g.dtype)
        return grad_h, None if grad_w is None else grad_w.to(weight.dtype), None, None, None, None


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                     temperature: float = 1.0, chunk: int = 1024, with_entropy: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [..., D], weight [V, D], labels [...] -> (logprobs [...] fp32, entropy [...] fp32
    or None), computed `chunk` tokens at a time (see the module docstring)."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk} is out of range; allowed >= 1")
    shape = labels.shape
    lp, ent = _ChunkedLogprobs.apply(hidden.reshape(-1, hidden.shape[-1]), weight,
                                     labels.reshape(-1), temperature, chunk, with_entropy)
    return lp.view(shape), ent.view(shape) if with_entropy else None
