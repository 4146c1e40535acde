"""Where a training job runs: the `LAUNCHERS` registry (asyncrl/plugins.py), `launcher:` in a run
config, each kind a config whose `build()` makes the `Launcher`.

- local (the default): this process runs the job (under torchrun every rank does), and servers of
  `inference.mode: local` are processes of this machine (launch/local_servers.py);
- ray (`asyncrl train --ray ADDRESS`): trainer ranks are Ray actors in one placement group, and
  the servers Ray actors of their own (launch/ray_launcher.py, launch/ray_servers.py).

A launcher does two things for a job: `run(job, entry)` runs `entry(job)` where the job belongs
(once here, or once per rank on the cluster) and returns rank 0's result; `servers(...)` starts the
rollout servers of mode local where its placement puts them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

import pydantic

from asyncrl.config import Config
from asyncrl.plugins import Registry

if TYPE_CHECKING:
    from asyncrl.inference.backend_protocol import ServerCommand

Job = TypeVar("Job")  # what `entry` runs (a training job: launch/train.py's TrainJob)
Result = TypeVar("Result")  # what it returns (rank 0's)

# make(api_key, host) -> the ServerCommand of one server (called once per server)
MakeCommand = Callable[[str, str], "ServerCommand"]


class ServerFleet(Protocol):
    """Running inference servers the job started."""

    urls: list[str]
    api_key: str

    def watching(self, engine: Any) -> contextlib.AbstractContextManager[None]:
        """While inside: a restarted server's new address reaches `engine.replace_server`."""


class Launcher(Protocol):
    def run(self, job: Job, entry: Callable[[Job], Result]) -> Result:
        """`entry(job)` where the job belongs (here, or once per rank on a cluster); rank 0's
        result."""


    def servers(self, make: MakeCommand, count: int, log_dir: Path,
                startup_timeout_s: float) -> contextlib.AbstractContextManager[ServerFleet]: ...


def pin_process(cpus: Sequence[int]) -> None:
    """Run every thread of this process (and what it starts later) on `cpus` only. Linux sets
    affinity per thread, so each thread that exists already (e.g. torch's pool) is moved too."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


class LocalLauncher:
    def __init__(self, trainer_cpus: Sequence[int] | None = None,
                 server_cpus: Sequence[int] | None = None) -> None:
        self.trainer_cpus, self.server_cpus = trainer_cpus, server_cpus

    def run(self, job: Job, entry: Callable[[Job], Result]) -> Result:
        if self.trainer_cpus:  # under torchrun, every rank's process gets here
            from asyncrl.errors import UserError

            if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
                raise UserError("launcher.trainer_cpus pins one trainer process; under torchrun "
                                "pin the ranks with taskset/numactl instead")
            pin_process(self.trainer_cpus)
        return entry(job)

    @contextlib.contextmanager
    def servers(self, make: MakeCommand, count: int, log_dir: Path,
                startup_timeout_s: float) -> Iterator[ServerFleet]:
        from asyncrl.launch.local_servers import LocalServers

        with LocalServers(lambda key: make(key, "127.0.0.1"), count, log_dir,
                          startup_timeout_s, cpus=self.server_cpus) as servers:
            yield servers


class LauncherKind(Config):
    """The base of every launcher config (`LAUNCHERS`): `build()` makes the Launcher; the CPU
    pinning a kind may offer (None: none)."""

    def build(self) -> Launcher:
        """The launcher this config describes."""
        raise NotImplementedError

    def trainer_cpu_ids(self) -> list[int] | None:
        """The CPU ids the trainer process is pinned to; None: wherever the OS puts it."""
        return None

    def server_cpu_ids(self) -> list[int] | None:
        """The CPU ids the servers of inference.mode local are pinned to; None: the OS decides."""
        return None


class LocalLauncherConfig(LauncherKind):
    """This machine: one process, or the ranks `torchrun` started (FSDP2).

    `trainer_cpus` / `server_cpus` place the trainer process and the servers of
    `inference.mode: local` on CPU ids of their own (Linux affinity), as generation and training
    would sit on separate GPUs: e.g. `{trainer_cpus: [1], server_cpus: [0]}` on 2 cores. The
    trainer's torch threads default to its CPU count."""

    kind: Literal["local"] = "local"  # the launcher (LAUNCHERS: local | ray)
    trainer_cpus: list[int] | None = None  # None: wherever the OS puts it
    server_cpus: list[int] | None = None  # every local server on these; None: the OS decides

    @pydantic.field_validator("trainer_cpus", "server_cpus")
    @classmethod
    def _cpus_here(cls, cpus: list[int] | None, info: pydantic.ValidationInfo) -> list[int] | None:
        if cpus is None:
            return None
        allowed = sorted(os.sched_getaffinity(0))
        if not cpus or len(set(cpus)) != len(cpus) or not set(cpus) <= set(allowed):
            raise ValueError(f"launcher.{info.field_name}={cpus} must be distinct CPU ids this "
                             f"process may use; allowed: {allowed}")
        return cpus

    def build(self) -> Launcher:
        return LocalLauncher(self.trainer_cpus, self.server_cpus)

    def trainer_cpu_ids(self) -> list[int] | None:
        return self.trainer_cpus

    def server_cpu_ids(self) -> list[int] | None:
        return self.server_cpus


class RayLauncherConfig(LauncherKind):
    """A Ray cluster: which one, and what each trainer rank and rollout server asks of it.

    Trainer ranks are one placement group (a bundle per rank, `placement_strategy`), so the
    group lands together or not at all; servers are actors of their own, restarted by Ray when
    they die. Custom resources (`resources_per_rank`, `resources_per_server`) pin either to
    nodes that advertise them (`ray start --resources '{"rollout": 4}'`)."""

    kind: Literal["ray"] = "ray"  # the launcher (LAUNCHERS: local | ray)
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

    def build(self) -> Launcher:
        from asyncrl.launch.ray_launcher import RayLauncher

        return RayLauncher(self)

    def rank_bundle(self) -> dict[str, float]:
        return bundle(self.cpus_per_rank, self.gpus_per_rank, self.resources_per_rank)

    def server_bundle(self) -> dict[str, float]:
        return bundle(self.cpus_per_server, self.gpus_per_server, self.resources_per_server)


def bundle(cpus: float, gpus: float, resources: dict[str, float]) -> dict[str, float]:
    out = {"CPU": cpus, **resources}
    if gpus:
        out["GPU"] = gpus
    return out


LAUNCHERS: Registry = Registry("launcher", base=LauncherKind)
LAUNCHERS.register(LocalLauncherConfig)
LAUNCHERS.register(RayLauncherConfig)

LauncherConfig = LAUNCHERS.field()
