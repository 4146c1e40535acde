"""Loss functions: pure, named tensors in, (loss, stats) out.

The token normaliser is passed in rather than computed from the micro-batch, so summing the losses
of micro-batches with the global token count as normaliser equals the loss of one big batch (see
`aggregation.py` for what the normaliser is in each aggregation mode). Per-token tensors are
[B, T] (row = sequence, right-padded) or packed [N] when only token-level operations are used.
Stats are python floats over this call's loss tokens, for logging.

The policy loss is AReaL's decoupled PPO objective, which covers the usual variants as settings:

    r_t   = exp(logprobs_t - proximal_t)                         (GSPO: per-sequence geometric mean)
    l_t   = max(-A_t * r_t, -A_t * clip(r_t, 1 - eps_clip, 1 + eps_clip_higher))
    l_t   = min(l_t, c_clip * |A_t|)   where A_t < 0              (dual clip)
    w_t   = exp(proximal_t - behaviour_t), capped or masked at behav_imp_weight_cap
    loss  = aggregate(w_t * l_t) / normalizer

With proximal == behaviour, w = 1 and this is standard PPO; GRPO is this loss on group-normalised
advantages without a critic (`advantages.grpo_advantages`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from asyncrl.api.loss import LossInputs
from asyncrl.api.validation import check_range
from asyncrl.train.aggregation import aggregate, masked_mean, normalizer_unit
from asyncrl.train.corrections import (bound_weights, cispo_token_loss, dppo_token_loss,
                                       log_weights)
from asyncrl.train.regularizers import kl_penalty

if TYPE_CHECKING:
    from asyncrl.train.config import LossAgg, PPOLossConfig


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


def _zeros_bool(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x, dtype=torch.bool)




def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, cfg: PPOLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token PPO loss (to minimise), clip mask, dual-clip mask."""
    clipped = ratio.clamp(1.0 - cfg.eps_clip, 1.0 + cfg.clip_high)
    pg1 = -adv * ratio
    pg2 = -adv * clipped
    # Strict '>' so a ratio exactly on the boundary still counts as inside the trust region and
    # keeps its gradient (ties in torch.maximum would halve it).
    clip_mask = pg2 > pg1
    pg = torch.where(clip_mask, pg2, pg1)
    if cfg.c_clip is None:
        return pg, clip_mask, _zeros_bool(pg)
    pg3 = -adv * cfg.c_clip  # = c_clip * |A| where A < 0; a constant, so no gradient
    dual_mask = (adv < 0) & (pg > pg3)
    return torch.where(dual_mask, pg3, pg), clip_mask, dual_mask


