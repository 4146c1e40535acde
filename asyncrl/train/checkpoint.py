"""Save and resume a train engine exactly: weights, optimizer, LR schedule, RNGs, counters.

Layout of a checkpoint directory:
    model.safetensors   full (unsharded) weights, loadable without asyncrl
    trainer.pt          optimizer + scheduler state, step, version, RNG states, extra_state

`extra_state` is the caller's (data-loader position, rollout executor counters, ...). The
directory is written under a temporary name and renamed into place, so a crash mid-save leaves
the previous checkpoint intact and never a half-written one under the final name. In a
distributed run every rank calls save/load (gathering is collective); rank 0 writes, and each
rank restores its own RNG states (stored per rank).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from asyncrl.train.engine import HFTrainEngine

MODEL_FILE = "model.safetensors"
TRAINER_FILE = "trainer.pt"


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _is_writer(engine: HFTrainEngine) -> bool:
    return engine.rank == 0


def _gather_rng(engine: HFTrainEngine) -> list[dict[str, Any]]:
    if engine.world_size == 1:
        return [rng_state()]
    gathered: list[Any] = [None] * engine.world_size
    torch.distributed.all_gather_object(gathered, rng_state())
    return gathered


def _atomic_dir_write(path: Path, write: Any) -> None:
    """Run write(tmp_dir), then move tmp_dir to `path` (replacing an older checkpoint)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        write(tmp)
        old = None
        if path.exists():
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def save_checkpoint(
    engine: HFTrainEngine, path: str | Path, extra_state: dict[str, Any] | None = None
) -> None:
    """Write `engine`'s full training state (plus `extra_state`) to directory `path`."""
    weights = engine.model_state_dict()
    optim = engine.optimizer_state_dict()
    rngs = _gather_rng(engine)
    if not _is_writer(engine):
        _barrier(engine)
        return
    trainer = {
        "optimizer": optim,
        "scheduler": engine.scheduler.state_dict() if engine.scheduler is not None else None,
        "step": engine.step,
        "version": engine.version.value,
        "rng": rngs,
        "extra_state": dict(extra_state or {}),
    }

    def write(tmp: Path) -> None:
        # Clone: tied weights share storage, which safetensors refuses to write twice.
        save_file({k: v.detach().cpu().contiguous().clone() for k, v in weights.items()},
                  str(tmp / MODEL_FILE))
        torch.save(trainer, tmp / TRAINER_FILE)

    _atomic_dir_write(Path(path), write)
    _barrier(engine)


def _barrier(engine: HFTrainEngine) -> None:
    if engine.world_size > 1:
        torch.distributed.barrier()


def load_checkpoint(engine: HFTrainEngine, path: str | Path) -> dict[str, Any]:
    """Restore a `save_checkpoint` directory into `engine`; returns the saved extra_state."""
    p = Path(path)
    for name in (MODEL_FILE, TRAINER_FILE):
        if not (p / name).is_file():
            raise FileNotFoundError(f"checkpoint {p} has no {name}; expected a directory written "
                                    "by save_checkpoint")
    weights = load_file(str(p / MODEL_FILE)) if _is_writer(engine) or engine.world_size == 1 else {}
    engine.load_model_state_dict(weights)
    # Our own file (optimizer tensors + numpy RNG state), so full unpickling is expected here.
    trainer = torch.load(p / TRAINER_FILE, weights_only=False, map_location="cpu")
    if trainer["optimizer"] is not None:
        engine.load_optimizer_state_dict(trainer["optimizer"])
    if trainer["scheduler"] is not None and engine.scheduler is not None:
        engine.scheduler.load_state_dict(trainer["scheduler"])
    engine.step = trainer["step"]
    engine.version.set(trainer["version"])
    rngs = trainer["rng"]
    if len(rngs) != engine.world_size:
        raise ValueError(f"checkpoint {p} holds RNG states of {len(rngs)} ranks; this run has "
                         f"world_size={engine.world_size} (allowed: {len(rngs)})")
    set_rng_state(rngs[engine.rank])
    return trainer["extra_state"]
