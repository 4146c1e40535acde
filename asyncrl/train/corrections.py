"""Off-policy / sampler-mismatch corrections: pure functions on the behaviour importance weight.

The decoupled objective multiplies each token's PPO term by w = pi_prox / pi_behav, where
pi_behav is what the sampler reported (its version, its kernels, its precision) and pi_prox the
trainer's proximal policy (`proximal_logprobs: recompute` makes it the trainer's own forward, so
w measures the sampler-vs-trainer mismatch plus staleness). A raw w can be huge on a few tokens;
the corrections bound it (all settings of `PPOLossConfig`, tested against hand-computed values):

| `behav_imp_weight_mode` | what happens to w above `cap` (and below `floor`)     | known as            |
|---|---|---|
| cap     | w -> min(w, cap): the token is kept with a bounded weight        | truncated IS (TIS)  |
| mask    | w > cap -> 0: the token drops out of the gradient                 | masked IS (MIS)     |
| icepop  | w > cap or w < floor -> 0: two-sided masking of mismatched tokens | IcePop              |

`behav_imp_weight_level: sequence` computes one weight per sequence, the geometric mean of its
token weights (the length-normalised sequence likelihood ratio, as GSPO's ratio), and bounds
that: a sequence is kept, truncated or dropped whole (sequence-level TIS / MIS).

CISPO (`policy_objective: cispo`) is a different objective rather than a bound on w: it clips the
importance ratio r = pi_theta / pi_prox as a stop-gradient weight on the REINFORCE term,
-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_theta, so no token loses its gradient.
"""

from __future__ import annotations

import torch

from asyncrl.train.aggregation import broadcast_to_tokens, per_sequence_mean


def log_weights(log_w: torch.Tensor, mask: torch.Tensor, level: str,
                seq_id: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token log weights, or each sequence's mean log weight on all its tokens ("sequence");
    0 off the mask, so exp() of padding can never overflow."""
    log_w = torch.where(mask, log_w, torch.zeros_like(log_w))
    if level == "sequence":
        return broadcast_to_tokens(per_sequence_mean(log_w, mask, seq_id), log_w, seq_id)
    if level != "token":
        raise ValueError(f"level={level!r} is not allowed; choose token or sequence")
    return log_w


def truncate(w: torch.Tensor, mask: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """TIS: (min(w, cap), where it was above cap)."""
    return w.clamp(max=cap), (w > cap) & mask


def mask_above(w: torch.Tensor, mask: torch.Tensor, cap: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """MIS: (w with 0 where w > cap, those positions)."""
    out = (w > cap) & mask
    return torch.where(out, torch.zeros_like(w), w), out


def icepop(w: torch.Tensor, mask: torch.Tensor, cap: float, floor: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """IcePop: (w with 0 where w > cap or w < floor, those positions)."""
    out = ((w > cap) | (w < floor)) & mask
    return torch.where(out, torch.zeros_like(w), w), out


def bound_weights(w: torch.Tensor, mask: torch.Tensor, mode: str, cap: float | None,
                  floor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The configured correction: (bounded w, positions it truncated or dropped)."""
    if cap is None:
        return w, torch.zeros_like(mask)
    if mode == "cap":
        return truncate(w, mask, cap)
    if mode == "mask":
        return mask_above(w, mask, cap)
    if mode == "icepop":
        return icepop(w, mask, cap, floor if floor is not None else 1.0 / cap)
    raise ValueError(f"behav_imp_weight_mode={mode!r} is not allowed; choose cap, mask, icepop")


def cispo_token_loss(logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor,
                     eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO per-token loss -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logprobs, and where
    the weight was clipped. Every token keeps its gradient; only its weight is bounded."""
    weight = ratio.detach().clamp(1.0 - eps_low, 1.0 + eps_high)
    clipped = (ratio.detach() < 1.0 - eps_low) | (ratio.detach() > 1.0 + eps_high)
    return -weight * advantages * logprobs, clipped
