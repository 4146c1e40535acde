"""A run that cannot make progress stops and says why; no wait is unbounded (issue 16, item 4).

Real training loops on the tiny model with the in-process engine; the workflows are broken on
purpose (always raising, always uniform rewards, never finishing).
"""

import asyncio
import logging
import time

import pytest
from test_train_loop import small_config

from asyncrl import Trainer
from asyncrl.launch.train_loop import bounded
from asyncrl.launch.watchdog import NoProgressError, WaitTimeoutError
from asyncrl.rollout.executor import RolloutConfig, WorkflowExecutor

pytestmark = pytest.mark.usefixtures("one_thread")


class AlwaysRaises:
    async def arun_episode(self, engine, data):
        raise ValueError("the tool server refused the connection")


class NeverFinishes:
    async def arun_episode(self, engine, data):
        await asyncio.sleep(3600)


def zero_reward(completion, row):
    return 0.0


def test_a_workflow_that_always_raises_stops_the_run_with_the_reason(model_dir, tmp_path,
                                                                       caplog):
    cfg = small_config(model_dir, tmp_path / "run", **{"watchdog.max_rejected_in_a_row": 300,
                                                       "eval.every": 0})
    t0 = time.perf_counter()
    with caplog.at_level(logging.WARNING), pytest.raises(NoProgressError) as err:
        Trainer(cfg).train(workflow=AlwaysRaises())
    assert time.perf_counter() - t0 < 60
    msg = str(err.value)
    in_a_row = int(msg.split("no batch can be formed: ")[1].split(" episodes in a row")[0])
    assert in_a_row >= 300, msg  # checked while waiting for the batch, so a few more ran
    assert "watchdog.max_rejected_in_a_row=300" in msg
    assert "the tool server refused the connection" in msg  # a sample reason
    # one warning with the traceback for the first, not one per episode (was 1.3 M lines)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) <= 5, [r.getMessage()[:100] for r in warnings]


def test_groups_that_are_all_uniform_stop_the_run(model_dir, tmp_path):
    cfg = small_config(model_dir, tmp_path / "run", filter_uniform_groups=True,
                       **{"watchdog.max_rejected_in_a_row": 40, "eval.every": 0})
    with pytest.raises(NoProgressError, match=r"\d+ episodes in a row.*max_rejected_in_a_row"
                                              r"=40.*filter_uniform_groups dropped a group "
                                              r"whose 4 rewards were all 0"):
        Trainer(cfg).train(reward=zero_reward)


def test_max_train_seconds_counts_the_time_spent_waiting(model_dir, tmp_path):
    cfg = small_config(model_dir, tmp_path / "run", max_train_seconds=2.0, total_steps=1000,
                       **{"eval.every": 0})
    t0 = time.perf_counter()
    result = Trainer(cfg).train(workflow=NeverFinishes())
    assert result.stopped_by == "max_train_seconds" and result.steps == 0
    assert time.perf_counter() - t0 < 30


def test_no_step_within_the_deadline_stops_the_run(model_dir, tmp_path):
    cfg = small_config(model_dir, tmp_path / "run", **{"watchdog.step_deadline_s": 1.5,
                                                       "eval.every": 0})
    with pytest.raises(NoProgressError, match=r"no training step for \d+s after step 0 "
                                              r"\(watchdog.step_deadline_s=1.5\)"):
        Trainer(cfg).train(workflow=NeverFinishes())


def test_a_wait_past_its_limit_is_cancelled_with_an_error_naming_it():
    with WorkflowExecutor(None, RolloutConfig(), None) as ex:
        cancelled = []

        async def hangs():
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.append(True)
                raise

        with pytest.raises(WaitTimeoutError, match=r"the weight push to version 3 did not "
                                                   r"finish within 0.2s \(watchdog.sync_timeout_s"):
            bounded(ex, hangs(), 0.2, "the weight push to version 3", "watchdog.sync_timeout_s")
        deadline = time.monotonic() + 30.0  # the cancel runs on the executor's loop thread
        while not cancelled and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cancelled == [True]
