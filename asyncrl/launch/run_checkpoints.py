"""Checkpoints of a training run: RUN/checkpoints/step_NNNNNN/{policy/, trainer/, state.json}.

`policy/` is a plain HF model directory (weights + tokenizer) that `asyncrl eval`, `asyncrl serve`
or vLLM load directly; `trainer/` holds the full training state (weights, optimizer, LR schedule,
RNG); `state.json` the loop's own position (step, data position, elapsed time). A checkpoint is
written under a hidden name and renamed into place, then `latest` is updated, so a crash mid-write
never leaves a checkpoint that looks complete.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from asyncrl.errors import UserError

CHECKPOINTS = "checkpoints"
LATEST = "latest"


@dataclass
class LoopState:
    step: int
    version: int
    data_position: int
    train_seconds: float  # training wall time so far (evals and checkpoints excluded)
    wall_seconds: float


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / CHECKPOINTS / f"step_{step:06d}"


def save_run_checkpoint(run_dir: Path, state: LoopState, trainer: Any, tokenizer: Any,
                        keep: int) -> Path:
    """Every trainer rank calls this (the weights are gathered and saved collectively);
    rank 0 writes the files."""
    from asyncrl.train.weight_sync import save_state_dict_dir

    final = step_dir(run_dir, state.step)
    tmp = final.parent / f".{final.name}.tmp"
    weights = trainer.model_state_dict()  # full on rank 0 (collective under FSDP)
    writer = trainer.rank == 0
    if writer:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        save_state_dict_dir(weights, trainer.model.config, tmp / "policy", tokenizer)
    trainer.save(tmp / "trainer", extra_state={"loop": asdict(state)})
    if not writer:
        return final
    (tmp / "state.json").write_text(json.dumps(asdict(state), indent=2))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest = final.parent / LATEST
    latest.with_suffix(".tmp").write_text(final.name)
    os.replace(latest.with_suffix(".tmp"), latest)
    _prune(final.parent, keep)
    return final


def _prune(checkpoints: Path, keep: int) -> None:
    if keep <= 0:
        return
    steps = sorted(p for p in checkpoints.glob("step_*") if p.is_dir())
    for old in steps[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(run_dir: Path) -> Path:
    checkpoints = run_dir / CHECKPOINTS
    marker = checkpoints / LATEST
    if marker.is_file():
        path = checkpoints / marker.read_text().strip()
        if (path / "state.json").is_file():
            return path
    steps = sorted(p for p in checkpoints.glob("step_*") if (p / "state.json").is_file())
    if not steps:
        raise UserError(f"--resume {run_dir}: no checkpoint found under {checkpoints} "
                        "(expected step_NNNNNN/ directories written by asyncrl train)")
    return steps[-1]


def load_loop_state(ckpt: Path) -> LoopState:
    return LoopState(**json.loads((ckpt / "state.json").read_text()))
