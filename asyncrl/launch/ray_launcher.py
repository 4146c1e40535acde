"""A training job on a Ray cluster (`launcher: ray`): trainer ranks as actors in one placement
group, torch.distributed initialised inside them as torchrun would (gloo on CPU, NCCL on GPU).
`RayLauncher` is the `Launcher` (launch/launchers.py) the ray kind builds.

The driver (the `asyncrl train` process) connects to the cluster (or starts a local Ray), reserves
one bundle per rank (`launcher.*_per_rank`, `launcher.placement_strategy`) and waits until the
whole group fits, starts one actor per bundle, takes rank 0's node address and a free port there
as the rendezvous, and runs the job's entry (the function a torchrun rank runs) in every actor
with RANK / WORLD_SIZE / MASTER_ADDR set. Rank 0 leads as under torchrun: it runs the executor,
evaluations and checkpoints, and (mode local) places the rollout servers as Ray actors of their
own (`RayLauncher.servers`, ray_servers.py).

Failures: the first rank to fail ends the job. An exception is re-raised as it is; a rank whose
process died (a lost node, an OOM kill) raises `TrainerRankDied`, naming the rank and the latest
checkpoint to resume from. Every actor and the placement group are removed on the way out, on
Ctrl-C too, so nothing keeps holding the cluster's resources.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.errors import JobFailed, UserError
from asyncrl.launch.ray_servers import RayServers, node_address, record_placement

if TYPE_CHECKING:
    from asyncrl.launch.launchers import Job, MakeCommand, RayLauncherConfig, Result

CWD_ENV = "ASYNCRL_RAY_CWD"  # the driver's working directory
# what every Ray worker of the job needs from the driver's environment
PASSED_ENV = ("PYTHONPATH", "ASYNCRL_CACHE", "HF_HOME", "HF_HUB_OFFLINE", "OMP_NUM_THREADS")


class TrainerRankDied(JobFailed):
    """A trainer rank's process is gone; the job stopped and can resume from a checkpoint."""


class TrainerRank:
    """One rank of the trainer group: the job's entry, in this actor's process."""

    def rendezvous(self) -> tuple[str, int]:
        host = node_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return host, s.getsockname()[1]

    def run(self, entry: Callable[[Job], Result], job: Job,
            env: dict[str, str]) -> Result:
        os.environ.update(env)
        # relative paths of the config (model, data, run dir) mean what they meant to the driver
        # (the nodes share its file system: checkpoints are written by every rank)
        os.chdir(env[CWD_ENV])
        return entry(job)

    def node(self) -> dict[str, Any]:
        import ray

        return {"node": ray.get_runtime_context().get_node_id(), "ip": node_address(),
                "pid": os.getpid()}


class RayLauncher:
    def __init__(self, cfg: RayLauncherConfig) -> None:
        self.cfg = cfg

    def run(self, job: Job, entry: Callable[[Job], Result]) -> Result:
        """On the driver: `entry(job)` in one actor per rank; rank 0's result."""
        try:
            import ray
        except ImportError as err:
            raise UserError("launcher: ray needs Ray: pip install 'asyncrl[ray]'") from err
        started = not ray.is_initialized()
        if started:
            env = {k: os.environ[k] for k in PASSED_ENV if k in os.environ}
            ray.init(address=self.cfg.address, runtime_env={"env_vars": env} if env else None,
                     log_to_driver=True)
        job.run_dir.mkdir(parents=True, exist_ok=True)  # every rank needs the same run dir
        group = _TrainerGroup(ray, self.cfg, job, entry)
        try:
            return group.run()
        finally:
            group.remove()
            if started:
                ray.shutdown()

    def servers(self, make: MakeCommand, count: int, log_dir: Path,
                startup_timeout_s: float) -> RayServers:
        """Inside rank 0's actor: the servers as Ray actors, on nodes with their resources."""
        return RayServers(make, count, log_dir, startup_timeout_s, self.cfg)


