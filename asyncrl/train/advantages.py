"""Advantage estimators: pure tensor functions from rewards (and a critic's values) to per-token
advantages, plus `compute_advantages`, which applies reward shaping and the configured estimator.

Critic-free estimators work on one outcome reward per sequence, rewards [N], where sequences that
answer the same prompt share a group id, group_ids [N] (any integers); the group functions also
take a [G, n] layout (row = group) without ids. Their sequence advantages are spread over the
sequence's loss tokens by `expand_to_tokens`. GAE works per token on [B, T].

Standard deviations are unbiased (Bessel, n - 1), as in TRL and verl; a group of one sample has
advantage 0 under every group estimator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from asyncrl.train.config import AdvantageConfig
from asyncrl.train.aggregation import masked_mean
from asyncrl.train.reward_shaping import (
    handle_truncated,
    outcome_token_rewards,
    overlong_penalty,
    shape_rewards,
)

def _flatten_groups(
    rewards: torch.Tensor, group_ids: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """-> (rewards [N] float, dense group index [N] in 0..G-1, G)."""
    if group_ids is None:
        if rewards.ndim != 2:
            raise ValueError(
                f"rewards of shape {tuple(rewards.shape)} need group_ids [N]; "
                "or pass rewards as [G, n] with one group per row"
            )
        g, n = rewards.shape
        index = torch.arange(g, device=rewards.device).repeat_interleave(n)
        return rewards.reshape(-1).float(), index, g
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"group_ids shape {tuple(group_ids.shape)} must equal rewards shape "
            f"{tuple(rewards.shape)}, both [N]"
        )
    _, index = torch.unique(group_ids, return_inverse=True)
    return rewards.float(), index, int(index.max()) + 1 if index.numel() else 0


def _group_sum(x: torch.Tensor, index: torch.Tensor, g: int) -> torch.Tensor:
    """Sum of x over each element's group, gathered back to [N]."""
    sums = torch.zeros(g, dtype=x.dtype, device=x.device).index_add_(0, index, x)
    return sums[index]


def _group_count_mean(
    r: torch.Tensor, index: torch.Tensor, g: int
) -> tuple[torch.Tensor, torch.Tensor]:
    count = _group_sum(torch.ones_like(r), index, g)
    return count, _group_sum(r, index, g) / count


def _standardise(centred: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # A group whose rewards are all equal has nothing to compare: advantage 0, even with eps=0.
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.where(scale > 0, centred / safe, torch.zeros_like(centred))


def grpo_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor | None = None, eps: float = 1e-6,
    singleton: str = "zero",
) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps); same shape as rewards. A group of one
    sample: 0 (`singleton="zero"`), or r / (1 + eps) (`"raw"`, verl's: mean 0 and std 1)."""
    r, index, g = _flatten_groups(rewards, group_ids)
    count, mean = _group_count_mean(r, index, g)
    var = _group_sum((r - mean).square(), index, g) / (count - 1).clamp(min=1)
    adv = _standardise(r - mean, var.sqrt() + eps)
    if singleton == "raw":
        adv = torch.where(count == 1, r / (1.0 + eps), adv)
    return adv.reshape(rewards.shape)


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO: r_i - mean of the other members of i's group (0 for a group of one)."""
    r, index, g = _flatten_groups(rewards, group_ids)
    count = _group_sum(torch.ones_like(r), index, g)
    others = (_group_sum(r, index, g) - r) / (count - 1).clamp(min=1)
    return torch.where(count > 1, r - others, torch.zeros_like(r)).reshape(rewards.shape)


def drgrpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Dr.GRPO: r - group mean (no std division, which over-weights near-uniform groups)."""
    r, index, g = _flatten_groups(rewards, group_ids)
    _, mean = _group_count_mean(r, index, g)
    return (r - mean).reshape(rewards.shape)


def batch_normalized_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """REINFORCE++: (r - batch mean) / (batch std + eps) over all N sequences, ignoring groups."""
    r = rewards.float()
    centred = r - r.mean()
    var = centred.square().sum() / max(r.numel() - 1, 1)
    return _standardise(centred, var.sqrt() + eps)


def whiten_tokens(advantages: torch.Tensor, loss_mask: torch.Tensor,
                  eps: float = 1e-8) -> torch.Tensor:
    """(A - mean) / sqrt(var + eps) over the loss tokens (unbiased variance), 0 elsewhere:
    token-level whitening, where a long sequence weighs in by its length."""
    mask = loss_mask.bool()
    n = mask.sum()
    mean = masked_mean(advantages, mask)
    var = torch.where(mask, advantages - mean, torch.zeros_like(advantages)).square().sum() \
        / (n - 1).clamp(min=1)
    out = (advantages - mean) * torch.rsqrt(var + eps)
    return torch.where(mask, out, torch.zeros_like(out))


def expand_to_tokens(seq_values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """seq_values [B], loss_mask [B, T] -> [B, T]: the value on every loss token, 0 elsewhere."""
    spread = seq_values.float().unsqueeze(-1).expand(loss_mask.shape)
    return torch.where(loss_mask.bool(), spread, torch.zeros_like(spread))


def gae_advantages(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    gamma: float,
    lam: float,
    end_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the loss tokens of each row -> (advantages, returns).

    token_rewards [B, T] (reward for the action at t; an outcome reward sits on the last generated
    token, see `outcome_token_rewards`), values [B, T] = V(state before token t), loss_mask [B, T].
    Only loss tokens are actions: positions with mask 0 (prompt, right padding, tool output between
    turns) are skipped, so the "next" step of an action is the next loss token of the same row,
    and discounting counts actions, not positions. After a row's last action the episode ends
    (next value 0), unless `end_values` [B] gives the value of the state after it: a row cut at
    the length limit did not end, so AReaL bootstraps from the critic's value there (0 in the
    other rows keeps their end).

        delta_t = r_t + gamma * V_next - V_t
        A_t     = delta_t + gamma * lam * A_next
        R_t     = A_t + V_t

    Advantages and returns are 0 on masked positions.
    """
    mask = loss_mask.bool()
    rewards = token_rewards.float()
    vals = values.detach().float()
    adv = torch.zeros_like(vals)
    next_value = (torch.zeros_like(vals[..., 0]) if end_values is None
                  else end_values.detach().float())
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(vals.shape[-1])):
        m = mask[..., t]
        delta = rewards[..., t] + gamma * next_value - vals[..., t]
        a = delta + gamma * lam * next_adv
        adv[..., t] = torch.where(m, a, torch.zeros_like(a))
        next_value = torch.where(m, vals[..., t], next_value)
        next_adv = torch.where(m, a, next_adv)
    returns = torch.where(mask, adv + vals, torch.zeros_like(vals))
    return adv, returns


