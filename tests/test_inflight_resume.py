"""Episodes in flight survive a checkpoint and a restart (issue 16, item 1).

Real parts: the built-in engine on the tiny model, the real executor, the real training loop.
The executor-level test suspends 64 episodes mid-generation, pickles the snapshot, builds a new
engine and executor as a restarted process would, and checks that every episode is accounted
for and that interrupted generations continue from the tokens they had. The loop-level test stops
a run with 64 episodes in flight and resumes it.
"""

import asyncio
import json
import pickle
import threading

import pytest
from test_train_loop import metrics, small_config

from asyncrl import Trainer
from asyncrl.api import GenerationConfig, ModelRequest, PolicyVersion, Sample, Trajectory
from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.rollout.executor import RolloutConfig, WorkflowExecutor
from asyncrl.rollout.group import GroupedWorkflow

pytestmark = pytest.mark.usefixtures("one_thread")
N = 48
G = GenerationConfig(max_new_tokens=N, min_new_tokens=N)


class TwoTurns:
    """Two sequential generations (the second continues the first): a multi-turn episode.
    `first_turns` is set once 4 first turns are done: then most calls are mid-generation."""

    def __init__(self):
        self.done, self.first_turns = 0, threading.Event()

    async def arun_episode(self, engine, data):
        prompt = [1 + data["id"] % 50, 7, 9]
        first = await engine.agenerate(ModelRequest(prompt, G))
        self.done += 1
        if self.done >= 4:
            self.first_turns.set()
        second_prompt = prompt + first.output_tokens + [5]
        second = await engine.agenerate(ModelRequest(second_prompt, G))
        tokens = first.output_tokens + [5] + second.output_tokens
        sample = Sample(
            input_ids=prompt + tokens, loss_mask=[0] * 3 + [1] * N + [0] + [1] * N,
            logprobs=[0.0] * 3 + first.output_logprobs + [0.0] + second.output_logprobs,
            versions=[-1] * 3 + first.output_versions + [-1] + second.output_versions,
            reward=float(data["id"] % 2))
        return Trajectory([sample], group_id=str(data["id"]))


def _engine(model_dir, version, max_num_seqs=8, max_seq_len=128):
    cfg = EngineConfig(model_path=str(model_dir), max_seq_len=max_seq_len,
                       max_num_seqs=max_num_seqs)
    return AsyncLLMEngine(LLMEngine(cfg, version=version))


def test_suspended_episodes_continue_after_a_restart(model_dir, tmp_path):
    cfg = RolloutConfig(batch_size=4, max_concurrent_rollouts=64, max_head_offpolicyness=15)
    turns = TwoTurns()
    workflow = GroupedWorkflow(turns, 2)
    engine = _engine(model_dir, version=0, max_num_seqs=2)
    with WorkflowExecutor(engine, cfg, workflow) as ex:
        for i in range(64):
            ex.submit({"id": i})
        assert turns.first_turns.wait(60)  # some first turns done, many calls half-way
        snap = ex.suspend(engine.interrupt, timeout=30)
        saved = ex.state_dict()  # what a checkpoint keeps of the executor
        counts = snap.counts()
        assert ex.stats()["running"] == 0 and ex.stats()["ready"] == 0
    engine.shutdown()
    ids = [e for e, _ in snap.pending] + [r.episode_id for r in snap.ready] + \
          [s.episode_id for s in snap.suspended]
    assert len(ids) == len(set(ids)) == 64, counts  # nothing lost, nothing twice
    assert counts["suspended"] > 0 and counts["partial_calls"] > 0, counts
    (tmp_path / "rollout.pkl").write_bytes(pickle.dumps(saved))  # as a checkpoint pickles it

    # a restarted process: new engine (serving version 1), new executor, the state loaded
    saved = pickle.loads((tmp_path / "rollout.pkl").read_bytes())
    snap = saved["episodes"]
    partial = {s.episode_id: s.journal.partial for s in snap.suspended}
    engine = _engine(model_dir, version=1)
    with WorkflowExecutor(engine, cfg, workflow, PolicyVersion(1)) as ex:
        ex.load_state_dict(saved)
        trajs = ex.wait(64, timeout=120)
        stats = ex.stats()
    engine.shutdown()
    assert sorted(t.metadata["episode_id"] for t in trajs) == sorted(ids)  # each once
    assert stats["restored"] == {"consumed": 64}
    # continued episodes were not submitted again; the pending rows were
    assert stats["submitted"] == saved["staleness"]["submitted"] + len(snap.pending)
    assert stats["continued_calls"] >= counts["partial_calls"] and stats["replayed_calls"] > 0
    by_id = {t.metadata["episode_id"]: t for t in trajs}
    continued = 0
    for eid, calls in partial.items():
        samples = by_id[eid].samples
        for call in calls:  # the sequence continues exactly from the tokens it had
            head = call.input_ids + call.response.output_tokens
            owner = [s for s in samples if s.input_ids[:len(head)] == head]
            assert owner, (eid, call.input_ids)
            versions = [v for v in owner[0].versions if v >= 0]
            continued += 0 in versions and 1 in versions
    assert continued > 0  # one response holds tokens from before (v0) and after (v1)


