"""Optimizer and learning-rate schedule owned by the train engine.

AdamW with linear warmup then constant / linear / cosine decay to `min_lr_ratio * lr`, built from
a typed config so runs are reproducible from their dumped YAML.
"""

from __future__ import annotations

import math
from typing import Literal

import pydantic
import torch

from asyncrl.config import Config


class OptimizerConfig(Config):
    lr: float = pydantic.Field(1e-3, gt=0.0, le=1.0)  # AdamW peak learning rate
    betas: tuple[float, float] = (0.9, 0.95)  # AdamW moment decay rates
    eps: float = pydantic.Field(1e-8, gt=0.0)  # AdamW denominator epsilon
    weight_decay: float = pydantic.Field(0.0, ge=0.0)  # AdamW decoupled weight decay
    warmup_steps: int = pydantic.Field(0, ge=0)  # linear warm-up steps from 0 to lr
    schedule: Literal["constant", "linear", "cosine"] = "constant"  # the learning rate after warm-up
    # linear/cosine decay ends at lr * this
    min_lr_ratio: float = pydantic.Field(0.0, ge=0.0, le=1.0)
    # max global gradient norm; None: no clipping
    grad_clip: float | None = pydantic.Field(1.0, gt=0.0)

    @pydantic.field_validator("betas")
    @classmethod
    def _betas_in_unit_interval(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas={list(v)} must each be in [0, 1)")
        return v


def lr_factor(step: int, total_steps: int, cfg: OptimizerConfig) -> float:
    """Multiplier of cfg.lr at `step` (0-based): warmup, then the chosen decay."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    decay = 1.0 - progress if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def build_optimizer(
    params, cfg: OptimizerConfig, total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(
        params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total_steps, cfg))
    return opt, sched
