"""Episodes that call tools over HTTP (asyncrl/rollout/tool_calling.py, workflow.kind=tool_calls):
a real tool service subprocess on 127.0.0.1 with injected failures (503s, replies held past the
client's timeout), the tiny model's real chat template and tokenizer.

The policy in the first tests is scripted (`ScriptedPolicy`): it writes a right or a wrong calc
call, then copies the tool's reply, so that every path of an episode runs in seconds; a model
that calls tools needs a warm start of several minutes (configs/train_tools.yaml's), which the
default suite cannot afford. `asyncrl train` then runs the job for 2 steps on the tiny model with
the service started and stopped by the job.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from asyncrl.api import GenerationConfig, ModelRequest, ModelResponse, StopReason
from asyncrl.config import ConfigError
from asyncrl.models.chat import render_chat
from asyncrl.models.loading import load_tokenizer
from asyncrl.rollout.calculator import TOOLS
from asyncrl.rollout.tool_calling import ToolCallingWorkflow
from asyncrl.rollout.tool_service import ToolServiceConfig, ToolServiceProcess
from examples.tool_agent.task import episode_reward, tool_call_text

RESULT = re.compile(r"<\|im_start\|>tool\n(.*?)<\|im_end\|>", re.DOTALL)  # the tiny template's


class ScriptedPolicy:
    """An InferenceEngine whose replies are written by rule (see the module docstring): the
    first turn calls calc on the asked product (or a wrong one, every `wrong_every`-th
    request), the second copies the tool's last result."""

    def __init__(self, tokenizer, wrong_every: int = 0) -> None:
        self.tok, self.wrong_every, self.requests = tokenizer, wrong_every, 0

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests += 1
        prompt = self.tok.decode(req.input_ids)
        results = RESULT.findall(prompt)
        if results:
            text = results[-1]
        else:
            a, b = re.findall(r"(\d+)\*(\d+)=\?", prompt)[-1]
            wrong = self.wrong_every and self.requests % self.wrong_every == 0
            text = tool_call_text(f"{a}*{int(b) + 1}" if wrong else f"{a}*{b}")
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        await asyncio.sleep(0)
        return ModelResponse(list(req.input_ids), ids, [-0.5] * len(ids), [3] * len(ids),
                             StopReason.STOP)


def rows(n: int) -> list[dict]:
    out = []
    for i in range(n):
        a, b = 10 + i % 90, 11 + (7 * i) % 89
        out.append({"id": f"mul-{i}", "messages": [{"role": "user", "content": f"{a}*{b}=?"}],
                    "answer": str(a * b)})
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


def run(wf, policy, data):
    """The episodes of `data` at once on one event loop (the tool client's), then close."""
    async def go():
        try:
            return await asyncio.wait_for(asyncio.gather(
                *(wf.arun_episode(policy, r) for r in data)), 60)
        finally:
            await wf.aclose()

    return asyncio.run(go())


def workflow(tokenizer, service, policy_gconfig=None):
    return ToolCallingWorkflow(episode_reward, policy_gconfig or GenerationConfig(
        max_new_tokens=64), tokenizer, service.client(), TOOLS, max_tool_calls=1)


def test_an_episode_is_the_conversation_as_the_template_renders_it(tokenizer):
    with ToolServiceProcess(ToolServiceConfig(median_s=0.01)) as service:
        row = rows(1)[0]
        (traj,) = run(workflow(tokenizer, service), ScriptedPolicy(tokenizer), [row])
    (sample,) = traj.samples
    assert sample.reward == 1.0 and sample.metadata["tool_results"] == [row["answer"]]
    a, b = row["messages"][0]["content"].removesuffix("=?").split("*")
    call = {"id": "x", "type": "function", "function": {
        "name": "calc", "arguments": json.dumps({"expr": f"{a}*{b}"}, separators=(",", ":"))}}
    conversation = [*row["messages"], {"role": "assistant", "content": None,
                                       "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "x", "content": row["answer"]},
                    {"role": "assistant", "content": row["answer"]}]
    expected = render_chat(tokenizer, conversation, False, TOOLS)
    assert tokenizer.decode(sample.input_ids).rstrip() == expected.rstrip()
    # trained on the two replies only: the prompt and the tool's result are context
    trained = tokenizer.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])
    assert trained == tool_call_text(f"{a}*{b}") + "<|im_end|>" + row["answer"] + "<|im_end|>"
    assert all(v == 3 for v, m in zip(sample.versions, sample.loss_mask) if m)


