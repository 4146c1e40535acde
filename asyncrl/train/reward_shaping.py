"""Reward shaping before advantage estimation: scale/bias/clip, DAPO's overlong penalty, what to do
with sequences cut off at the length limit, and placing an outcome reward on the last token.

Pure tensor functions over a batch of N sequences; `advantages.compute_advantages` applies them in
the order documented there.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncrl.api.validation import check_range

from asyncrl.train.config import TruncationMode


def shape_rewards(
    rewards: torch.Tensor, scale: float = 1.0, bias: float = 0.0, clip: float | None = None
) -> torch.Tensor:
    """rewards [N] -> clip((r - bias) * scale, -clip, clip); clip None leaves it unbounded."""
    shaped = (rewards.float() - bias) * scale
    if clip is None:
        return shaped
    check_range("reward_clip", clip, lo=0.0, lo_open=True)
    return shaped.clamp(-clip, clip)


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int) -> torch.Tensor:
    """DAPO soft overlong punishment per sequence, lengths [N] (generated tokens) -> [N] in [-1, 0].

        penalty(L) = 0                        if L <= max_len - buffer_len
                   = (max_len - buffer_len - L) / buffer_len
                                              if max_len - buffer_len < L <= max_len
                   = -1                       if L > max_len

    A linear ramp over the last `buffer_len` tokens, so the policy learns to finish before the hard
    cut instead of getting a cliff it cannot see coming.
    """
    check_range("overlong_buffer_len", buffer_len, lo=1, hi=max_len)
    ramp = (max_len - buffer_len - lengths.float()) / buffer_len
    return ramp.clamp(-1.0, 0.0)


def _keep(
    rewards: torch.Tensor, loss_mask: torch.Tensor, truncated: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return rewards, loss_mask


def _mask_loss(
    rewards: torch.Tensor, loss_mask: torch.Tensor, truncated: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    # The sequence still counts in its group's baseline (it is a real sample of the policy); it is
    # only not trained on, because its reward says nothing about the unfinished answer.
    keep = (~truncated.bool()).unsqueeze(-1)
    return rewards, torch.where(keep, loss_mask, torch.zeros_like(loss_mask))


def _zero_reward(
    rewards: torch.Tensor, loss_mask: torch.Tensor, truncated: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.where(truncated.bool(), torch.zeros_like(rewards), rewards), loss_mask


TRUNCATION_MODES: dict[
    str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
] = {"keep": _keep, "mask_loss": _mask_loss, "zero_reward": _zero_reward}


def handle_truncated(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    truncated: torch.Tensor,
    mode: TruncationMode,
) -> tuple[torch.Tensor, torch.Tensor]:
    """rewards [N], loss_mask [N, T], truncated [N] bool (stop_reason == LENGTH) ->
    (rewards, loss_mask): "keep" as is, "mask_loss" zeroes the rows' loss mask (DAPO's overlong
    filtering), "zero_reward" sets their reward to 0."""
    if mode not in TRUNCATION_MODES:
        allowed = list(TRUNCATION_MODES)
        raise ValueError(f"truncated={mode!r} is not allowed; choose one of {allowed}")
    return TRUNCATION_MODES[mode](rewards, loss_mask, truncated)


def last_token_index(loss_mask: torch.Tensor) -> torch.Tensor:
    """loss_mask [N, T] -> [N] index of each row's last loss token (-1 for an empty row)."""
    positions = torch.arange(loss_mask.shape[-1], device=loss_mask.device)
    return torch.where(loss_mask.bool(), positions, torch.full_like(positions, -1)).amax(-1)


def outcome_token_rewards(rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """rewards [N], loss_mask [N, T] -> [N, T] with each reward on its row's last generated token.

    That token's action is the one that ended the episode, so a discounted return credits every
    earlier token with it; rows with no loss token get no reward.
    """
    out = torch.zeros(loss_mask.shape, dtype=torch.float32, device=loss_mask.device)
    last = last_token_index(loss_mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    out[rows, last[rows]] = rewards[rows].float()
    return out
