"""How a train engine's work is spread over processes: `SingleProcess`, or FSDP2 data parallelism
(`fsdp.FSDP2`). The engine is composed with one (`HFTrainEngine(..., parallel=...)`) and asks it
for everything that differs between the two: how the model is placed, which samples this rank
trains on, and the few collectives a step needs (the global loss normaliser, the common
micro-batch count, per-rank outputs and stats, the full weights, RNG states for a checkpoint).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch

from asyncrl.api.trajectory import Sample
from asyncrl.train.config import TrainEngineConfig


class Parallelism(Protocol):
    world_size: int
    rank: int
    # a shared prompt may reach the loss through a KV cache (train.share_prefixes); FSDP2's
    # backward hooks do not see the cache, so it cannot
    shares_prefixes: bool
    # the model's trunk may run without its root module (the chunked logprob head calls the
    # trunk and the output matrix itself); FSDP2 gathers the root's weights in the root's hook
    splits_head: bool

    def prepare(self, model: torch.nn.Module, cfg: TrainEngineConfig,
                device: torch.device) -> torch.nn.Module:
        """The model on `device`, sharded when this strategy shards."""

    def local_indices(self, samples: Sequence[Sample]) -> list[int]:
        """Which of `samples` this rank trains on."""

    def all_sum(self, x: torch.Tensor) -> torch.Tensor: ...

    def all_max(self, n: int) -> int: ...

    def gather_outputs(self, local: dict[int, torch.Tensor], n: int) -> list[torch.Tensor]:
        """Every rank's per-sample outputs (keyed by sample index), as one list of `n`."""

    def reduce_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """Each rank's token-weighted stat contributions, summed."""

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on the CPU of rank 0, empty elsewhere; every rank calls."""

    def all_gather_object(self, obj: Any) -> list[Any]: ...

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank."""

    def barrier(self) -> None: ...

    def close(self) -> None:
        """Leave the process group (every rank, before exit)."""


class SingleProcess:
    world_size, rank, shares_prefixes, splits_head = 1, 0, True, True

    def prepare(self, model: torch.nn.Module, cfg: TrainEngineConfig,
                device: torch.device) -> torch.nn.Module:
        return model.to(device)

    def local_indices(self, samples: Sequence[Sample]) -> list[int]:
        return list(range(len(samples)))

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_max(self, n: int) -> int:
        return n

    def gather_outputs(self, local: dict[int, torch.Tensor], n: int) -> list[torch.Tensor]:
        return [local[i] for i in range(n)]

    def reduce_stats(self, stats: dict[str, float]) -> dict[str, float]:
        return stats

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in model.state_dict().items()}

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        return obj

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass
