"""Where the decoupled PPO loss gets the proximal policy's logprobs.

The proximal policy is the centre of PPO's trust region; the behaviour policy is whatever
(possibly stale) version generated each token. Three sources:

- "recompute": an extra forward pass of the trainer's parameters before the update (exact; the
  train engine runs it and passes the result in).
- "loglinear": no extra forward pass; interpolate per token between the behaviour logprob and the
  logprob under the parameters being trained, using the token's version
  (`approx_proximal_logprobs`).
- "behaviour": use the behaviour logprobs, i.e. standard PPO with the sampler as the old policy.
"""

from __future__ import annotations

import torch

from asyncrl.train.config import ProximalConfig


def approx_proximal_logprobs(
    behaviour_logprobs: torch.Tensor,
    current_logprobs: torch.Tensor,
    versions: torch.Tensor,
    current_version: int,
) -> torch.Tensor:
    """Log-linear approximation of the proximal policy's logprobs, per token, same shape ([B, T]).

    Versions: `current_version` V is the version of the parameters that produced
    `current_logprobs` (the trainer's weights in this step's training forward; detached here),
    `versions` [B, T] the version v_b that sampled each token (< 0 = prompt), and the proximal
    policy is taken to be version V - 1, one update behind (AReaL's convention). Assuming a token's
    logprob moves linearly in log space with the version number between the two known points
    (v_b, behaviour) and (V, current), the value at V - 1 is

        alpha   = ((V - 1) - v_b) / (V - v_b)            for 0 <= v_b < V - 1
        lp_prox = lp_behav + alpha * (lp_current - lp_behav)

    so v_b = V - 2 gives the midpoint, v_b = V - 3 two thirds of the way, and alpha -> 1 as the
    token gets staler. Where the formula has no interpolation to do, alpha = 0 and lp_prox =
    lp_behav: at v_b = V - 1 the behaviour policy *is* the proximal version (exact, not an
    approximation); at v_b >= V (a fresh token) V - 1 lies outside [v_b, V], and the behaviour
    logprob keeps the clip centred on the sampler, which makes the synchronous case (every token
    fresh) exactly standard PPO; prompt tokens (v_b < 0) have no generation version.
    """
    if current_version < 0:
        raise ValueError(f"current_version={current_version} is out of range; allowed [0, inf)")
    behaviour = behaviour_logprobs.detach()
    current = current_logprobs.detach()
    v_b = versions.to(torch.float64)
    gap = float(current_version) - v_b
    interpolate = (versions >= 0) & (gap > 1)
    alpha = torch.where(interpolate, (gap - 1) / gap.clamp(min=1), torch.zeros_like(gap))
    return behaviour + alpha.to(behaviour.dtype) * (current - behaviour)


def proximal_logprobs(
    cfg: ProximalConfig,
    behaviour_logprobs: torch.Tensor,
    current_logprobs: torch.Tensor | None = None,
    versions: torch.Tensor | None = None,
    current_version: int | None = None,
    recomputed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The proximal logprobs [B, T] for the configured source (always detached)."""
    if cfg.proximal_logprobs == "behaviour":
        return behaviour_logprobs.detach()
    if cfg.proximal_logprobs == "recompute":
        if recomputed is None:
            raise ValueError(
                "proximal_logprobs='recompute' needs the recomputed logprobs from a forward pass "
                "of the pre-update weights; pass them, or choose 'loglinear' / 'behaviour'")
        return recomputed.detach()
    if current_logprobs is None or versions is None or current_version is None:
        raise ValueError(
            "proximal_logprobs='loglinear' needs current_logprobs, versions and current_version")
    return approx_proximal_logprobs(behaviour_logprobs, current_logprobs, versions,
                                    current_version)
