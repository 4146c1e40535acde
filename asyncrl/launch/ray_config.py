"""`ray:` in a training config: which Ray cluster, and what each trainer rank and rollout server
asks of it (`launcher: ray`, or `asyncrl train --ray ADDRESS`).

Trainer ranks are one placement group (a bundle per rank, `placement_strategy`), so the group
lands together or not at all; servers are actors of their own, restarted by Ray when they die.
Custom resources (`resources_per_rank`, `resources_per_server`) pin either to nodes that
advertise them (`ray start --resources '{"rollout": 4}'`).
"""

from __future__ import annotations

from typing import Literal

import pydantic

from asyncrl.config import Config


class RayConfig(Config):
    # None: start a local Ray for this job (stopped at the end); "auto": the cluster this machine
    # is part of (`ray start`); "HOST:PORT": that cluster's head
    address: str | None = None
    trainer_ranks: int = pydantic.Field(1, ge=1)  # torch.distributed world (gloo CPU, NCCL GPU)
    cpus_per_rank: float = pydantic.Field(1.0, ge=0)  # CPUs each trainer rank reserves
    gpus_per_rank: float = pydantic.Field(0.0, ge=0)  # 1 on GPU clusters
    # custom Ray resources per rank, e.g. {trainer_node: 1}
    resources_per_rank: dict[str, float] = {}
    # how the ranks' bundles spread over nodes
    placement_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    cpus_per_server: float = pydantic.Field(1.0, ge=0)  # inference.num_servers of them
    gpus_per_server: float = pydantic.Field(0.0, ge=0)  # the server's tensor-parallel size
    resources_per_server: dict[str, float] = {}  # custom Ray resources per server
    # a dead server actor is started again this many times (-1: always); it rejoins the
    # rotation once it serves the current weights
    max_server_restarts: int = pydantic.Field(3, ge=-1)
    server_poll_s: float = pydantic.Field(2.0, gt=0)  # how often rank 0 looks for restarts
    placement_timeout_s: float = pydantic.Field(300.0, gt=0)  # the trainer group's resources

    def rank_bundle(self) -> dict[str, float]:
        return bundle(self.cpus_per_rank, self.gpus_per_rank, self.resources_per_rank)


def bundle(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, float]:
    bundle = {"CPU": cpus, **resources}
    if gpus:
        bundle["GPU"] = gpus
    return bundle
