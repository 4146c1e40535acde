"""Workflow executor under the staleness bound, with a fake slow engine (no model needed)."""

import asyncio
import json
import logging
import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.api import ModelRequest, ModelResponse, PolicyVersion, Sample, StopReason, Trajectory
from asyncrl.rollout.executor import RolloutConfig, WorkflowExecutor
from asyncrl.rollout.staleness import StalenessManager
from conftest import run_episodes


class SlowEngine:
    """Answers after a random (long-tailed) delay; tracks how many requests are in flight."""

    def __init__(self, seed=0, mean=0.02):
        self.version, self.rng, self.mean = 0, random.Random(seed), mean
        self.inflight, self.busy_time, self._lock = 0, 0.0, threading.Lock()
        self._since = time.monotonic()

    def _account(self, delta):
        with self._lock:
            now = time.monotonic()
            if self.inflight:
                self.busy_time += now - self._since
            self._since, self.inflight = now, self.inflight + delta

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self._account(+1)
        try:
            await asyncio.sleep(self.rng.expovariate(1 / self.mean))
        finally:
            self._account(-1)
        return ModelResponse(req.input_ids, [7], [-0.5], [self.version], StopReason.STOP)

    def get_version(self):
        return self.version

    def pause(self):
        pass

    def resume(self):
        pass

    async def update_weights(self, meta):
        self.version = meta.version


class OneShot:
    async def arun_episode(self, engine, data):
        resp = await engine.agenerate(ModelRequest(input_ids=[1, 2]))
        s = Sample.from_prompt_and_completion(resp.input_tokens, resp.output_tokens,
                                              resp.output_logprobs, resp.output_versions,
                                              reward=float(data.get("reward", 1.0)))
        return Trajectory([s], group_id=str(data["id"]))


class Exploding:
    async def arun_episode(self, engine, data):
        if data["id"] % 3 == 0:
            raise ZeroDivisionError("user bug in workflow")
        return await OneShot().arun_episode(engine, data)


def rows():
    i = 0
    while True:
        yield {"id": i}
        i += 1


def train_loop(eta, steps=12, batch=8, train_seconds=0.03, seed=0, gen_mean=0.02):
    """Returns (lags, share of training time the engine was generating, wall seconds, stats)."""
    engine = SlowEngine(seed, mean=gen_mean)
    cfg = RolloutConfig(batch_size=batch, max_concurrent_rollouts=32, max_head_offpolicyness=eta)
    lags, busy_samples, t0 = [], [], time.monotonic()
    policy = PolicyVersion()
    with WorkflowExecutor(engine, cfg, OneShot(), policy) as ex:
        data = rows()
        for version in range(steps):
            batch_trajs = ex.prepare_batch(data, timeout=60)
            assert len(batch_trajs) == batch
            lags += [version - t.metadata["start_version"] for t in batch_trajs]
            end = time.monotonic() + train_seconds  # the trainer's update
            while time.monotonic() < end:
                busy_samples.append(engine.inflight > 0)
                time.sleep(0.002)
            ex.pause()
            engine.version = version + 1
            policy.advance()  # the trainer owns the version; the executor follows it
            ex.resume()
        stats = ex.stats()
    return lags, sum(busy_samples) / len(busy_samples), time.monotonic() - t0, stats


@pytest.mark.parametrize("eta", [0, 1, 4])
def test_staleness_bound_holds_with_a_slow_engine(eta):
    lags, _, _, stats = train_loop(eta)
    assert max(lags) <= eta and min(lags) >= 0
    assert sum(stats["staleness_histogram"].values()) == len(lags)
    assert stats["failed"] == 0


def test_async_keeps_the_engine_generating_while_the_trainer_trains():
    # Generation is the bottleneck (as in real RL): a batch takes longer than an update.
    _, busy_sync, wall_sync, _ = train_loop(0, train_seconds=0.05, gen_mean=0.06)
    _, busy_async, wall_async, stats = train_loop(4, train_seconds=0.05, gen_mean=0.06)
    # idle here: sync 0%, eta=4 100%; the bounds leave room for a busy machine's scheduling
    assert busy_sync < 0.3, busy_sync  # synchronous: the engine idles during every update
    assert busy_async > 0.6, busy_async
    assert wall_async < wall_sync
    assert max(stats["staleness_histogram"]) >= 1  # it did train on off-policy data
    print(f"engine busy during training: sync {busy_sync:.0%}, eta=4 {busy_async:.0%}; "
          f"wall time for 12 steps: sync {wall_sync:.2f}s, eta=4 {wall_async:.2f}s")


