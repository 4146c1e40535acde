"""Where a training job's trainer and in-process engine run, decided once, before anything loads.

"auto" means the current CUDA device when torch sees one, else the CPU, for the trainer and the
built-in engine alike (`asyncrl.inference.engine.resolve_device` is the one rule). The job refuses a
silent split: a trainer on the GPU with an in-process engine on the CPU would generate every
rollout orders of magnitude slower than it trains, which looks like a hang, not like a setting.
"""

from __future__ import annotations

import torch

from asyncrl.inference.engine import resolve_device
from asyncrl.inference.config import EngineSettings

__all__ = ["check_engine_placement", "resolve"]


def resolve(spec: str | None) -> torch.device:
    """None or "auto" -> cuda (with its index) when available, else cpu; "cpu", "cuda", "cuda:N"
    as given, checked to exist here. ValueError naming the value and the allowed ones."""
    return resolve_device("auto" if spec is None else spec)


def check_engine_placement(
    trainer_device: torch.device | str | None, mode: str, engine: EngineSettings
) -> torch.device | None:
    """The in-process engine's device (None for mode "local" / "remote": servers choose their
    own), or ValueError when the trainer is on CUDA and the in-process engine would run on the
    CPU. `trainer_device`: resolved, or a spec `resolve` takes."""
    if mode != "inprocess":
        return None
    trainer = trainer_device if isinstance(trainer_device, torch.device) else resolve(
        trainer_device
    )
    device = resolve_device(engine.device)
    if trainer.type == "cuda" and device.type == "cpu":
        raise ValueError(
            f"inference.engine.device={engine.device!r} puts the in-process engine on the CPU "
            f"while the trainer runs on {trainer}: every rollout would be generated on the CPU. "
            "Set inference.engine.device='auto' or 'cuda' to share the trainer's GPU (its share "
            f"is inference.engine.gpu_memory_fraction={engine.gpu_memory_fraction}), or run the "
            "engines as servers: inference.mode='local' (the job starts them) or 'remote' "
            "(inference.remote.addresses)"
        )
    return device