@dataclass(frozen=True)
class AdvantageInputs:
    """One step's batch of N sequences. Tensors named with their shapes."""

    rewards: torch.Tensor  # [N] outcome reward per sequence
    loss_mask: torch.Tensor  # [N, T] 1 on generated tokens that are trained on
    group_ids: torch.Tensor | None = None  # [N] group estimators only
    values: torch.Tensor | None = None  # [N, T] critic values at rollout time, gae only
    token_rewards: torch.Tensor | None = None  # [N, T] dense rewards (e.g. kl_reward), gae only
    truncated: torch.Tensor | None = None  # [N] bool, the sequence hit the length limit
    # [N] the critic's V(state after the last token), gae with truncated_bootstrap only
    end_values: torch.Tensor | None = None
    response_lengths: torch.Tensor | None = None  # [N] for the overlong penalty; default mask sum


@dataclass
class AdvantageResult:
    advantages: torch.Tensor  # [N, T], 0 off the loss mask
    returns: torch.Tensor | None  # [N, T] critic targets (gae only)
    loss_mask: torch.Tensor  # [N, T] after truncation masking
    rewards: torch.Tensor  # [N] final shaped rewards the estimator saw
    stats: dict[str, float] = field(default_factory=dict)


EstimatorFn = Callable[
    [torch.Tensor, torch.Tensor, AdvantageInputs, AdvantageConfig],
    tuple[torch.Tensor, torch.Tensor | None],
]


def _group_ids(inputs: AdvantageInputs, cfg: AdvantageConfig) -> torch.Tensor:
    if inputs.group_ids is None:
        raise ValueError(
            f"estimator={cfg.estimator!r} needs group_ids [N]: the sequences that share a prompt"
        )
    return inputs.group_ids


def _grpo(rewards, mask, inputs, cfg):
    adv = grpo_advantages(rewards, _group_ids(inputs, cfg), cfg.std_eps, cfg.singleton_group)
    return expand_to_tokens(adv, mask), None


def _rloo(rewards, mask, inputs, cfg):
    return expand_to_tokens(rloo_advantages(rewards, _group_ids(inputs, cfg)), mask), None


def _drgrpo(rewards, mask, inputs, cfg):
    return expand_to_tokens(drgrpo_advantages(rewards, _group_ids(inputs, cfg)), mask), None


def _reinforce_pp(rewards, mask, inputs, cfg):
    return expand_to_tokens(batch_normalized_advantages(rewards, cfg.std_eps), mask), None