def test_failures_reach_the_episode_as_tool_errors_and_are_counted(tokenizer):
    """With 503s and replies held past the client's timeout injected, every episode ends with a
    sample; a failed call's episode reads an "error: ..." result and scores 0; the metrics count
    the failures by kind and report the observed latency."""
    cfg = ToolServiceConfig(median_s=0.02, p99_over_median=5.0, error_rate=0.15, hang_rate=0.1,
                            hang_s=30.0, client_timeout_s=1.0, seed=1)
    data = rows(40)
    with ToolServiceProcess(cfg) as service:
        wf = workflow(tokenizer, service)
        trajs = run(wf, ScriptedPolicy(tokenizer, wrong_every=7), data)
        metrics = wf.metrics()
    samples = [t.samples[0] for t in trajs]
    assert len(samples) == len(data)
    failed = [s for s in samples if s.metadata["tool_results"][0].startswith("error: ")]
    errors = metrics["tools/errors_server_error"] + metrics["tools/errors_timeout"]
    assert metrics["tools/calls"] == len(data) and len(failed) == errors > 0
    assert metrics["tools/errors_server_error"] > 0 and metrics["tools/errors_timeout"] > 0
    assert metrics["tools/error_frac"] == pytest.approx(errors / len(data))
    assert all(s.reward == 0.0 for s in failed)
    right = [s for s, r in zip(samples, data) if s.metadata["tool_results"] == [r["answer"]]]
    assert right and all(s.reward == 1.0 for s in right)
    assert 0.0 < metrics["tools/latency_p50_s"] <= metrics["tools/latency_p99_s"]
    assert wf.metrics()["tools/calls"] == 0  # per step: taken and reset


def test_a_stopped_service_is_an_unreachable_tool_not_a_crash(tokenizer):
    service = ToolServiceProcess(ToolServiceConfig(median_s=0.0))
    wf = workflow(tokenizer, service)
    service.stop()
    (traj,) = run(wf, ScriptedPolicy(tokenizer), rows(1))
    assert traj.samples[0].metadata["tool_results"][0].startswith("error: ")
    assert wf.metrics()["tools/errors_unreachable"] == 1


def test_the_greedy_evaluation_scores_answers_and_tool_use(tokenizer):
    with ToolServiceProcess(ToolServiceConfig(median_s=0.0)) as service:
        wf = workflow(tokenizer, service)

        async def go():
            try:
                return await wf.aevaluate(ScriptedPolicy(tokenizer, wrong_every=2), rows(10))
            finally:
                await wf.aclose()

        report = asyncio.run(go())
    assert report.name == "greedy accuracy" and report.score == 0.5
    assert report.metrics["eval/tool_call_frac"] == 1.0
    assert report.metrics["eval/reward"] == pytest.approx(0.5)


def test_schemas_must_name_the_served_tools():
    from asyncrl.launch.train_config import TrainRunConfig

    cfg = TrainRunConfig.from_dict({"workflow": {"kind": "tool_calls", "service": {
        "tools": {"search": "asyncrl.rollout.calculator:calc"}}}})
    from asyncrl.errors import UserError
    from asyncrl.launch.workflows import WorkflowContext

    ctx = WorkflowContext(None, None, episode_reward, GenerationConfig(), None, None)
    with pytest.raises(UserError, match="schemas names the tools"):
        cfg.workflow.build(ctx)
    with pytest.raises(ConfigError, match="max_tool_calls"):
        TrainRunConfig.from_dict({"workflow": {"kind": "tool_calls", "max_tool_calls": 0}})
    with pytest.raises(ConfigError, match="eval_service_time=false needs the job's own"):
        TrainRunConfig.from_dict({"workflow": {"kind": "tool_calls", "url": "http://x:1",
                                               "eval_service_time": False}})


def service_processes() -> list[int]:
    """Pids of tool-service subprocesses running now."""
    import os

    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"asyncrl.rollout.tool_service" in cmd:
            pids.append(int(pid))
    return pids


@pytest.mark.usefixtures("one_thread")
def test_the_job_starts_the_service_trains_and_stops_it(model_dir, tmp_path):
    """2 steps of `asyncrl train` with workflow.kind=tool_calls on the tiny (untrained) model: the
    job starts the tool service (with injected failures), logs the tool metrics every step and
    stops the service at the end; its evaluations pause the training episodes and call the
    service undelayed (eval.pause_rollouts, workflow.eval_service_time=false)."""
    from asyncrl import Trainer
    from tests.test_train_loop import metrics, small_config

    before = set(service_processes())
    cfg = small_config(model_dir, tmp_path / "run", total_steps=2, reward=
                       "examples.tool_agent.task:episode_reward",
                       workflow={"kind": "tool_calls", "eval_service_time": False, "service": {
                           "median_s": 0.01, "error_rate": 0.2, "seed": 3}},
                       **{"gconfig.max_new_tokens": 16, "eval.pause_rollouts": True})
    result = Trainer(cfg).train()
    assert result.steps == 2
    steps = [m for m in metrics(tmp_path / "run") if "reward/mean" in m]
    assert len(steps) == 2 and all("tools/calls" in m and "tools/error_frac" in m for m in steps)
    assert all(0.0 <= m["perf/engine_idle_frac"] <= 1.0 for m in steps)
    assert set(service_processes()) <= before


