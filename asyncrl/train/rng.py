"""Every RNG a training process draws from (python, numpy, torch, CUDA), as one saveable state.

A checkpoint keeps each rank's state; a rank the checkpoint has none for (a resume on more ranks)
is re-seeded from a hash of rank 0's saved state and its rank, so the same resume always
re-seeds it the same way.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch


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
    """The seed of a rank the checkpoint has no RNG state for."""
    data = rank0_state["torch"].numpy().tobytes() + rank.to_bytes(8, "little")
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def reseed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every CUDA device too
