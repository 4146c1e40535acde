"""RewardPool mechanics: errors and crashes are counted, async calls overlap, close leaves nothing."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from asyncrl.reward.pool import (
    RewardPool,
    RewardPoolClosed,
    RewardPoolConfig,
    RewardStatus,
)

FAST = RewardPoolConfig(num_workers=2, timeout_seconds=2.0, preload=[])


def constant(value):
    return value


def slow_constant(value, seconds):
    time.sleep(seconds)
    return value


def raises():
    raise KeyError("missing field")


def exits():
    os._exit(7)


def test_errors_crashes_and_bad_values_score_zero_and_are_counted(caplog):
    with RewardPool(FAST) as pool, caplog.at_level(logging.ERROR, "asyncrl.reward.pool"):
        assert pool.score_sync(constant, 0.25).score == 0.25
        error = pool.score_sync(raises)
        assert (error.status, error.score) == (RewardStatus.ERROR, 0.0)
        assert "KeyError: 'missing field'" in error.error
        assert "KeyError: 'missing field'" in caplog.text  # the traceback reaches the log
        for bad in ("0.5", float("nan"), None, True):
            assert pool.score_sync(constant, bad).status is RewardStatus.ERROR
        crash = pool.score_sync(exits)
        assert (crash.status, crash.score) == (RewardStatus.CRASHED, 0.0)
        assert "exit code 7" in crash.error
        assert pool.score_sync(constant, 1).score == 1.0  # the replacement works
        stats = pool.stats()
    assert (stats.calls, stats.errors, stats.crashes, stats.timeouts) == (8, 5, 1, 0)
    assert stats.worker_restarts == 1 and stats.mean_latency_seconds > 0


def test_unpicklable_call_raises_to_the_caller():
    with RewardPool(FAST) as pool:
        with pytest.raises(Exception, match="pickle"):
            pool.score_sync(lambda: 1.0)
        assert pool.score_sync(constant, 1.0).score == 1.0  # the worker went back to the pool


def test_async_calls_run_in_parallel_without_blocking_the_loop():
    async def main(pool):
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        tick_task = asyncio.create_task(ticker())
        start = time.monotonic()
        outcomes = await asyncio.gather(*(pool.score(slow_constant, i, 1.0) for i in range(2)))
        elapsed = time.monotonic() - start
        tick_task.cancel()
        return outcomes, elapsed, ticks

    with RewardPool(FAST.model_copy(update={"timeout_seconds": 10.0})) as pool:
        outcomes, elapsed, ticks = asyncio.run(main(pool))
    assert [o.score for o in outcomes] == [0, 1]
    assert elapsed < 1.9  # serial would take >= 2.0 s: the two one-second calls overlapped
    assert ticks >= 5  # the event loop kept running meanwhile


def pid_after(seconds):
    time.sleep(seconds)
    return os.getpid()


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just not yet reaped


def test_close_stops_every_worker_and_later_calls_fail():
    pool = RewardPool(FAST)

    async def both_worker_pids():
        outcomes = await asyncio.gather(*(pool.score(pid_after, 0.3) for _ in range(2)))
        return {int(o.score) for o in outcomes}

    pids = asyncio.run(both_worker_pids())
    assert len(pids) == 2 and all(running(pid) for pid in pids)
    pool.close()
    pool.close()  # idempotent
    assert not [pid for pid in pids if running(pid)]
    with pytest.raises(RewardPoolClosed):
        pool.score_sync(constant, 1.0)


def test_worker_killed_while_idle_is_replaced():
    with RewardPool(FAST.model_copy(update={"num_workers": 1})) as pool:
        pid = int(pool.score_sync(pid_after, 0.0).score)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30.0  # dead before the next call, as a crash would be
        while running(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.score_sync(constant, 1.0).score == 1.0
        assert pool.stats().worker_restarts == 1


def test_close_kills_a_busy_worker_and_fails_its_call():
    pool = RewardPool(FAST.model_copy(update={"num_workers": 1, "timeout_seconds": 30.0}))
    results = []

    def call():
        try:
            results.append(pool.score_sync(slow_constant, 1.0, 20.0))
        except RewardPoolClosed as err:
            results.append(err)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)
    start = time.monotonic()
    pool.close()
    thread.join(5.0)
    assert time.monotonic() - start < 3.0
    assert len(results) == 1 and isinstance(results[0], RewardPoolClosed)


def test_spawn_start_method_works_too():
    with RewardPool(FAST.model_copy(update={"num_workers": 1, "start_method": "spawn"})) as pool:
        assert pool.score_sync(constant, 0.5).score == 0.5


def test_worker_that_fails_to_start_raises():
    with pytest.raises(RuntimeError, match="no_such_module_xyz"):
        RewardPool(FAST.model_copy(update={"preload": ["no_such_module_xyz"]}))


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="num_workers"):
        RewardPoolConfig.from_dict({"num_workers": 0})
    with pytest.raises(ValueError, match="start_method"):
        RewardPoolConfig.from_dict({"start_method": "fork"})
