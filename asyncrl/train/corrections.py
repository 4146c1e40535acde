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
`sequence_product` uses the product of the token weights instead (the sequence likelihood ratio,
as verl's and TRL's sequence-level IS), its log clamped to +-LOG_PRODUCT_BOUND so it stays finite.
`behav_imp_weight_floor` bounds w from below too: cap raises it to the floor (two-sided
truncation), mask and icepop drop the token.

`ratio_level: sequence_token` is GSPO-token: each token's ratio has the value of its sequence's
(geometric-mean) ratio and the gradient of its own logprob, so per-token advantages apply.

DPPO (`policy_objective: dppo_tv | dppo_kl`, Stable-RL's Divergence PPO, prime-rl's default) replaces
the ratio clip by a trust region on the token's probability itself: a token whose update would
move pi_theta(y) away from pi_prox(y) by more than a threshold in the direction its advantage
pushes (total variation |p - p_prox|, or the binary KL between Bernoulli(p_prox) and
Bernoulli(p)) drops out; the others get -sg(min(r, c_clip)) * A * log pi_theta.

CISPO (`policy_objective: cispo`) is a different objective rather than a bound on w: it clips the
importance ratio r = pi_theta / pi_prox as a stop-gradient weight on the REINFORCE term,
-sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * log pi_theta, so no token loses its gradient.
"""

from __future__ import annotations

import torch

from asyncrl.train.aggregation import broadcast_to_tokens, per_sequence_mean, per_sequence_sum


LOG_PRODUCT_BOUND = 20.0  # |log| of a sequence_product weight: exp(20) ~ 4.9e8


def log_weights(log_w: torch.Tensor, mask: torch.Tensor, level: str,
                seq_id: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token log weights ("token"); each sequence's mean ("sequence") or clamped sum
    ("sequence_product") on all its tokens; "sequence_token": the sequence mean's value with
    each token's own gradient (GSPO-token). 0 off the mask, so exp() of padding cannot overflow."""
    log_w = torch.where(mask, log_w, torch.zeros_like(log_w))
    if level == "token":
        return log_w
    if level == "sequence":
        return broadcast_to_tokens(per_sequence_mean(log_w, mask, seq_id), log_w, seq_id)
    if level == "sequence_product":
        total = per_sequence_sum(log_w, mask, seq_id).clamp(-LOG_PRODUCT_BOUND, LOG_PRODUCT_BOUND)
        return torch.where(mask, broadcast_to_tokens(total, log_w, seq_id),
                           torch.zeros_like(log_w))
    if level == "sequence_token":
        seq = broadcast_to_tokens(per_sequence_mean(log_w.detach(), mask, seq_id), log_w, seq_id)
        return torch.where(mask, seq + log_w - log_w.detach(), torch.zeros_like(log_w))
    raise ValueError(f"level={level!r} is not allowed; choose token, sequence, "
                     "sequence_product or sequence_token")


def truncate(w: torch.Tensor, mask: torch.Tensor, cap: float, floor: float | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """TIS: (w clamped to [floor, cap], where it was outside)."""
    low = floor if floor is not None else float("-inf")
    return w.clamp(min=low, max=cap), ((w > cap) | (w < low)) & mask


def mask_above(w: torch.Tensor, mask: torch.Tensor, cap: float, floor: float | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """MIS: (w with 0 where w > cap or w < floor, those positions)."""
    out = ((w > cap) | (w < (floor if floor is not None else float("-inf")))) & mask
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
        return truncate(w, mask, cap, floor)
    if mode == "mask":
        return mask_above(w, mask, cap, floor)
    if mode == "icepop":
        return icepop(w, mask, cap, floor if floor is not None else 1.0 / cap)
    raise ValueError(f"behav_imp_weight_mode={mode!r} is not allowed; choose cap, mask, icepop")


def dppo_token_loss(logprobs: torch.Tensor, proximal: torch.Tensor, ratio: torch.Tensor,
                    advantages: torch.Tensor, low: float, high: float, divergence: str,
                    ratio_cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """DPPO per-token loss -sg(min(r, ratio_cap)) * A * logprobs on the tokens inside the trust
    region, 0 elsewhere, and the positions outside it. `divergence`: "tv" measures p - p_prox,
    "kl" the binary KL(Bernoulli(p_prox) || Bernoulli(p)); a positive-advantage token is out when
    it grew by more than `high`, a negative one when it shrank by more than `low`."""
    p, p_prox = logprobs.detach().exp(), proximal.detach().exp()
    if divergence == "tv":
        grew, shrank = p - p_prox > high, p_prox - p > low
    elif divergence == "kl":
        tiny = 1e-8
        kl = p_prox * (proximal - logprobs.detach()) + (1 - p_prox) * torch.log(
            (1 - p_prox + tiny) / (1 - p + tiny))
        grew, shrank = (kl > high) & (p > p_prox), (kl > low) & (p < p_prox)
    else:
        raise ValueError(f"divergence={divergence!r} is not allowed; choose tv or kl")
    outside = torch.where(advantages > 0, grew, shrank)
    weight = ratio.detach()
    if ratio_cap is not None:
        weight = weight.clamp(max=ratio_cap)
    loss = -weight * advantages * logprobs
    return torch.where(outside, torch.zeros_like(loss), loss), outside


def cispo_token_loss(logprobs: torch.Tensor, ratio: torch.Tensor, advantages: torch.Tensor,
                     eps_low: float, eps_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO per-token loss -sg(clip(r, 1 - eps_low, 1 + eps_high)) * A * logprobs, and where
    the weight was clipped. Every token keeps its gradient; only its weight is bounded."""
    weight = ratio.detach().clamp(1.0 - eps_low, 1.0 + eps_high)
    clipped = (ratio.detach() < 1.0 - eps_low) | (ratio.detach() > 1.0 + eps_high)
    return -weight * advantages * logprobs, clipped
