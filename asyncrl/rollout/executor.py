"""The workflow executor: runs episodes on an asyncio loop of its own thread, under the staleness
bound, and hands the trainer batches of finished trajectories.

The trainer thread calls the synchronous API (`prepare_batch`, `submit`, `wait`, `pause`,
`resume`); episodes run concurrently on the executor's loop so engines stay
fed while the trainer computes. Trajectories are handed out oldest-start first; one that became
staler than eta before it was consumed is not trained on: its prompt is queued again, so nothing is
lost. A workflow that raises is a failed episode, never a crashed run; rejections are logged
rate-limited and counted in a row (`RejectionLog`), which the job's watchdog reads.

`suspend` interrupts every episode in flight for a checkpoint and takes out everything the
executor holds (rows not started, trajectories not consumed, suspended episodes with their
generation journals: rollout/journal.py); `restore` puts a snapshot back, and suspended episodes
continue from the tokens they had. While suspended, `state_dict` is what a checkpoint keeps (the
staleness counters and that snapshot); `load_state_dict` puts both back after a restart.

One executor runs one workflow (and one accept rule, e.g. the DAPO uniform-group filter), given
at construction.

The policy version is the one the engines serve (a `PolicyVersion` owned by the job's rollout
side, moved once every engine holds new weights); the executor reads it and subscribes, so that a
push re-opens the staleness capacity at once.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
import uuid
from collections import Counter
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pydantic

from asyncrl.api import (EpisodeRejected, EpisodeSuspended, InferenceEngine, PolicyVersion,
                         RolloutStatus, RolloutWorkflow, StopReason, Trajectory)
from asyncrl.config import Config
from asyncrl.rollout.journal import EpisodeJournal, JournaledEngine
from asyncrl.rollout.rejections import RejectionLog
from asyncrl.rollout.snapshot import ReadyEpisode, RolloutSnapshot, SuspendedEpisode
from asyncrl.rollout.staleness import StalenessManager
from asyncrl.rollout.trajectory_dump import TrajectoryDump

log = logging.getLogger(__name__)
AcceptFn = Callable[[Trajectory], bool]


class RolloutConfig(Config):
    batch_size: int = pydantic.Field(16, ge=1)  # trajectories consumed per policy version
    # episodes in flight at once (the engines' load)
    max_concurrent_rollouts: int = pydantic.Field(64, ge=1)
    max_head_offpolicyness: int = pydantic.Field(0, ge=0)  # eta; 0 = synchronous
    dump_dir: str | None = None  # JSONL of every accepted trajectory, one file per version


class RunTimeout(TimeoutError):
    """`WorkflowExecutor.run` waited longer than its timeout (the coroutine was cancelled)."""


def new_episode_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass
class _Job:
    data: dict[str, Any]
    episode_id: str = field(default_factory=new_episode_id)
    # a suspended episode continued: its start version and the journal it replays
    start_version: int | None = None
    replay: EpisodeJournal | None = None


@dataclass(order=True)
class _Done:
    start_version: int
    seq: int
    traj: Trajectory = field(compare=False)
    job: _Job = field(compare=False)


class WorkflowExecutor:
    def __init__(self, engine: InferenceEngine, cfg: RolloutConfig, workflow: RolloutWorkflow,
                 version: PolicyVersion | None = None, accept: AcceptFn | None = None) -> None:
        """`version`: the version the engines serve (read here, never written); None: one of
        its own, for rollouts without a trainer. `accept`: a finished trajectory is trained on
        only if it says so (None: all)."""
        self.engine, self.cfg, self.workflow, self.accept = engine, cfg, workflow, accept
        self.manager = StalenessManager(cfg.max_concurrent_rollouts, cfg.batch_size,
                                        cfg.max_head_offpolicyness)
        self.dump = TrajectoryDump(cfg.dump_dir) if cfg.dump_dir else None
        self.policy_version = version if version is not None else PolicyVersion()
        self.policy_version.subscribe(self._on_new_version)
        self.paused = False
        self.rejections = RejectionLog(log)
        self._cond = threading.Condition()
        self._pending: deque[_Job] = deque()
        self._resumed: deque[_Job] = deque()  # suspended episodes to continue (already admitted)
        self._done: list[_Done] = []
        self._suspending = False
        self._suspended: list[SuspendedEpisode] = []
        self._snapshot: RolloutSnapshot | None = None  # what `suspend` took out
        self.restored: dict[str, str] = {}  # episode id -> outcome, for the last `restore`
        self.counts: Counter[str] = Counter()  # suspended, restarted, replayed/continued calls
        self._seq = itertools.count()
        self._closed = False
        self._loop = asyncio.new_event_loop()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task] = set()
        self._idle_since: float | None = time.monotonic()  # None while an episode runs
        self._idle_total = 0.0  # seconds with no episode running (the engines had no rollout)
        self._idle_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop.run_forever, name="asyncrl-rollout",
                                        daemon=True)
        self._thread.start()
        self._scheduler_task = asyncio.run_coroutine_threadsafe(self._scheduler(), self._loop)

    # ---- trainer-facing API ---------------------------------------------------------------

    def submit(self, data: dict[str, Any]) -> None:
        with self._cond:
            self._pending.append(_Job(data))
        self._kick()

    def wait(self, count: int, timeout: float | None = None) -> list[Trajectory]:
        """Block until `count` trajectories within the staleness bound are ready; oldest first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                self._drop_stale()
                if len(self._done) >= count:
                    return [self._consume(heapq.heappop(self._done)) for _ in range(count)]
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"wait(count={count}) timed out after {timeout}s with "
                                       f"{len(self._done)} ready; stats: {self.stats()}")
                self._cond.wait(left if left is not None else 1.0)

    def prepare_batch(self, data: Iterator[dict[str, Any]],
                      timeout: float | None = None) -> list[Trajectory]:
        """Return `batch_size` trajectories, keeping enough episodes queued that the engines
        stay busy across training steps (the next batch is already generating on return)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # Top up before checking readiness: the queue must hold enough prompts for every
            # slot that frees up while the trainer is busy, or the engines idle until the next
            # call (benchmarks/async_sim.py measured 1.86x -> 2.20x at 8 devices from this).
            with self._cond:
                want = (self.cfg.max_concurrent_rollouts - len(self._pending)
                        - len(self._resumed) - self.manager.stats.running)
            for _ in range(max(0, want)):
                self.submit(next(data))
            with self._cond:
                self._drop_stale()
                if len(self._done) >= self.cfg.batch_size:
                    break
                self._cond.wait(0.05)
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"prepare_batch timed out after {timeout}s; {self.stats()}")
        return self.wait(self.cfg.batch_size)

    @property
    def version(self) -> int:
        return self.policy_version.value

    def _on_new_version(self, version: int) -> None:
        with self._cond:
            self._cond.notify_all()  # ready trajectories may have become too stale
        self._kick()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps, while suspended: the staleness counters (see
        StalenessManager.state_dict) and the episodes `suspend` took out."""
        if self._snapshot is None:
            raise RuntimeError("WorkflowExecutor.state_dict needs the episodes in flight: "
                               "call suspend() first")
        with self._cond:
            return {"staleness": self.manager.state_dict(), "in_flight": self._snapshot.counts(),
                    "episodes": self._snapshot}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Before the first rollout: the counters, then the episodes, which continue from the
        tokens they had."""
        with self._cond:
            self.manager.load_state_dict(state["staleness"])
        self.restore(state["episodes"])

    def pause(self) -> None:
        """Start no new episodes (running ones continue; the engine's pause interrupts them)."""
        with self._cond:
            self.paused = True

    def resume(self) -> None:
        with self._cond:
            self.paused = False
        self._kick()

    # ---- checkpointing the episodes in flight ---------------------------------------------

    def suspend(self, interrupt: Callable[[], None], timeout: float = 60.0) -> RolloutSnapshot:
        """Stop every episode and take out everything held, for a checkpoint (kept for
        `state_dict` until `restore`).

        `interrupt()` makes the engines return every generation in flight with its partial
        output (rollout_engines.RolloutEngines.interrupt). Episodes are then unwound with
        `EpisodeSuspended` and their journals kept; one that does not end within `timeout` (an
        agent waiting on something else) is cancelled and its row queued again, as is one that
        ends with interrupted output it could not keep (an agent through the proxy). The
        executor stays paused and empty until `restore` and `resume`."""
        with self._cond:
            self.paused = self._suspending = True
        try:
            interrupt()
            self.run(self._settle(timeout), timeout=timeout + 30)
            with self._cond:
                snap = RolloutSnapshot(
                    pending=[(j.episode_id, j.data) for j in self._resumed_as_pending()],
                    ready=[ReadyEpisode(d.job.episode_id, d.job.data, d.start_version, d.traj)
                           for d in sorted(self._done)],
                    suspended=self._suspended)
                self._pending, self._done, self._suspended = deque(), [], []
                self.manager.take_out(len(snap.ready))
                self._snapshot = snap
            return snap
        finally:
            with self._cond:
                self._suspending = False

    def restore(self, snap: RolloutSnapshot) -> None:
        """Put `snap` back: ready trajectories are consumed first (or dropped if too stale),
        suspended episodes continue from their journals before new ones start."""
        with self._cond:
            self.restored, self._snapshot = {}, None
            for r in snap.ready:
                job = _Job(r.data, episode_id=r.episode_id)
                heapq.heappush(self._done, _Done(r.start_version, next(self._seq), r.trajectory,
                                                 job))
                self.restored[r.episode_id] = "ready"
            for e in snap.suspended:
                self._resumed.append(_Job(e.data, episode_id=e.episode_id,
                                          start_version=e.start_version, replay=e.journal))
                self.restored[e.episode_id] = "continuing"
            for eid, data in reversed(snap.pending):
                self._pending.appendleft(_Job(data, episode_id=eid))
                self.restored[eid] = "pending"
            self.manager.restore(len(snap.ready) + len(snap.suspended))
            self._cond.notify_all()
        self._kick()

    def _resumed_as_pending(self) -> list[_Job]:
        """Rows not started (caller holds the lock); continuations not started yet go back to
        the suspended episodes with the journals they were to replay."""
        for j in self._resumed:
            self._suspended.append(SuspendedEpisode(j.episode_id, j.data, j.start_version,
                                                    j.replay))
            self.manager.take_out(1)
        self._resumed.clear()
        return list(self._pending)

    async def _settle(self, timeout: float) -> None:
        """Wait until every episode ended and every interrupted call is in its journal."""
        deadline = time.monotonic() + timeout

        def busy() -> bool:
            return bool(self._tasks) or any(e.journal.in_flight for e in self._suspended)

        while busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._tasks:
            log.warning("suspend: %d episodes did not stop within %gs; they are cancelled and "
                        "their rows queued again", len(self._tasks), timeout)
            await self._cancel_episodes()

    async def _cancel_episodes(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run `coro` on the executor's event loop (where the engine clients live) and return
        its result: weight pushes and evaluations use the same connections as rollouts.
        Past `timeout` the coroutine is cancelled and RunTimeout raised."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except TimeoutError:
            if fut.done():  # the coroutine's own TimeoutError
                raise
            fut.cancel()
            raise RunTimeout(f"not done after {timeout}s") from None

    def stats(self) -> dict[str, Any]:
        s = self.manager.stats
        return {"version": self.version, "submitted": s.submitted, "accepted": s.accepted,
                "rejected": s.rejected, "failed": s.failed, "stale_dropped": s.stale_dropped,
                "running": s.running, "pending": len(self._pending) + len(self._resumed),
                "ready": len(self._done), "rejected_in_a_row": self.rejections.consecutive,
                "last_rejection": self.rejections.last_reason, **self.counts,
                "restored": dict(Counter(self.restored.values())),
                "staleness_histogram": dict(sorted(s.staleness_histogram.items()))}

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.policy_version.unsubscribe(self._on_new_version)

        self._loop.call_soon_threadsafe(self._scheduler_task.cancel)
        asyncio.run_coroutine_threadsafe(self._cancel_episodes(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if self.dump is not None:
            self.dump.close()

    def __enter__(self) -> WorkflowExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- executor loop --------------------------------------------------------------------

    def _kick(self) -> None:
        if not self._closed:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _scheduler(self) -> None:
        while not self._closed:
            await self._wake.wait()
            self._wake.clear()
            with self._cond:
                while self._resumed and not self.paused:  # admitted before the suspension
                    job = self._resumed.popleft()
                    self.manager.on_submit(admitted=True)
                    self._start(job, job.start_version)
                while (self._pending and not self.paused
                       and self.manager.capacity(self.version) > 0):
                    self.manager.on_submit()
                    self._start(self._pending.popleft(), self.version)

    def _start(self, job: _Job, start_version: int) -> None:
        task = self._loop.create_task(self._run(job, start_version))
        with self._idle_lock:
            if self._idle_since is not None:
                self._idle_total += time.monotonic() - self._idle_since
                self._idle_since = None
        self._tasks.add(task)
        task.add_done_callback(self._ended)

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not self._tasks:
            with self._idle_lock:
                self._idle_since = time.monotonic()

    @property
    def idle_seconds(self) -> float:
        """Seconds so far in which no episode ran: with one engine, its time without rollouts
        (a synchronous loop's engine idles while the trainer trains)."""
        with self._idle_lock:
            since, total = self._idle_since, self._idle_total
        return total + (time.monotonic() - since if since is not None else 0.0)

    async def _run(self, job: _Job, start_version: int) -> None:
        journal = EpisodeJournal()
        engine = JournaledEngine(self.engine, journal, job.replay, lambda: self._suspending)
        status, traj, kind, reason, error = RolloutStatus.FAILED, None, "", "", None
        try:
            traj = await self.workflow.arun_episode(engine, job.data)
            if traj is None:
                status, kind = RolloutStatus.REJECTED, "returned None"
                reason = f"workflow {type(self.workflow).__name__} returned None (rejected)"
            elif self.accept is not None and not self.accept(traj):
                # the rule names its setting and says why, if it can
                status = RolloutStatus.REJECTED
                kind = getattr(self.accept, "setting", "accept rule")
                explain = getattr(self.accept, "rejection", None)
                reason = explain(traj) if explain is not None else (
                    f"the accept rule {getattr(self.accept, '__qualname__', self.accept)} "
                    f"rejected a trajectory with rewards {sorted(set(traj.rewards))}")
            else:
                status = RolloutStatus.ACCEPTED
        except EpisodeSuspended:
            return self._on_suspended(job, start_version, journal)
        except asyncio.CancelledError:
            if self._suspending:  # cancelled by `suspend`: the row runs again
                self._restart(job)
            raise
        except EpisodeRejected as err:
            status, kind, reason, error = RolloutStatus.REJECTED, "EpisodeRejected", str(err), err
        except Exception as err:  # boundary: a broken episode is recorded and rejected, the run goes on
            kind, error = type(err).__name__, err
            reason = (f"rollout workflow {type(self.workflow).__name__} raised {err!r} on data "
                      f"id={job.data.get('id')}")
        if self._suspending and (status != RolloutStatus.ACCEPTED or any(
                s.stop_reason is StopReason.ABORT for s in traj.samples)):
            return self._restart(job)  # it may have ended because of the interruption
        self.counts["replayed_calls"] += engine.replayed_calls
        self.counts["continued_calls"] += engine.continued_calls
        self._finish(job, start_version, status, traj, kind, reason, error)

    def _finish(self, job: _Job, start_version: int, status: RolloutStatus,
                traj: Trajectory | None, kind: str, reason: str,
                error: BaseException | None) -> None:
        with self._cond:
            if status == RolloutStatus.ACCEPTED:
                self.manager.on_accept()
                self.rejections.accepted()
                traj.metadata.setdefault("start_version", start_version)
                traj.metadata.setdefault("episode_id", job.episode_id)
                heapq.heappush(self._done, _Done(start_version, next(self._seq), traj, job))
                if self.dump is not None:
                    self.dump.write(traj, job.data, start_version)
            else:
                self.manager.on_reject(failed=status == RolloutStatus.FAILED)
                self.rejections.rejected(kind, reason, error)
            self._outcome(job, status.value)
            self._cond.notify_all()
        self._wake.set()

    def _on_suspended(self, job: _Job, start_version: int, journal: EpisodeJournal) -> None:
        with self._cond:
            self.manager.on_suspend()
            self._suspended.append(SuspendedEpisode(job.episode_id, job.data, start_version,
                                                    journal))
            self.counts["suspended"] += 1
            self._outcome(job, "suspended")

    def _restart(self, job: _Job) -> None:
        with self._cond:
            self.manager.on_suspend()
            job.replay = job.start_version = None
            self._pending.appendleft(job)
            self.counts["restarted"] += 1
            self._outcome(job, "restarted")

    def _outcome(self, job: _Job, outcome: str) -> None:
        if job.episode_id in self.restored:
            self.restored[job.episode_id] = outcome

    def _drop_stale(self) -> None:
        """Re-queue the prompts of ready trajectories that got too old (caller holds the lock)."""
        while self._done and self.manager.is_too_stale(self._done[0].start_version, self.version):
            done = heapq.heappop(self._done)
            self.manager.on_stale_drop()
            self._outcome(done.job, "stale_dropped")  # its row runs again as a new episode
            self._pending.appendleft(_Job(done.job.data))
            self._kick()

    def _consume(self, done: _Done) -> Trajectory:
        self.manager.on_consume(done.start_version, self.version)
        self._outcome(done.job, "consumed")
        return done.traj
