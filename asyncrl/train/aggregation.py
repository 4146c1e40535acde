"""Masked reductions shared by every loss: per-token values -> one scalar, divided by a normaliser
the caller passes in.

Why the normaliser is an argument: a training step splits its batch into micro-batches; if each
micro-batch divided by its own token count, the summed gradient would weight short micro-batches
more than one big batch would. With the step's global count passed to every micro-batch, the sum
of micro-batch losses is the big-batch loss exactly (values and gradients).

Aggregation modes and what `normalizer` must be (computed over the whole step with
`loss_normalizer`, summed across micro-batches / data-parallel ranks):

- "token_mean":          sum over loss tokens of l_t / normalizer; normalizer = number of loss
                         tokens in the step. Every token weighs the same (DAPO).
- "seq_mean_token_mean": sum over sequences of (mean of l_t over that sequence's loss tokens)
                         / normalizer; normalizer = number of sequences with >= 1 loss token.
                         Every sequence weighs the same (original GRPO, GSPO).
- "seq_mean_token_sum":  sum over loss tokens of l_t / normalizer; normalizer = number of
                         sequences with >= 1 loss token (verl's seq-mean-token-sum). Pass
                         num_sequences * max_response_len instead for Dr.GRPO's constant.

Token mode is shape-agnostic (any [B, T] or packed [N]); the sequence modes read sequences off
the last dimension, so they need a padded [B, T] layout (a packed [N] tensor has no sequence
boundaries here; unpad/repad before calling).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

LossAgg = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of x over mask; `where` rather than multiply so inf/nan on padding cannot leak in."""
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask (0 when the mask is empty)."""
    return masked_sum(x, mask) / mask.bool().sum().clamp(min=1)


def _require_sequences(x: torch.Tensor, what: str) -> None:
    if x.ndim < 2:
        raise ValueError(
            f"{what} needs a padded [B, T] layout; got a tensor of shape {tuple(x.shape)} "
            "(a packed [N] batch has no sequence boundaries here)"
        )


def per_sequence_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x [B, T], mask [B, T] -> [B]: mean over each row's masked tokens (0 for an empty row)."""
    _require_sequences(x, "a per-sequence mean")
    m = mask.bool()
    total = torch.where(m, x, torch.zeros_like(x)).sum(-1)
    return total / m.sum(-1).clamp(min=1)


def _token_sum(loss_tok: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return masked_sum(loss_tok, mask)


def _seq_mean_sum(loss_tok: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_sequence_mean(loss_tok, mask).sum()


def _token_count(mask: torch.Tensor) -> torch.Tensor:
    return mask.bool().sum()


def _sequence_count(mask: torch.Tensor) -> torch.Tensor:
    _require_sequences(mask, "a sequence-level normaliser")
    return mask.bool().any(-1).sum()


# Numerator of each mode before division by the normaliser.
_NUMERATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "token_mean": _token_sum,
    "seq_mean_token_mean": _seq_mean_sum,
    "seq_mean_token_sum": _token_sum,
}
_COUNTS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "token_mean": _token_count,
    "seq_mean_token_mean": _sequence_count,
    "seq_mean_token_sum": _sequence_count,
}


def _check_agg(loss_agg: str) -> None:
    if loss_agg not in _NUMERATORS:
        raise ValueError(f"loss_agg={loss_agg!r} is not allowed; choose one of {list(_NUMERATORS)}")


def aggregate(
    loss_tok: torch.Tensor,
    loss_mask: torch.Tensor,
    normalizer: float | torch.Tensor,
    loss_agg: LossAgg = "token_mean",
) -> torch.Tensor:
    """Per-token loss [B, T] (or [N] for token_mean) -> scalar, see the module docstring."""
    _check_agg(loss_agg)
    return _NUMERATORS[loss_agg](loss_tok, loss_mask) / normalizer


def loss_normalizer(loss_mask: torch.Tensor, loss_agg: LossAgg = "token_mean") -> torch.Tensor:
    """The count `aggregate` divides by, for the step's full loss_mask [B, T].

    Call it on the whole step's batch (or sum it over micro-batches and ranks), then pass the
    same value to every micro-batch. Clamped to >= 1 so an all-masked step gives loss 0, not nan.
    """
    _check_agg(loss_agg)
    return _COUNTS[loss_agg](loss_mask).clamp(min=1)