def behaviour_weight(
    proximal: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, cfg: PPOLossConfig,
    seq_id: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w = pi_prox / pi_behav per token (or per sequence), bounded per cfg (corrections.py);
    also the positions the bound truncated or dropped. With cfg.behav_imp_weight false: 1."""
    if not cfg.behav_imp_weight:
        return torch.ones_like(proximal), torch.zeros_like(mask)
    w = torch.exp(log_weights(proximal - behaviour, mask, cfg.weight_level, seq_id))
    return bound_weights(w, mask, cfg.behav_imp_weight_mode, cfg.behav_imp_weight_cap,
                         cfg.behav_imp_weight_floor)


def ppo_actor_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    normalizer: float | torch.Tensor,
    cfg: PPOLossConfig,
    entropy: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    seq_id: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO policy loss (formula in the module docstring) - entropy_coef * entropy
    + kl_coef * KL(pi || ref) (the last when kl_as="loss").

    All per-token tensors share one shape, [B, T] or packed [N] (then `seq_id` [N] says which
    sequence each token belongs to, for ratio_level="sequence" and the seq_mean_* modes):
    logprobs under the parameters being trained (with grad), proximal and behaviour logprobs,
    advantages (all three treated as constants), loss_mask (1 = train), the entropy of each
    token's distribution (with grad, `entropy_from_logits`) and the reference's logprobs. Every
    term is aggregated with the same normaliser; tokens dropped by a masking correction still
    count in it, so dropping a token shrinks the step instead of reweighting the others.
    """
    mask = loss_mask.bool()
    proximal = proximal_logprobs.detach()
    adv = advantages.detach().to(logprobs.dtype)
    ratio = torch.exp(log_weights(logprobs - proximal, mask, cfg.ratio_level, seq_id))
    if cfg.policy_objective == "cispo":
        pg, clip_mask = cispo_token_loss(logprobs, ratio, adv, cfg.eps_clip, cfg.clip_high)
        dual_mask = _zeros_bool(pg)
    elif cfg.policy_objective in ("dppo_tv", "dppo_kl"):
        pg, clip_mask = dppo_token_loss(logprobs, proximal, ratio, adv, cfg.eps_clip,
                                        cfg.clip_high, cfg.policy_objective[5:], cfg.c_clip)
        dual_mask = _zeros_bool(pg)
    else:
        pg, clip_mask, dual_mask = _clipped_surrogate(ratio, adv, cfg)
    weight, over_cap = behaviour_weight(proximal, behaviour_logprobs.detach(), mask, cfg, seq_id)
    pg = pg * weight
    loss = aggregate(pg, mask, normalizer, cfg.loss_agg, seq_id, cfg.loss_agg_horizon)
    dropped = cfg.behav_imp_weight_mode in ("mask", "icepop")
    with torch.no_grad():
        token_log_ratio = torch.where(mask, logprobs - proximal, torch.zeros_like(proximal))
        k3_prox_new = torch.expm1(token_log_ratio) - token_log_ratio
        w_on_tokens = torch.where(mask, weight, torch.zeros_like(weight))
        stats = {
            "ppo/pg_loss": float(loss),
            "ppo/clip_frac": float(masked_mean(clip_mask.float(), mask)),
            "ppo/dual_clip_frac": float(masked_mean(dual_mask.float(), mask)),
            # k3 estimate of KL(pi_prox || pi_theta): how far this update has moved the policy.
            "ppo/approx_kl": float(masked_mean(k3_prox_new, mask)),
            "ppo/ratio_mean": float(masked_mean(ratio, mask)),
            "ppo/behav_weight_mean": float(masked_mean(weight, mask)),
            "ppo/behav_weight_max": float(w_on_tokens.max()) if mask.any() else 0.0,
            "ppo/behav_over_cap_frac": float(masked_mean(over_cap.float(), mask)),
            "ppo/behav_masked_frac": float(masked_mean(over_cap.float(), mask)) if dropped else 0.0,
            "ppo/tokens": float(mask.sum()),
        }
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} > 0 needs the per-token `entropy`")
    if entropy is not None:
        stats["actor/entropy"] = float(masked_mean(entropy.detach(), loss_mask))
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate(entropy, loss_mask, normalizer,
                                                       cfg.loss_agg, seq_id,
                                                       cfg.loss_agg_horizon)
    if cfg.kl_coef > 0 and cfg.kl_as == "loss":
        if ref_logprobs is None:
            raise ValueError(f"kl_coef={cfg.kl_coef} with kl_as='loss' needs `ref_logprobs`")
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_kind)
        stats["actor/kl_ref"] = float(masked_mean(kl.detach(), loss_mask))
        loss = loss + cfg.kl_coef * aggregate(kl, loss_mask, normalizer, cfg.loss_agg, seq_id,
                                              cfg.loss_agg_horizon)
    stats["actor/loss"] = float(loss.detach())
    return loss, stats


class PPOLoss:
    """The built-in `PolicyLoss`: `ppo_actor_loss` on a micro-batch's `LossInputs`
    (`actor.loss: ppo`, the default)."""

    def __init__(self, cfg: PPOLossConfig) -> None:
        self.cfg = cfg
        # what the trainer's step normaliser counts (aggregation.py): tokens or sequences
        self.normalize_by = normalizer_unit(self.cfg.loss_agg)
        self.needs_entropy = self.cfg.entropy_coef > 0

    def __call__(self, logprobs: torch.Tensor, inputs: LossInputs, normalizer: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        return ppo_actor_loss(logprobs, inputs.proximal_logprobs, inputs.behaviour_logprobs,
                              inputs.advantages, inputs.loss_mask, normalizer, self.cfg,
                              entropy=inputs.entropy, ref_logprobs=inputs.ref_logprobs,
                              seq_id=inputs.seq_id)


def critic_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    normalizer: float | torch.Tensor,
    value_eps_clip: float | None = 0.2,
    loss_agg: LossAgg = "token_mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO value loss: 0.5 * max((V - R)^2, (V_clip - R)^2), V_clip = V_old + clip(V - V_old, eps).

    values [B, T] (with grad), old_values [B, T] (critic at rollout time), returns [B, T] (GAE
    targets); value_eps_clip None disables clipping. The max makes the clip pessimistic: it only
    removes gradient that would move V further than eps from V_old in the direction of the error.
    """
    if value_eps_clip is not None:
        check_range("value_eps_clip", value_eps_clip, lo=0.0, lo_open=True)
    mask = loss_mask.bool()
    returns = returns.detach()
    err = (values - returns).square()
    if value_eps_clip is None:
        clip_mask = _zeros_bool(err)
        sq = err
    else:
        old = old_values.detach()
        v_clip = old + (values - old).clamp(-value_eps_clip, value_eps_clip)
        err_clip = (v_clip - returns).square()
        clip_mask = err_clip > err
        sq = torch.where(clip_mask, err_clip, err)
    loss = aggregate(0.5 * sq, mask, normalizer, loss_agg)
    with torch.no_grad():
        stats = {
            "critic/loss": float(loss),
            "critic/clip_frac": float(masked_mean(clip_mask.float(), mask)),
            "critic/value_mean": float(masked_mean(values, mask)),
            "critic/return_mean": float(masked_mean(returns, mask)),
        }
    return loss, stats