class EnvironmentStep:
    """Two samples per episode: first turns, an environment step (0.3 s), second turns. At any
    moment most of the 64 episodes are inside the environment step or generating."""

    async def arun_episode(self, engine, data):
        prompt = [1 + data["id"] % 50, 7, 9] if isinstance(data.get("id"), int) else [3, 7, 9]
        g = GenerationConfig(max_new_tokens=8, min_new_tokens=8)
        firsts = await asyncio.gather(*(engine.agenerate(ModelRequest(prompt, g))
                                        for _ in range(2)))
        await asyncio.sleep(0.3)
        seconds = await asyncio.gather(*(engine.agenerate(ModelRequest(
            prompt + f.output_tokens + [5], g)) for f in firsts))
        samples = []
        for f, s in zip(firsts, seconds):
            samples.append(Sample(
                input_ids=prompt + f.output_tokens + [5] + s.output_tokens,
                loss_mask=[0] * 3 + [1] * 8 + [0] + [1] * 8,
                logprobs=[0.0] * 3 + f.output_logprobs + [0.0] + s.output_logprobs,
                versions=[-1] * 3 + f.output_versions + [-1] + s.output_versions,
                reward=float(f.output_tokens[0] % 2)))
        return Trajectory(samples, group_id=str(data.get("id")))


def test_stopped_run_with_64_in_flight_resumes_them(model_dir, tmp_path):
    run = tmp_path / "run"
    # eta 15: the staleness budget at the stop, (15 + 2 + 1) x 4 - 8 consumed, admits all 64
    over = {"rollout.max_concurrent_rollouts": 64, "rollout.max_head_offpolicyness": 15,
            "eval.every": 0, "checkpoint_every": 0, "logging.plot": False,
            "watchdog.suspend_timeout_s": 10}
    first = Trainer(small_config(model_dir, run, total_steps=2, **over)).train(
        workflow=EnvironmentStep())
    assert first.steps == 2
    state = json.loads((run / "checkpoints/step_000002/state.json").read_text())
    kept = state["rollout"]["in_flight"]
    in_flight = kept["pending"] + kept["ready"] + kept["suspended"]
    assert in_flight >= 64 and kept["suspended"] > 0 and kept["ready"] > 0, kept

    second = Trainer(small_config(model_dir, run, total_steps=5, **over), run_dir=run).train(
        workflow=EnvironmentStep(), resume=True)
    assert second.steps == 5
    rows = [m for m in metrics(run) if "reward/mean" in m]
    assert [m["step"] for m in rows] == [1, 2, 3, 4, 5]  # the curve continues
    outcomes = {k.removeprefix("rollout/restored_"): int(v) for k, v in rows[-1].items()
                if k.startswith("rollout/restored_")}
    assert sum(outcomes.values()) == in_flight, outcomes  # every episode accounted for
    assert outcomes.get("consumed", 0) > 0, outcomes
    assert set(outcomes) <= {"consumed", "stale_dropped", "ready", "continuing", "pending",
                             "suspended", "restarted", "rejected", "failed", "accepted"}
    assert all(m["staleness/token_lag_max"] <= m["staleness/max"] <= 15 for m in rows)
    final = json.loads((run / "checkpoints/step_000005/state.json").read_text())
    assert final["rollout"]["staleness"]["consumed"] == 5 * 4  # the counters continued too


def test_interrupt_returns_partial_output_and_new_calls_return_at_once(model_dir):
    engine = _engine(model_dir, version=0, max_seq_len=1024)

    async def go():
        long = GenerationConfig(max_new_tokens=1000, min_new_tokens=1000)
        req = ModelRequest([1, 2, 3], long)
        task = asyncio.create_task(engine.agenerate(req))
        while (seq := engine.engine.get_sequence(req.rid)) is None or seq.num_outputs < 5:
            await asyncio.sleep(0.001)
        await asyncio.to_thread(engine.interrupt)
        part = await task
        fresh = await engine.agenerate(ModelRequest([1, 2, 3], G))
        engine.resume()
        after = await engine.agenerate(ModelRequest([1, 2, 3], G))
        return part, fresh, after

    try:
        part, fresh, after = asyncio.run(go())
    finally:
        engine.shutdown()
    assert part.stop_reason.value == "abort" and 5 <= part.output_len < 1000
    assert fresh.stop_reason.value == "abort" and fresh.output_len == 0
    assert after.output_len == N
