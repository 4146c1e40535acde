"""Per-token regularisers of the policy: entropy and KL to a reference policy.

Both return per-token tensors; the actor loss aggregates them with the same mode and normaliser as
the policy-gradient term so micro-batching stays exact. The KL can enter training two ways:
as a reward term (detached, subtracted from the token rewards before advantages, PPO-RLHF /
REINFORCE++ style) or as a loss term (with gradient, GRPO style); `kl_reward` is the former.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from asyncrl.train.config import KLKind



def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits [..., V] -> entropy [...] in float32 of softmax(logits / temperature).

    H = logsumexp(z) - sum_v softmax(z)_v * z_v, which never takes log of a zero probability.
    The temperature matches `gather_logprobs`, so the entropy is that of the policy being trained.
    """
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logz = torch.logsumexp(z, dim=-1)
    probs = torch.softmax(z, dim=-1)
    return logz - (probs * z).sum(-1)


# Schulman's estimators of KL(pi || ref) from samples of pi, with log r = logprobs - ref_logprobs:
# k1 is unbiased but can be negative per token; k2 and k3 are >= 0; k3 is unbiased and low-variance.
def _k1(log_r: torch.Tensor) -> torch.Tensor:
    return log_r


def _k2(log_r: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_r.square()


def _k3(log_r: torch.Tensor) -> torch.Tensor:
    return torch.exp(-log_r) - 1.0 + log_r


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k3"
) -> torch.Tensor:
    """Per-token KL estimate [...] of the policy from the reference, same shape as the inputs.

    Keeps the gradient w.r.t. `logprobs` (for use as a loss term); the reference is detached.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"kl_kind={kind!r} is not allowed; choose one of {list(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logprobs - ref_logprobs.detach())


def kl_reward(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    kl_coef: float,
    kind: KLKind = "k1",
) -> torch.Tensor:
    """token_rewards [B, T] - kl_coef * KL [B, T] on loss tokens; detached (a reward has no grad).

    `logprobs` here are the behaviour (or proximal) policy's: the penalty is part of the data the
    advantage estimator sees, computed once per step before any update.
    """
    kl = kl_penalty(logprobs.detach(), ref_logprobs, kind)
    penalty = torch.where(loss_mask.bool(), kl_coef * kl, torch.zeros_like(kl))
    return token_rewards - penalty