@pytest.mark.usefixtures("one_thread")
def test_the_job_uses_a_running_service_at_url(model_dir, tmp_path):
    """workflow.url: the job calls a service it did not start (and leaves it running)."""
    from asyncrl import Trainer
    from tests.test_train_loop import metrics, small_config

    with ToolServiceProcess(ToolServiceConfig(median_s=0.0)) as service:
        cfg = small_config(model_dir, tmp_path / "run", total_steps=1, checkpoint_every=0,
                           reward="examples.tool_agent.task:episode_reward",
                           workflow={"kind": "tool_calls", "url": service.url},
                           **{"gconfig.max_new_tokens": 8, "eval.every": 0})
        assert Trainer(cfg).train().steps == 1
        assert service.proc.poll() is None
    assert "tools/calls" in [m for m in metrics(tmp_path / "run") if "reward/mean" in m][0]


@pytest.mark.parametrize("mode", ["workflow", "proxy"])
def test_many_episodes_waiting_on_the_tool_lose_and_duplicate_nothing(tokenizer, model_dir, mode):
    """benchmarks/load_tools.py at a small scale (its record holds 512 in flight for 10
    minutes): 48 episodes in flight for 8 s against a service with a long tail and injected
    503s, the `tool_calls` workflow and, separately, the OpenAI-SDK calculator agent through the
    proxy (the scripted policy above writes the replies). Every submitted row comes back once."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from load_tools import run_load

    out = run_load(mode, model_dir, in_flight=48, seconds=8.0, sample_every=2.0,
                   service={"median_s": 0.1, "p99_over_median": 10.0, "error_rate": 0.05},
                   say=lambda _: None, engine=ScriptedPolicy(tokenizer, wrong_every=5))
    assert out["submitted"] > 48 and out["returned"] == out["submitted"]
    assert out["lost"] == out["duplicated"] == out["unknown"] == 0
    assert out["rejected"] == out["failed"] == 0
    assert max(s["running"] for s in out["samples"]) > 24  # the episodes did wait together
    # every scripted episode calls once: the service answered about one call per episode
    assert 0.9 <= out["service_calls_per_episode"] <= 1.0 + 48 / out["returned"]
    assert out["service_calls"].get("error", 0) > 0  # the injected 503s reached episodes
    if mode == "workflow":
        assert out["episodes_with_tool_result"] == out["returned"]


def test_the_load_records_first_minute_starts_after_the_idle_sample():
    """The t = 0 sample is taken before any episode runs; a flat RSS under load reads flat."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from load_tools import minute_means

    samples = [{"t": t, "rss_mib": 100.0 if t == 0 else 150.0, "fds": 10 if t == 0 else 90,
                "service_rss_mib": 50.0, "service_fds": 7} for t in range(0, 601, 10)]
    means = minute_means(samples, 600.0)
    assert means["rss_mib_first_minute"] == means["rss_mib_last_minute"] == 150.0
    assert means["fds_first_minute"] == 90.0 and means["service_fds_last_minute"] == 7.0


class SubmitPolicy:
    """Scripted (see the module docstring) for the submit task: answers the sum in the prompt,
    one too many on odd first operands, with the `submit` call; then `Done.`."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        prompt = self.tok.decode(req.input_ids)
        if RESULT.findall(prompt):
            text = "Done."
        else:
            a, b = map(int, re.findall(r"(\d+)\+(\d+)=", prompt)[-1])
            text = f'{a + b + a % 2}<tool_call>{{"name":"submit","arguments":{{}}}}</tool_call>'
        ids = self.tok.encode(text, add_special_tokens=False) + [self.tok.eos_token_id]
        return ModelResponse(list(req.input_ids), ids, [-0.5] * len(ids), [0] * len(ids),
                             StopReason.STOP)


def test_the_submit_task_grades_the_reply_with_the_episode_context(tokenizer):
    """asyncrl/data/arithmetic_submit.py: the grader knows the answer from the row's
    `tool_context` (the harness's) and the reply that made the call; its demonstrations call
    it; the reward is its verdict."""
    from asyncrl.data.arithmetic_submit import (ArithmeticSubmitTaskConfig, submit,
                                                verdict_reward)

    task = ArithmeticSubmitTaskConfig(num_train=40, num_eval=8).build()
    data = task.eval_rows()
    assert submit({"answer": "5", "reply": " 5"}) == "correct"
    assert submit({"answer": "5", "reply": "6"}) == "wrong" and submit().startswith("error: ")
    demos = [r["conversation"] for r in task.train_rows()]
    assert all(d[1]["tool_calls"][0]["function"]["name"] == "submit" for d in demos)
    assert {d[2]["content"] for d in demos} == {"correct", "wrong"}
    cfg = ToolServiceConfig(tools={"submit": "asyncrl.data.arithmetic_submit:submit"},
                            median_s=0.01)
    with ToolServiceProcess(cfg) as service:
        wf = ToolCallingWorkflow(verdict_reward, GenerationConfig(max_new_tokens=64), tokenizer,
                                 service.client(), None)
        trajs = run(wf, SubmitPolicy(tokenizer), data)
    for row, traj in zip(data, trajs):
        odd = int(row["question"].split("+")[0]) % 2
        sample = traj.samples[0]
        assert sample.metadata["tool_results"] == ["wrong" if odd else "correct"]
        assert sample.reward == float(not odd) and sample.metadata["completion_text"] == "Done."
        assert tokenizer.decode(sample.input_ids).startswith("<|im_start|>user\n")  # no tools