def test_failing_workflow_is_rejected_and_logged_not_fatal(caplog):
    cfg = RolloutConfig(batch_size=9, max_concurrent_rollouts=8)
    with caplog.at_level(logging.WARNING), WorkflowExecutor(SlowEngine(), cfg, Exploding()) as ex:
        out = run_episodes(ex, [{"id": i} for i in range(9)])
        assert len(out) == 6
        assert ex.stats()["failed"] == 3 and ex.stats()["accepted"] == 6
    assert "ZeroDivisionError" in caplog.text and "data id=" in caplog.text
    assert caplog.text.count("Traceback") == 1  # the first of its kind in full, the rest counted


def test_accept_filter_drops_groups_and_prepare_batch_refills():
    cfg = RolloutConfig(batch_size=5, max_concurrent_rollouts=8)
    data = ({"id": i, "reward": i % 2} for i in range(1000))
    with WorkflowExecutor(SlowEngine(), cfg, OneShot(), accept=lambda t: t.rewards[0] > 0) as ex:
        got = ex.prepare_batch(data, timeout=30)
        assert len(got) == 5 and all(t.rewards == [1.0] for t in got)
        assert ex.stats()["rejected"] >= 4


def test_pause_starts_nothing_new_until_resume():
    engine = SlowEngine()
    with WorkflowExecutor(engine, RolloutConfig(batch_size=4, max_concurrent_rollouts=8),
                          OneShot()) as ex:
        ex.pause()
        for i in range(4):
            ex.submit({"id": i})
        time.sleep(0.2)
        assert ex.stats()["submitted"] == 0 and ex.stats()["pending"] == 4
        ex.resume()
        assert len(ex.wait(4, timeout=10)) == 4


def test_wait_times_out_with_stats():
    with WorkflowExecutor(SlowEngine(), RolloutConfig(batch_size=2), OneShot()) as ex:
        with pytest.raises(TimeoutError, match="ready"):
            ex.wait(1, timeout=0.2)


def test_trajectory_dump(tmp_path):
    cfg = RolloutConfig(batch_size=2, dump_dir=str(tmp_path / "dump"))
    with WorkflowExecutor(SlowEngine(), cfg, OneShot()) as ex:
        run_episodes(ex, [{"id": 1, "answer": "3"}, {"id": 2, "answer": "4"}])
    lines = (tmp_path / "dump" / "v000000.jsonl").read_text().splitlines()
    recs = sorted((json.loads(x) for x in lines), key=lambda r: r["id"])
    assert [r["answer"] for r in recs] == ["3", "4"]
    assert recs[0]["start_version"] == 0 and recs[0]["input_ids"] == [1, 2, 7]


@settings(max_examples=200, deadline=None)
@given(eta=st.integers(0, 4), batch=st.integers(1, 6), max_conc=st.integers(1, 24),
       seed=st.integers(0, 10**6))
def test_property_no_trajectory_older_than_eta_is_trained(eta, batch, max_conc, seed):
    """Discrete simulation with adversarial (random) completion order, using the manager's rules
    the way the executor does: start up to capacity, finish a random running episode, consume the
    oldest-started ready ones, re-queue any that became too stale."""
    rng = random.Random(seed)
    m = StalenessManager(max_conc, batch, eta)
    version, running, ready, trained = 0, [], [], 0
    for _ in range(400):
        for _ in range(m.capacity(version)):
            m.on_submit()
            running.append(version)
        if running:
            start = running.pop(rng.randrange(len(running)))
            m.on_accept()
            ready.append(start)
        ready.sort()
        while ready and m.is_too_stale(ready[0], version):
            ready.pop(0)
            m.on_stale_drop()
        if len(ready) >= batch:
            for start in ready[:batch]:
                assert version - start <= eta
                m.on_consume(start, version)
            del ready[:batch]
            version += 1
            trained += batch
    assert trained > 0
    assert m.stats.running == len(running) >= 0


