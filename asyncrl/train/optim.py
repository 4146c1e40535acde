"""Optimizer and learning-rate schedule owned by the train engine.

AdamW with linear warmup then constant / linear / cosine decay to `min_lr_ratio * lr`, built from
a typed config so runs are reproducible from their dumped YAML.
"""

from __future__ import annotations

import math

import torch

from asyncrl.train.config import OptimizerConfig


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
    # one fused kernel for every parameter on CUDA (torch's foreach loop elsewhere)
    fused = bool(params) and all(p.is_cuda and p.is_floating_point() for p in params)
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, fused=fused or None)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total_steps, cfg))
    return opt, sched
