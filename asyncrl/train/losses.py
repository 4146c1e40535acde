"""Loss functions: pure, named tensors in, (loss, stats) out.

The token normaliser is passed in rather than computed from the micro-batch, so summing the losses
of micro-batches with the global token count as normaliser equals the loss of one big batch.
"""

from __future__ import annotations

import torch


def sft_loss(
    logprobs: torch.Tensor, loss_mask: torch.Tensor, normalizer: float | torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy on masked tokens.

    logprobs [B, T] of the target tokens, loss_mask [B, T] (1 = train on this token).
    """
    mask = loss_mask.to(logprobs.dtype)
    nll = -(logprobs * mask).sum()
    loss = nll / normalizer
    n = mask.sum().clamp(min=1)
    return loss, {"sft/nll_per_token": float(nll.detach() / n), "sft/tokens": float(mask.sum())}