def test_trajectory_dump_bounds_open_files(tmp_path):
    from asyncrl.api import Sample, Trajectory
    from asyncrl.rollout.trajectory_dump import TrajectoryDump

    dump = TrajectoryDump(str(tmp_path / "d"), max_open=2)
    traj = Trajectory([Sample.from_prompt_and_completion([1], [2], [0.0], [0], reward=1.0)])
    for version in (0, 1, 2, 0, 3):  # version 0 comes back after its file was closed
        dump.write(traj, {"id": version}, version)
        assert len(dump._files) <= 2
    dump.close()
    lines = (tmp_path / "d" / "v000000.jsonl").read_text().splitlines()
    assert len(lines) == 2  # appended, not truncated, when reopened
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
        "v000000.jsonl", "v000001.jsonl", "v000002.jsonl", "v000003.jsonl"]


def _drive(manager: StalenessManager, versions: range, rng: random.Random) -> list[int]:
    """A run in miniature: at each version start what capacity allows, finish everything in a
    random order (some rejected), consume one batch; returns the capacity seen at each version.
    Nothing is left running at the end of a version, as at a checkpoint after a drained step."""
    seen = []
    for v in versions:
        started = manager.capacity(v)
        seen.append(started)
        for _ in range(started):
            manager.on_submit()
        ready = 0
        for _ in range(started):
            if rng.random() < 0.2:
                manager.on_reject()
            else:
                manager.on_accept()
                ready += 1
        for _ in range(min(manager.batch_size, ready)):
            manager.on_consume(v, v)
        for _ in range(ready - min(manager.batch_size, ready)):
            manager.on_stale_drop()  # what is not consumed is dropped before the checkpoint
    return seen


@pytest.mark.parametrize("eta", [0, 2, 4])
def test_resumed_staleness_budget_admits_what_an_uninterrupted_run_would(eta):
    straight = StalenessManager(max_concurrent=1000, batch_size=4, eta=eta)
    want = _drive(straight, range(10), random.Random(7))

    first = StalenessManager(max_concurrent=1000, batch_size=4, eta=eta)
    got = _drive(first, range(5), random.Random(7))
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint holds
    resumed = StalenessManager(max_concurrent=1000, batch_size=4, eta=eta)
    resumed.load_state_dict(state)
    rng = random.Random(7)
    _drive(StalenessManager(1000, 4, eta), range(5), rng)  # the same random stream position
    got += _drive(resumed, range(5, 10), rng)
    assert got == want
    assert resumed.stats == straight.stats
    # Without the restore the budget restarts at 0 while the version is 5: far more admitted.
    fresh = StalenessManager(max_concurrent=1000, batch_size=4, eta=eta)
    assert fresh.capacity(5) > resumed.capacity(5)


class Gated:
    """An episode that runs until the test opens its gate (a state, not a delay)."""

    def __init__(self):
        self.gate, self.started = None, threading.Event()

    async def arun_episode(self, engine, data):
        self.gate = asyncio.Event()
        self.started.set()
        await self.gate.wait()
        s = Sample.from_prompt_and_completion([1], [7], [-0.5], [0], reward=1.0)
        return Trajectory(samples=[s])


def test_idle_seconds_count_only_the_time_without_a_running_episode():
    wf = Gated()
    with WorkflowExecutor(SlowEngine(), RolloutConfig(batch_size=1), wf) as ex:
        before = ex.idle_seconds
        assert ex.idle_seconds > before  # nothing runs: idle time grows (ns clock)
        ex.submit({"id": 0})
        assert wf.started.wait(10)
        frozen = ex.idle_seconds
        assert ex.idle_seconds == frozen  # an episode runs: the engine is not idle
        ex._loop.call_soon_threadsafe(wf.gate.set)
        assert len(ex.wait(1, timeout=10)) == 1
        deadline = time.monotonic() + 10  # the task's done-callback runs just after the result
        while ex.idle_seconds == frozen and time.monotonic() < deadline:
            time.sleep(0.001)
        assert ex.idle_seconds > frozen  # counting again once it ended