class _TrainerGroup:
    def __init__(self, ray: Any, cfg: RayLauncherConfig, job: Job,
                 entry: Callable[[Job], Result]) -> None:
        self.ray, self.cfg, self.job, self.entry = ray, cfg, job, entry
        self.pg: Any = None
        self.actors: list[Any] = []

    def run(self) -> Result:
        ray, cfg = self.ray, self.cfg
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = cfg.rank_bundle()
        self.pg = placement_group([dict(bundle)] * cfg.trainer_ranks,
                                  strategy=cfg.placement_strategy)
        ready, _ = ray.wait([self.pg.ready()], timeout=cfg.placement_timeout_s)
        if not ready:
            raise UserError(
                f"Ray could not place {cfg.trainer_ranks} trainer rank(s) of {bundle} each "
                f"({cfg.placement_strategy}) within {cfg.placement_timeout_s:.0f}s; the cluster "
                f"has {ray.cluster_resources()} (lower ray.trainer_ranks or ray.*_per_rank, or "
                "add nodes)")
        others = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        for i in range(cfg.trainer_ranks):
            strategy = PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=i)
            self.actors.append(ray.remote(TrainerRank).options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                resources=others or None, scheduling_strategy=strategy,
                max_restarts=0).remote())
        addr, port = ray.get(self.actors[0].rendezvous.remote())
        self._record_placement()
        refs = [a.run.remote(self.entry, self.job, self._env(i, addr, port))
                for i, a in enumerate(self.actors)]
        return self._wait(refs)

    def _record_placement(self) -> None:
        """Where each rank landed: logged, and in RUN/ray_placement.json with the servers'."""
        nodes = self.ray.get([a.node.remote() for a in self.actors])
        print("trainer ranks placed by Ray: " + ", ".join(
            f"rank {i} on node {n['node'][:8]} ({n['ip']})" for i, n in enumerate(nodes)),
            file=sys.stderr, flush=True)
        record_placement(self.job.run_dir, "trainer_ranks", nodes)

    def _env(self, rank: int, addr: str, port: int) -> dict[str, str]:
        # LOCAL_RANK 0: Ray gives each rank actor its own CUDA_VISIBLE_DEVICES
        return {CWD_ENV: os.getcwd(), "RANK": str(rank), "WORLD_SIZE": str(self.cfg.trainer_ranks),
                "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": addr,
                "MASTER_PORT": str(port)}

    def _wait(self, refs: list[Any]) -> Result:
        from ray.exceptions import RayActorError, RayTaskError

        pending = list(refs)
        while pending:
            done, pending = self.ray.wait(pending, num_returns=1)
            try:
                self.ray.get(done[0])
            except RayActorError as err:
                raise TrainerRankDied(self._died(refs.index(done[0]), err)) from None
            except RayTaskError as err:
                # A rank that lost its peer fails in a collective first: report the lost one.
                dead = self._dead_rank(refs, pending)
                if dead is not None:
                    raise TrainerRankDied(self._died(*dead)) from err
                raise err.as_instanceof_cause() from None  # the rank's own error, as it is
        return self.ray.get(refs[0])

    def _dead_rank(self, refs: list[Any], pending: list[Any]) -> tuple[int, Exception] | None:
        from ray.exceptions import RayActorError

        done, _ = self.ray.wait(pending, num_returns=len(pending), timeout=10)
        for ref in done:
            try:
                self.ray.get(ref)
            except RayActorError as err:
                return refs.index(ref), err
            except Exception:  # noqa: BLE001 (another rank's consequential error)
                continue
        return None

    def _died(self, rank: int, err: Exception) -> str:
        from asyncrl.launch.run_checkpoints import latest_checkpoint

        run_dir = self.job.run_dir
        try:
            latest = f"latest checkpoint {latest_checkpoint(run_dir).name}"
        except UserError:
            latest = "no checkpoint yet: it would start over"
        cause = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        return (f"trainer rank {rank} of {self.cfg.trainer_ranks} died ({cause}); the job is "
                f"stopped with every rank and server actor. Resume: asyncrl train --resume "
                f"{run_dir} ({latest})")

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for a in self.actors:
            with contextlib.suppress(Exception):  # already gone
                self.ray.kill(a, no_restart=True)
        if self.pg is not None:
            remove_placement_group(self.pg)


__all__ = ["RayLauncher", "TrainerRankDied"]
