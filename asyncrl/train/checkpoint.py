"""Save and resume a train engine exactly: weights, optimizer, LR schedule, RNGs, counters.

Layout of a checkpoint directory:
    state/              weights + optimizer state, sharded (torch.distributed.checkpoint, DCP):
                        every rank writes its own shards; any world size can load them
    trainer.pt          scheduler state, step, version, per-rank RNG states, extra_state
    model.safetensors   full (unsharded) weights, loadable without asyncrl (optional export;
                        resume reads state/)

`extra_state` is the caller's (data-loader position, rollout executor counters, ...). The
directory is written under a temporary name and renamed into place, so a crash mid-save leaves
the previous checkpoint intact and never a half-written one under the final name. In a
distributed run every rank calls save/load (both are collective) and writes into the same
temporary directory, so the ranks need a shared filesystem; rank 0 creates and renames it.

Resuming on a different world size re-shards weights and optimizer state (DCP reads the pieces
each rank needs). RNG states are per rank: ranks that existed at save time get their own back,
new ranks are re-seeded deterministically from rank 0's saved state and their rank (logged).
One process without a process group saves and loads the same layout (DCP's `no_dist`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

if TYPE_CHECKING:
    from asyncrl.train.engine import HFTrainEngine

log = logging.getLogger(__name__)

STATE_DIR = "state"
TRAINER_FILE = "trainer.pt"
MODEL_FILE = "model.safetensors"
FORMAT = 2  # 1 (no state/): full optimizer in trainer.pt, weights in model.safetensors


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


def derived_seed(rank0_state: dict[str, Any], rank: int) -> int:
    """The seed of a rank the checkpoint has no RNG state for: a hash of rank 0's saved torch
    state and the rank, so a resume on the same world size always re-seeds it the same way."""
    data = rank0_state["torch"].numpy().tobytes() + rank.to_bytes(8, "little")
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def _reseed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every CUDA device too


def _gather_rng(engine: HFTrainEngine) -> list[dict[str, Any]]:
    if engine.world_size == 1:
        return [rng_state()]
    gathered: list[Any] = [None] * engine.world_size
    dist.all_gather_object(gathered, rng_state())
    return gathered


def _barrier(engine: HFTrainEngine) -> None:
    if engine.world_size > 1:
        dist.barrier()


def _train_state(engine: HFTrainEngine, with_optimizer: bool) -> dict[str, Any]:
    """{"model": ..., ["optim": ...]} keyed by parameter names: DTensor shards under FSDP, plain
    tensors on one process; the same keys either way, which is what lets DCP re-shard."""
    if engine.optimizer is None or not with_optimizer:
        return {"model": get_model_state_dict(engine.model)}
    # Also materialises Adam's state on a fresh optimizer (a zero-lr step), as DCP load needs.
    model, optim = get_state_dict(engine.model, engine.optimizer)
    return {"model": model, "optim": optim}


@contextmanager
def _dcp_quiet(engine: HFTrainEngine) -> Iterator[bool]:
    """Yields DCP's `no_dist` (one process: no process group needed) and silences the warning
    DCP gives for it, which is our intent, not a hint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield engine.world_size == 1


def _shared_tmp_dir(engine: HFTrainEngine, path: Path) -> Path:
    """A fresh hidden directory next to `path`, made by rank 0, its name sent to every rank."""
    tmp = None
    if engine.rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    if engine.world_size > 1:
        box = [tmp]
        dist.broadcast_object_list(box, src=0)
        tmp = box[0]
    return Path(tmp)


def _replace_dir(tmp: Path, path: Path) -> None:
    """Move `tmp` to `path`, replacing an older checkpoint there."""
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old-{os.getpid()}")
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(
    engine: HFTrainEngine, path: str | Path, extra_state: dict[str, Any] | None = None,
    full_weights: bool = True,
) -> None:
    """Write `engine`'s full training state (plus `extra_state`) to directory `path`.

    `full_weights`: also gather the weights into `model.safetensors` (rank 0); a caller that
    exports them elsewhere (the run checkpoint's policy/) skips the second gather."""
    path = Path(path)
    tmp = _shared_tmp_dir(engine, path)
    try:
        with _dcp_quiet(engine) as no_dist:
            dcp.save(_train_state(engine, with_optimizer=True), checkpoint_id=tmp / STATE_DIR,
                     no_dist=no_dist)
        weights = engine.model_state_dict() if full_weights else None  # collective under FSDP
        rngs = _gather_rng(engine)
        if engine.rank == 0:
            scheduler = engine.scheduler
            trainer = {
                "format": FORMAT,
                "world_size": engine.world_size,
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "step": engine.step,
                "version": engine.version.value,
                "rng": rngs,
                "extra_state": dict(extra_state or {}),
            }
            torch.save(trainer, tmp / TRAINER_FILE)
            if weights is not None:
                # Clone: tied weights share storage, which safetensors refuses to write twice.
                save_file({k: v.detach().cpu().contiguous().clone() for k, v in weights.items()},
                          str(tmp / MODEL_FILE))
        _barrier(engine)  # every rank's shards are on disk before the rename
        if engine.rank == 0:
            _replace_dir(tmp, path)
    finally:
        if engine.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
    _barrier(engine)  # no rank goes on before the checkpoint is in place


def load_checkpoint(engine: HFTrainEngine, path: str | Path) -> dict[str, Any]:
    """Restore a `save_checkpoint` directory into `engine` (any world size); returns the saved
    extra_state. A forward-only engine (trainable=False) loads the weights only."""
    p = Path(path)
    for name in (STATE_DIR, TRAINER_FILE):
        if not (p / name).exists():
            raise FileNotFoundError(
                f"checkpoint {p} has no {name}; expected a directory written by save_checkpoint "
                f"(format {FORMAT}: {STATE_DIR}/ + {TRAINER_FILE}; format 1, with the optimizer "
                f"in {TRAINER_FILE} and no {STATE_DIR}/, is not resumable by this version)")
    # Our own file (numpy RNG state), so full unpickling is expected here.
    trainer = torch.load(p / TRAINER_FILE, weights_only=False, map_location="cpu")
    saved_keys = dcp.FileSystemReader(p / STATE_DIR).read_metadata().state_dict_metadata
    with_optim = any(k.startswith("optim.") for k in saved_keys)
    state = _train_state(engine, with_optimizer=with_optim)
    with _dcp_quiet(engine) as no_dist:
        dcp.load(state, checkpoint_id=p / STATE_DIR, no_dist=no_dist)
    if "optim" in state:
        set_state_dict(engine.model, engine.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    else:
        set_model_state_dict(engine.model, state["model"])
    if trainer["scheduler"] is not None and engine.scheduler is not None:
        engine.scheduler.load_state_dict(trainer["scheduler"])
    engine.step = trainer["step"]
    engine.version.set(trainer["version"])
    _restore_rng(engine, trainer["rng"], p)
    return trainer["extra_state"]


def _restore_rng(engine: HFTrainEngine, rngs: list[dict[str, Any]], path: Path) -> None:
    saved, world = len(rngs), engine.world_size
    if engine.rank < saved:
        set_rng_state(rngs[engine.rank])
    else:
        _reseed(derived_seed(rngs[0], engine.rank))
    if saved != world and engine.rank == 0:
        if world > saved:
            what = (f"ranks {saved}..{world - 1} re-seeded deterministically from rank 0's saved "
                    "state")
        else:
            what = f"the states of ranks {world}..{saved - 1} are not used"
        log.warning("checkpoint %s holds RNG states of %d ranks, this run has %d: %s",
                    path, saved, world, what)
