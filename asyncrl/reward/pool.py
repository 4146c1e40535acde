"""A process pool for reward functions that may hang, crash or need a main thread.

Why not multiprocessing.Pool or concurrent.futures: neither can kill one hung task and carry on.
Why not pebble, which can: a worker killed from outside while it holds pebble's shared task-queue
lock stalls the whole pool (pebble issue #163): 2 of 10 kills did, for over 30 s, none of ours
(`benchmarks/bench_reward_pool.py`, which also measures the per-call cost of both).
Here each call goes to an idle worker process; when it has not answered within timeout_seconds
the worker's whole process group is SIGKILLed (a sandbox it started goes with it) and a fresh
worker is started in the background, so the caller gets score 0.0 right at the timeout. A reward
function that raises is scored 0.0 too, counted, and its traceback logged: this pool is the
boundary where reward errors are recorded, so the functions themselves should let errors raise.
The pool's timeout is the outer bound; a code sandbox that stops a program at its own, shorter
limit returns an ordinary 0.0 without costing a worker restart.

Workers run each reward in their main thread, which math_verify's SIGALRM timeouts need, and are
started with "forkserver" (or "spawn"), never "fork": the trainer has threads, and a forked copy
of a threaded process can deadlock on a lock some other thread held.

`await pool.score(fn, *args)` for rollout workflows (the blocking wait runs in a thread, not the
event loop); `pool.score_sync(fn, *args)` elsewhere. `fn` and its arguments must pickle
(module-level functions, plain data).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import enum
import functools
import importlib
import logging
import math
import multiprocessing
import numbers
import os
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import pydantic

from asyncrl.config import Config
from asyncrl.reward.sandbox import remove_workdirs_of

logger = logging.getLogger(__name__)

READY = "ready"
PR_SET_PDEATHSIG = 1
RESTART_ATTEMPTS = 3
IDLE_POLL_SECONDS = 0.2
CLOSE_TIMEOUT_SECONDS = 10.0


class RewardStatus(enum.Enum):
    OK = "ok"
    TIMEOUT = "timeout"  # no answer within timeout_seconds; the worker was killed and replaced
    ERROR = "error"  # the reward function raised; traceback in `error` and in the log
    CRASHED = "crashed"  # the worker process died mid-call (segfault, os._exit, OOM kill)


@dataclass(frozen=True)
class RewardOutcome:
    score: float
    status: RewardStatus
    latency_seconds: float  # from the call to the answer, waiting for a free worker included
    error: str | None = None
    # What the function said about an OK score, when it returned (score, note): e.g. the code
    # reward's "test 2: timeout", so a sandbox limit is told apart from a wrong answer.
    note: str | None = None


@dataclass(frozen=True)
class RewardPoolStats:
    calls: int
    timeouts: int
    errors: int
    crashes: int
    worker_restarts: int
    mean_latency_seconds: float


class RewardPoolConfig(Config):
    num_workers: int = pydantic.Field(default=2, ge=1, le=1024)
    timeout_seconds: float = pydantic.Field(default=10.0, gt=0, le=86400)
    start_method: Literal["forkserver", "spawn"] = "forkserver"
    # Imported by every worker before it takes calls, so a fresh worker's first call does not
    # spend its timeout importing sympy.
    preload: list[str] = ["asyncrl.reward.math_verify", "asyncrl.reward.code"]
    startup_timeout_seconds: float = pydantic.Field(default=60.0, gt=0)


class RewardPoolClosed(RuntimeError):
    """The pool was closed before or during the call."""


@dataclass(eq=False)
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Any  # multiprocessing.connection.Connection


class RewardPool:
    """A process pool that runs reward functions which may hang, crash or need a main thread.

    Each call runs in an idle worker process; a call that does not answer within
    `config.timeout_seconds` has its worker's process group killed and scores 0.0, and a
    replacement worker starts in the background. A function that raises or crashes its worker
    scores 0.0 too, counted and logged. Use it as a context manager, or call `close`.

    Args:
        config: worker count, timeout, start method and modules to preload (None: defaults).

    Raises:
        RuntimeError: a worker did not start within `config.startup_timeout_seconds` or failed
            to import a `config.preload` module.
    """

    def __init__(self, config: RewardPoolConfig | None = None):
        self.config = config or RewardPoolConfig()
        self._context = multiprocessing.get_context(self.config.start_method)
        self._lock = threading.Lock()
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._workers: set[_Worker] = set()
        self._replacers: set[threading.Thread] = set()
        self._closed = False
        self._broken: str | None = None
        self._counts = {"calls": 0, "timeouts": 0, "errors": 0, "crashes": 0, "worker_restarts": 0}
        self._latency_total = 0.0
        self._executor = ThreadPoolExecutor(self.config.num_workers, "reward-pool")
        atexit.register(self.close)
        started: list[_Worker] = []
        try:
            for _ in range(self.config.num_workers):
                started.append(self._spawn())  # all start at once, then we wait for each
            for worker in started:
                self._await_ready(worker)
        except BaseException:
            for worker in started:
                self._kill(worker)
            self.close()
            raise
        for worker in started:
            self._idle.put(worker)

    # -- calls -----------------------------------------------------------------------------

    async def score(self, fn: Callable[..., float], *args: Any, **kwargs: Any) -> RewardOutcome:
        """`score_sync` without blocking the event loop (the wait runs in a thread): the same
        arguments, outcome and errors."""
        if self._closed:
            raise RewardPoolClosed("RewardPool is closed")
        call = functools.partial(self.score_sync, fn, *args, **kwargs)
        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def score_sync(self, fn: Callable[..., float], *args: Any, **kwargs: Any) -> RewardOutcome:
        """Scores `fn(*args, **kwargs)` in a worker, blocking until it answers or times out.

        Waits for an idle worker first. A timeout, an exception in `fn`, a result that is not a
        finite float, or a crashed worker scores 0.0 with the matching status; none raises.

        Args:
            fn: the reward function; it and its arguments must pickle (a module-level function,
                plain data). It returns a float, or a (float, note) pair.
            *args: positional arguments for `fn`.
            **kwargs: keyword arguments for `fn`.

        Returns:
            The outcome: score, status (ok, timeout, error, crashed), latency and any error.

        Raises:
            RewardPoolClosed: the pool was closed before or during the call.
            RuntimeError: the pool can no longer start workers (restarts failed).
            pickle.PicklingError, AttributeError, TypeError: `fn` or its arguments do not
                pickle (raised as pickle raises it).
        """
        start = time.monotonic()
        while True:
            worker = self._acquire()
            try:
                worker.conn.send((fn, args, kwargs))
                break
            except OSError:  # it died while idle (OOM killer, someone's kill): use another
                self._retire(worker)
            except BaseException:  # an unpicklable call is the caller's bug: raise it
                self._idle.put(worker)
                raise
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            answered = worker.conn.poll(self.config.timeout_seconds)
        except OSError:  # close() closed the connection under us
            raise RewardPoolClosed("RewardPool closed during the call") from None
        if not answered:
            self._retire(worker)
            logger.warning("reward %s took over %.1fs: worker %d killed, scored 0.0",
                           name, self.config.timeout_seconds, worker.process.pid)
            return self._finish(start, "timeouts", RewardStatus.TIMEOUT, None)
        try:
            ok, payload = worker.conn.recv()
        except (EOFError, OSError):
            self._retire(worker)
            if self._closed:
                raise RewardPoolClosed("RewardPool closed during the call") from None
            message = f"worker {worker.process.pid} died (exit code {worker.process.exitcode})"
            logger.error("reward %s crashed its worker: %s; scored 0.0", name, message)
            return self._finish(start, "crashes", RewardStatus.CRASHED, message)
        self._idle.put(worker)
        if not ok:
            logger.error("reward %s raised; scored 0.0\n%s", name, payload)
            return self._finish(start, "errors", RewardStatus.ERROR, payload)
        score, note = payload
        return self._finish(start, None, RewardStatus.OK, None, score, note)

    def stats(self) -> RewardPoolStats:
        """Returns the counts since the pool started: calls, timeouts, errors, crashes, worker
        restarts, and the mean latency of a call in seconds (0.0 before the first)."""
        with self._lock:
            calls = self._counts["calls"]
            mean = self._latency_total / calls if calls else 0.0
            return RewardPoolStats(**self._counts, mean_latency_seconds=mean)

    def _finish(self, start, counter, status, error, score=0.0, note=None) -> RewardOutcome:
        latency = time.monotonic() - start
        with self._lock:
            self._counts["calls"] += 1
            if counter:
                self._counts[counter] += 1
            self._latency_total += latency
        return RewardOutcome(score, status, latency, error, note)

    def _acquire(self) -> _Worker:
        while True:
            if self._closed:
                raise RewardPoolClosed("RewardPool is closed")
            if self._broken:
                raise RuntimeError(f"RewardPool cannot start workers: {self._broken}")
            try:
                return self._idle.get(timeout=IDLE_POLL_SECONDS)
            except queue.Empty:
                continue

    # -- worker lifecycle ------------------------------------------------------------------

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = self._context.Pipe()
        die_with_parent = self.config.start_method == "forkserver"
        process = self._context.Process(
            target=_worker_main, args=(child_conn, list(self.config.preload), die_with_parent),
            name="asyncrl-reward-worker", daemon=True,
        )
        process.start()
        child_conn.close()
        worker = _Worker(process, parent_conn)
        with self._lock:
            self._workers.add(worker)
        return worker

    def _await_ready(self, worker: _Worker) -> None:
        message = None
        if worker.conn.poll(self.config.startup_timeout_seconds):
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                message = None
        if message != READY:
            detail = message[1] if isinstance(message, tuple) else "no ready message"
            raise RuntimeError(f"reward worker failed to start: {detail}")

    # Each worker has one owner at a time: the idle queue, the thread running a call on it, or
    # the thread starting it. Only the owner touches its connection or reaps it; close() merely
    # SIGKILLs busy workers and lets their owners retire them.

    def _kill(self, worker: _Worker, grace: float = 0.0) -> None:
        """Stop a worker we own (asking first when `grace` > 0) and forget it.

        SIGKILL goes to its process group, which includes any sandbox it started (it called setsid).
        """
        if grace > 0:
            try:
                worker.conn.send(None)
                worker.process.join(grace)
            except OSError:
                pass
        _kill_group(worker)
        worker.process.join()
        worker.conn.close()
        remove_workdirs_of(worker.process.pid)  # a sandbox it was running leaves no directory
        with self._lock:
            self._workers.discard(worker)

    def _retire(self, worker: _Worker) -> None:
        """Kill a worker that hung or died and start its replacement in the background."""
        self._kill(worker)
        with self._lock:
            if self._closed:
                return
            self._counts["worker_restarts"] += 1
            thread = threading.Thread(target=self._replace, name="reward-pool-restart", daemon=True)
            self._replacers.add(thread)
            thread.start()  # under the lock, so close() never sees it registered but unstarted

    def _replace(self) -> None:
        try:
            for attempt in range(1, RESTART_ATTEMPTS + 1):
                worker = None
                try:
                    worker = self._spawn()
                    self._await_ready(worker)
                except Exception:  # recorded: logged here, and _broken fails later calls loudly
                    if worker is not None:
                        self._kill(worker)
                    logger.exception("reward worker restart %d/%d failed",
                                     attempt, RESTART_ATTEMPTS)
                    continue
                if self._closed:
                    self._kill(worker)
                else:
                    self._idle.put(worker)
                return
            self._broken = f"{RESTART_ATTEMPTS} restarts in a row failed (see the log)"
        finally:
            with self._lock:
                self._replacers.discard(threading.current_thread())

    def close(self) -> None:
        """Stop every worker (idle ones politely, busy ones with SIGKILL); idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            replacers = list(self._replacers)
        atexit.unregister(self.close)
        for thread in replacers:
            thread.join(self.config.startup_timeout_seconds)
        deadline = time.monotonic() + CLOSE_TIMEOUT_SECONDS
        while True:
            # Busy workers come back to the queue after a call, or vanish when their owner
            # retires them; loop until neither kind is left.
            while not self._idle.empty():
                self._kill(self._idle.get_nowait(), grace=1.0)
            with self._lock:
                busy = list(self._workers)
            if not busy or time.monotonic() > deadline:
                break
            for worker in busy:
                _kill_group(worker)
            time.sleep(0.02)
        if busy:
            logger.error("RewardPool.close: workers %s still registered after %.0fs",
                         [w.process.pid for w in busy], CLOSE_TIMEOUT_SECONDS)
        self._executor.shutdown(wait=True)

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _kill_group(worker: _Worker) -> None:
    # Signals only, no reaping: safe from any thread, and a no-op on a worker already gone.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker.process.pid, signal.SIGKILL)


def _worker_main(conn: Any, preload: list[str], die_with_parent: bool) -> None:
    # Own process group: the pool kills the group, which includes any sandbox we started.
    os.setsid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    if die_with_parent:
        # The parent is the long-lived forkserver, which exits when the trainer does.
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        for module in preload:
            importlib.import_module(module)
    except Exception:  # reported to the pool, which raises it
        conn.send((False, traceback.format_exc()))
        return
    conn.send(READY)
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        except Exception:  # e.g. the function's module does not import here: the call's error
            conn.send((False, traceback.format_exc()))
            continue
        if message is None:
            return
        fn, args, kwargs = message
        try:
            reply = (True, _scored(fn(*args, **kwargs)))
        except Exception:  # the pool logs and counts it
            reply = (False, traceback.format_exc())
        conn.send(reply)


def _scored(value: Any) -> tuple[float, str | None]:
    """A function's result as (score, note): a float, or a (float, str) pair."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], str):
        return _as_score(value[0]), value[1]
    return _as_score(value), None


def _as_score(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"reward returned {type(value).__name__} {value!r}; expected a float")
    if not math.isfinite(value):
        raise ValueError(f"reward returned {value!r}; expected a finite float")
    return float(value)