def _reinforce_pp_baseline(rewards, mask, inputs, cfg):
    """verl's REINFORCE++-baseline: r - group mean on every token, whitened over the step's
    loss tokens."""
    centred = drgrpo_advantages(rewards, _group_ids(inputs, cfg))
    return whiten_tokens(expand_to_tokens(centred, mask), mask, cfg.whiten_eps), None


def _gae(rewards, mask, inputs, cfg):
    if inputs.values is None:
        raise ValueError("estimator='gae' needs values [N, T] from the critic")
    token_rewards = outcome_token_rewards(rewards, mask)
    if inputs.token_rewards is not None:
        token_rewards = token_rewards + inputs.token_rewards.float()
    end_values = None
    if cfg.truncated_bootstrap:
        if inputs.end_values is None or inputs.truncated is None:
            raise ValueError("truncated_bootstrap needs end_values [N] (the critic's value after "
                             "each row's last token) and truncated [N]")
        end_values = torch.where(inputs.truncated, inputs.end_values.float(),
                                 torch.zeros_like(inputs.end_values, dtype=torch.float32))
    return gae_advantages(token_rewards, inputs.values, mask, cfg.gamma, cfg.lam, end_values)


ESTIMATORS: dict[str, EstimatorFn] = {
    "grpo": _grpo,
    "rloo": _rloo,
    "drgrpo": _drgrpo,
    "reinforce_pp": _reinforce_pp,
    "reinforce_pp_baseline": _reinforce_pp_baseline,
    "gae": _gae,
}
# Estimators that read per-token rewards; the others see one number per sequence, so dense
# rewards (KL-as-reward) would be silently dropped there.
TOKEN_LEVEL_ESTIMATORS = frozenset({"gae"})


def _final_rewards(
    inputs: AdvantageInputs, cfg: AdvantageConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (rewards [N], loss_mask [N, T], overlong penalty [N]) after shaping and truncation."""
    lengths = inputs.response_lengths
    if lengths is None:
        lengths = inputs.loss_mask.bool().sum(-1)
    rewards = shape_rewards(inputs.rewards, cfg.reward_scale, cfg.reward_bias, cfg.reward_clip)
    mask = inputs.loss_mask
    if inputs.truncated is not None:
        rewards, mask = handle_truncated(rewards, mask, inputs.truncated, cfg.truncated)
    penalty = torch.zeros_like(rewards)
    if cfg.overlong_buffer_len is not None:
        penalty = cfg.overlong_penalty_factor * overlong_penalty(
            lengths, cfg.overlong_max_len, cfg.overlong_buffer_len
        )
    return rewards + penalty, mask, penalty


def compute_advantages(inputs: AdvantageInputs, cfg: AdvantageConfig) -> AdvantageResult:
    """Shape rewards, then run the configured estimator over one step's batch.

    Order, for each sequence with task reward r and generated length L:
      1. r' = clip((r - reward_bias) * reward_scale, -reward_clip, reward_clip)
      2. truncated rows: "zero_reward" sets r' = 0, "mask_loss" zeroes their loss mask
      3. r'' = r' + overlong_penalty_factor * overlong_penalty(L)  (added after the clip, so the
         penalty keeps its configured size; a truncated row still pays it under "zero_reward")
      4. estimator(r'') -> per-token advantages (and returns for gae)
      5. whiten: token-level whitening of the advantages over the step's loss tokens
    """
    if inputs.token_rewards is not None and cfg.estimator not in TOKEN_LEVEL_ESTIMATORS:
        raise ValueError(
            f"token_rewards are only used by estimator in {sorted(TOKEN_LEVEL_ESTIMATORS)}; "
            f"estimator={cfg.estimator!r} sees one reward per sequence (use kl_as='loss')"
        )
    rewards, mask, penalty = _final_rewards(inputs, cfg)
    advantages, returns = ESTIMATORS[cfg.estimator](rewards, mask, inputs, cfg)
    if cfg.whiten:  # after GAE the returns keep the unwhitened advantages (the critic's target)
        advantages = whiten_tokens(advantages, mask, cfg.whiten_eps)
    truncated = inputs.truncated
    stats = {
        "adv/reward_mean": float(rewards.mean()) if rewards.numel() else 0.0,
        "adv/advantage_mean": float(masked_mean(advantages, mask)),
        "adv/overlong_penalty_mean": float(penalty.mean()) if penalty.numel() else 0.0,
        "adv/truncated_frac": float(truncated.float().mean()) if truncated is not None else 0.0,
    }
    return AdvantageResult(advantages, returns, mask, rewards, stats)
