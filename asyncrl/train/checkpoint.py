"""A checkpoint of stateful parts: what each part's `state_dict()` returns, loaded back through its
`load_state_dict`. The one format every checkpoint of the project uses (a run's checkpoints,
launch/run_checkpoints.py, register their parts and call these two functions).

    DIR/.metadata, DIR/*.distcp   the sharded parts (train engines: weights and Adam state),
                                  torch.distributed.checkpoint (DCP): every rank writes its own
                                  shards, any number of ranks loads them (re-sharded)
    DIR/plain.pt                  the plain parts (a loop's counters, a data position, the
                                  episodes in flight), rank 0's, pickled

Every rank calls both functions with the same sharded parts, in the same order (their
`state_dict` may be collective); only rank 0 has plain parts. A process without a process group
saves and loads the same layout (DCP's `no_dist`). The caller makes the write atomic (a run
writes a hidden directory and renames it).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from asyncrl.api import Stateful
from asyncrl.train.parallel import Parallelism

PLAIN_FILE = "plain.pt"
METADATA = ".metadata"  # written by DCP last: a directory without it is incomplete


@contextmanager
def _dcp_quiet() -> Iterator[None]:
    """DCP warns when it runs without a process group, which is our intent, not a hint."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def save_state(path: str | Path, parallel: Parallelism, sharded: Mapping[str, Stateful],
               plain: Mapping[str, Stateful] | None = None) -> None:
    """Write every part's state under directory `path` (see the module docstring)."""
    path = Path(path)
    if parallel.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    parallel.barrier()
    with _dcp_quiet():
        dcp.save(dict(sharded), checkpoint_id=path, no_dist=parallel.world_size == 1)
    if parallel.rank == 0 and plain:
        torch.save({name: part.state_dict() for name, part in plain.items()}, path / PLAIN_FILE)
    parallel.barrier()  # no rank goes on before the whole checkpoint is on disk


def load_state(path: str | Path, parallel: Parallelism, sharded: Mapping[str, Stateful],
               plain: Mapping[str, Stateful] | None = None) -> None:
    """Restore the parts of a `save_state` directory (saved on any number of ranks)."""
    path = Path(path)
    if not (path / METADATA).is_file():
        raise FileNotFoundError(f"checkpoint {path} has no {METADATA}; expected a directory "
                                "written by asyncrl.train.checkpoint.save_state")
    with _dcp_quiet():
        dcp.load(dict(sharded), checkpoint_id=path, no_dist=parallel.world_size == 1)
    if plain:
        states = read_plain(path)
        missing = sorted(set(plain) - set(states))
        if missing:
            raise FileNotFoundError(f"checkpoint {path} holds no state of {missing}; it has "
                                    f"{sorted(states)}")
        for name, part in plain.items():
            part.load_state_dict(states[name])


def read_plain(path: str | Path) -> dict[str, Any]:
    """The plain parts' states of a checkpoint directory, by name (without loading them)."""
    file = Path(path) / PLAIN_FILE
    if not file.is_file():
        return {}
    return torch.load(file, weights_only=False)  # our own file: pickled python objects
