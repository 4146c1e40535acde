"""Masked reductions shared by every loss: per-token values -> one scalar, divided by a normaliser
the caller passes in.

Why the normaliser is an argument: a training step splits its batch into micro-batches; if each
micro-batch divided by its own token count, the summed gradient would weight short micro-batches
more than one big batch would. With the step's global count passed to every micro-batch, the sum
of micro-batch losses is the big-batch loss exactly (values and gradients).

Aggregation modes and what `normalizer` must be (`normalizer_count` summed over every
micro-batch of the step and every data-parallel rank):

- "token_mean":          sum over loss tokens of l_t / normalizer; normalizer = number of loss
                         tokens in the step. Every token weighs the same (DAPO).
- "seq_mean_token_mean": sum over sequences of (mean of l_t over that sequence's loss tokens)
                         / normalizer; normalizer = number of sequences with >= 1 loss token.
                         Every sequence weighs the same (original GRPO, GSPO).
- "seq_mean_token_sum":  sum over loss tokens of l_t / normalizer; normalizer = number of
                         sequences with >= 1 loss token (verl's seq-mean-token-sum). Pass
                         num_sequences * max_response_len instead for Dr.GRPO's constant.
- "seq_mean_token_sum_norm": that, divided by the constant `horizon` too: the step divides by
                         sequences x horizon (Dr.GRPO's batch x max length; equal to TRL's
                         `loss_type="dr_grpo"`), so no length enters the normaliser. verl's
                         seq-mean-token-sum-norm divides by the horizon only: on the same
                         tensors its value is the sequence count times this one.

Token mode is shape-agnostic (any [B, T] or packed [N]). The sequence modes read sequences off
the last dimension of a padded [B, T] layout, or, for a packed [N] micro-batch, off `seq_id` [N]
(which sample each token belongs to, as the trainer packs it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from asyncrl.train.config import LossAgg



def masked_sum(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of x over mask; `where` rather than multiply so inf/nan on padding cannot leak in."""
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum()


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask (0 when the mask is empty)."""
    return masked_sum(x, mask) / mask.bool().sum().clamp(min=1)


def _require_sequences(x: torch.Tensor, seq_id: torch.Tensor | None, what: str) -> None:
    if x.ndim < 2 and seq_id is None:
        raise ValueError(
            f"{what} needs a padded [B, T] layout or the packed batch's seq_id; got a tensor of "
            f"shape {tuple(x.shape)} and no seq_id"
        )


def _segments(x: torch.Tensor, mask: torch.Tensor, seq_id: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed [N] -> per-sequence (masked sum, masked count), each [num_sequences]."""
    m = mask.bool()
    n = int(seq_id.max()) + 1 if seq_id.numel() else 0
    values = torch.where(m, x, torch.zeros_like(x))
    total = values.new_zeros(n).index_add(0, seq_id, values)
    count = values.new_zeros(n).index_add(0, seq_id, m.to(values.dtype))
    return total, count


def per_sequence_mean(x: torch.Tensor, mask: torch.Tensor,
                      seq_id: torch.Tensor | None = None) -> torch.Tensor:
    """Mean over each sequence's masked tokens (0 for a sequence without any): x, mask [B, T]
    -> [B]; or packed x, mask, seq_id [N] -> [number of sequences]."""
    _require_sequences(x, seq_id, "a per-sequence mean")
    if seq_id is not None and x.ndim == 1:
        total, count = _segments(x, mask, seq_id)
        return total / count.clamp(min=1)
    m = mask.bool()
    total = torch.where(m, x, torch.zeros_like(x)).sum(-1)
    return total / m.sum(-1).clamp(min=1)


def per_sequence_sum(x: torch.Tensor, mask: torch.Tensor,
                     seq_id: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over each sequence's masked tokens: [B, T] -> [B], or packed [N] -> [sequences]."""
    _require_sequences(x, seq_id, "a per-sequence sum")
    if seq_id is not None and x.ndim == 1:
        return _segments(x, mask, seq_id)[0]
    return torch.where(mask.bool(), x, torch.zeros_like(x)).sum(-1)


def broadcast_to_tokens(per_seq: torch.Tensor, like: torch.Tensor,
                        seq_id: torch.Tensor | None = None) -> torch.Tensor:
    """A per-sequence value on each of its tokens: [B] -> [B, T], or [S] -> [N] via seq_id."""
    if seq_id is not None and like.ndim == 1:
        return per_seq[seq_id]
    return per_seq.unsqueeze(-1).expand_as(like)


def _token_sum(loss_tok: torch.Tensor, mask: torch.Tensor,
               seq_id: torch.Tensor | None) -> torch.Tensor:
    return masked_sum(loss_tok, mask)


def _seq_mean_sum(loss_tok: torch.Tensor, mask: torch.Tensor,
                  seq_id: torch.Tensor | None) -> torch.Tensor:
    return per_sequence_mean(loss_tok, mask, seq_id).sum()


def sequence_count(mask: torch.Tensor, seq_id: torch.Tensor | None) -> torch.Tensor:
    _require_sequences(mask, seq_id, "a sequence-level normaliser")
    if seq_id is not None and mask.ndim == 1:
        return (_segments(mask.float(), mask, seq_id)[1] > 0).sum()
    return mask.bool().any(-1).sum()


Reduce = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]

# Numerator of each mode before division by the normaliser.
_NUMERATORS: dict[str, Reduce] = {
    "token_mean": _token_sum,
    "seq_mean_token_mean": _seq_mean_sum,
    "seq_mean_token_sum": _token_sum,
    "seq_mean_token_sum_norm": _token_sum,
}

def _check_agg(loss_agg: str) -> None:
    if loss_agg not in _NUMERATORS:
        raise ValueError(f"loss_agg={loss_agg!r} is not allowed; choose one of {list(_NUMERATORS)}")


def aggregate(
    loss_tok: torch.Tensor,
    loss_mask: torch.Tensor,
    normalizer: float | torch.Tensor,
    loss_agg: LossAgg = "token_mean",
    seq_id: torch.Tensor | None = None,
    horizon: float | None = None,
) -> torch.Tensor:
    """Per-token loss [B, T] (or packed [N], with seq_id for the sequence modes) -> scalar, see
    the module docstring (`horizon`: seq_mean_token_sum_norm's constant)."""
    _check_agg(loss_agg)
    out = _NUMERATORS[loss_agg](loss_tok, loss_mask, seq_id) / normalizer
    if loss_agg == "seq_mean_token_sum_norm":
        if horizon is None:
            raise ValueError("loss_agg='seq_mean_token_sum_norm' needs its horizon")
        out = out / horizon
    return out


def normalizer_unit(loss_agg: LossAgg) -> str:
    """What the step's normaliser counts for this mode: "tokens" or "sequences"."""
    _check_agg(loss_agg)
    return "tokens" if loss_agg == "token_mean" else "sequences"


def normalizer_count(loss_mask: torch.Tensor, unit: str,
                     seq_id: torch.Tensor | None = None) -> torch.Tensor:
    """What one micro-batch adds to its step's normaliser (`unit` from `normalizer_unit`): its
    trained tokens, or its sequences with a trained token (packed [N]: with seq_id). The step's
    normaliser is the sum over every micro-batch and rank, clamped to >= 1."""
    if unit == "tokens":
        return loss_mask.bool().sum()
    if unit != "sequences":
        raise ValueError(f"unit={unit!r} is not allowed; allowed: tokens, sequences")
    return sequence_count(loss_mask, seq_id)
