"""`asyncrl train` end to end on a tiny random model: real HTTP servers, real subprocesses.

The reward (`train_helpers.digit_reward`) varies on an untrained model, so every step has a
gradient; the checks are about the machinery (weights move, versions advance, staleness stays
within eta, processes are cleaned up, resume continues the curve), not about learning.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file
from train_helpers import digit_reward, processes_mentioning, sharded_parts, wait_gone

from asyncrl import Trainer
from asyncrl.config import ConfigError
from asyncrl.train.checkpoint import load_state
from asyncrl.train.engine import HFTrainEngine
from asyncrl.launch.train_config import TrainRunConfig

pytestmark = pytest.mark.usefixtures("one_thread")
TESTS = Path(__file__).parent


def small_config(model_dir, out, **over):
    base = {
        "model": {"path": str(model_dir)},
        "output_dir": str(out),
        "total_steps": 3,
        "max_train_seconds": None,
        "gconfig": {"n_samples": 4, "max_new_tokens": 6},
        "rollout": {"batch_size": 4, "max_concurrent_rollouts": 8, "max_head_offpolicyness": 1},
        "filter_uniform_groups": False,
        "train": {"optimizer": {"lr": 1e-3, "warmup_steps": 0}},
        "inference": {"engine": {"max_num_seqs": 32}},
        "eval": {"every": 2, "size": 8, "max_new_tokens": 6},
        "logging": {"tensorboard": False, "plot_every": 2},
        "checkpoint_every": 2,
    }
    for key, value in over.items():
        node = base
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return TrainRunConfig.from_dict(base)


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_short_loop_through_two_http_servers(model_dir, tmp_path):
    eta = 1
    # weights reach the two servers by broadcast over a gloo weight group (the NCCL path on GPUs)
    cfg = small_config(model_dir, tmp_path / "run", **{"inference.mode": "local",
                                                       "inference.num_servers": 2,
                                                       "inference.weight_sync": "gloo"})
    result = Trainer(cfg).train(reward=digit_reward)
    assert result.steps == 3 and result.stopped_by == "total_steps"
    rows = [m for m in metrics(tmp_path / "run") if "reward/mean" in m]
    assert [m["step"] for m in rows] == [1, 2, 3]
    # versions advanced one per step, and no consumed trajectory was staler than eta
    assert [m["policy/version"] for m in rows] == [1.0, 2.0, 3.0]
    assert all(m["staleness/max"] <= eta for m in rows)
    # no token is older than its episode's start (the lag of a token <= its trajectory's)
    assert all(m["staleness/token_lag_max"] <= m["staleness/max"] for m in rows)
    # the weights the servers were given moved away from the initial model
    before = load_file(str(Path(model_dir) / "model.safetensors"))
    after = load_file(str(tmp_path / "run/checkpoints/step_000003/policy/model.safetensors"))
    moved = sum(float((after[k] - before[k]).abs().max()) > 0 for k in before)
    assert moved >= len(before) // 2
    # rollouts JSONL: every record came from a version the loop had reached
    records = [json.loads(line) for f in (tmp_path / "run/rollouts").glob("*.jsonl")
               for line in f.read_text().splitlines()]
    assert records and max(r["tail_version"] for r in records) <= 3
    assert {r["start_version"] for r in records} >= {0, 1}
    assert (tmp_path / "run/plot.png").stat().st_size > 0
    assert (tmp_path / "run/config.yaml").is_file()
    assert processes_mentioning(str(model_dir)) == []  # both servers are gone


def test_inprocess_loop_then_resume_continues_the_curve(model_dir, tmp_path):
    run = tmp_path / "run"
    # pinned to the CPU: the 1e-3 trainer/sampler check below is an fp32 one (bf16 on CUDA is the
    # gpu tests' tolerance)
    cpu = {"train.device": "cpu", "inference.engine.device": "cpu"}
    first = Trainer(small_config(model_dir, run, total_steps=2, checkpoint_every=1,
                                 **{"inference.weight_sync": "disk", **cpu})).train(reward=digit_reward)
    assert first.steps == 2
    # disk sync: each version written as a HF dir, only the newest two kept
    assert sorted(p.name for p in (run / "weights").iterdir()) == ["v1", "v2"]
    # the resumed part also runs the KL-to-reference path and pass@k evals
    cfg = small_config(model_dir, run, total_steps=4, checkpoint_every=1,
                       **{"actor.ppo.kl_coef": 0.05, "eval.pass_k": [2], **cpu})
    second = Trainer(cfg, run_dir=run).train(reward=digit_reward, resume=True)
    assert second.steps == 4
    late = [m for m in metrics(run) if m["step"] > 2]
    assert any("actor/kl_ref" in m for m in late) and any("eval/pass@2" in m for m in late)
    steps = [m["step"] for m in metrics(run) if "reward/mean" in m]
    assert steps == [1, 2, 3, 4]
    state = json.loads((run / "checkpoints/step_000004/state.json").read_text())
    assert state["loop"]["step"] == 4 and state["data"]["position"] > 0
    # the staleness counters continued across the resume: 4 batches of 4 consumed in all
    assert state["rollout"]["staleness"]["consumed"] == 16
    trainer = HFTrainEngine.from_pretrained(model_dir, trainable=False)
    load_state(run / "checkpoints/step_000004/state", trainer.parallel, {"trainer": trainer})
    assert trainer.version.value == 4  # the trainer's engine owns the version
    elapsed = [m["time/elapsed_s"] for m in metrics(run) if "reward/mean" in m]
    assert elapsed == sorted(elapsed)  # the time axis continues across the resume
    # the resumed engine serves the checkpoint's version: its tokens are not tagged 0
    records = [json.loads(line) for f in (run / "rollouts").glob("*.jsonl")
               for line in f.read_text().splitlines()]
    resumed = [r for r in records if r["start_version"] >= 2]
    assert resumed and min(r["head_version"] for r in resumed) >= 2
    # the timeline (events.jsonl) and the samples `asyncrl view` shows, across the resume
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    # a random model's 6-token completions are mostly cut: a warning per step names the setting
    cut = [e for e in events if e["kind"] == "warning"]
    assert cut and all("gconfig.max_new_tokens=6" in e["message"] for e in cut)
    assert [(e["kind"], e["step"]) for e in events
            if e["kind"] not in ("checkpoint", "warning")] == [
        ("start", 0), ("eval", 0), ("eval", 2), ("stop", 2), ("resume", 2), ("eval", 4),
        ("stop", 4)]
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [1, 2, 3, 4]
    resume = next(e for e in events if e["kind"] == "resume")
    assert resume["checkpoint"].endswith("step_000002") and resume["version"] == 2
    assert "episodes in flight restored" in resume["message"]
    for step in (1, 2, 3, 4):
        rows = [json.loads(x) for x in (run / "samples" / f"step_{step:06d}.jsonl")
                .read_text().splitlines()]
        assert {r["group"] for r in rows} == {0, 1, 2, 3}  # logging.sample_groups: 4
        assert all(r["policy_version"] == step - 1 for r in rows)
        for r in rows:  # the trainer's logprobs next to the sampler's, on generated tokens
            gen = [i for i, m in enumerate(r["loss_mask"]) if m]
            assert len(r["tokens"]) == len(r["input_ids"]) and gen
            fresh = [i for i in gen if r["versions"][i] == r["policy_version"]]
            assert all(abs(r["trainer_logprobs"][i] - r["sampler_logprobs"][i]) < 1e-3
                       for i in fresh)


def helpers_env(**extra: str) -> dict[str, str]:
    """This environment, with tests/ importable (train_helpers) by the subprocess."""
    return dict(os.environ, PYTHONPATH=f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                **extra)


def _start_train(model_dir, out, *extra):
    env = helpers_env(PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", f"model.path={model_dir}",
           f"output_dir={out}", "reward=train_helpers:digit_reward", "inference.mode=local",
           "max_train_seconds=null", "gconfig.n_samples=4", "gconfig.max_new_tokens=6",
           "rollout.batch_size=4", "rollout.max_concurrent_rollouts=8",
           "filter_uniform_groups=false", "eval.every=0", "logging.tensorboard=false",
           "checkpoint_every=0", "inference.engine.max_num_seqs=32", *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)


def _wait_for_step(run, step, proc, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = Path(run) / "metrics.jsonl"
        if path.is_file() and any(m.get("step", 0) >= step and "reward/mean" in m
                                  for m in metrics(run)):
            return
        if proc.poll() is not None:
            pytest.fail(f"train exited early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        time.sleep(0.2)
    proc.kill()
    pytest.fail(f"no step {step} within {timeout}s")


@pytest.mark.slow
def test_ctrl_c_checkpoints_stops_servers_and_resume_continues(model_dir, tmp_path):
    run = tmp_path / "run"
    proc = _start_train(model_dir, run, "total_steps=1000")
    _wait_for_step(run, 2, proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 130, err[-3000:]
    assert "stopped_by=interrupted" in out
    assert processes_mentioning(str(model_dir)) == []
    done = max(m["step"] for m in metrics(run))
    assert (run / "checkpoints" / f"step_{done:06d}" / "policy/model.safetensors").is_file()
    env = helpers_env()
    resumed = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "train", "--resume", str(run),
         f"total_steps={done + 2}"], capture_output=True, text=True, env=env, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [m for m in metrics(run) if "reward/mean" in m]
    assert [m["step"] for m in rows] == list(range(1, done + 3))
    # the restarted servers were given the checkpoint's version before the first rollout
    assert all(m["staleness/token_lag_max"] <= m["staleness/max"] for m in rows)
    assert processes_mentioning(str(model_dir)) == []


@pytest.mark.slow
def test_sigkill_of_the_trainer_takes_the_servers_down(model_dir, tmp_path):
    run = tmp_path / "run"
    proc = _start_train(model_dir, run, "total_steps=1000", "inference.num_servers=2")
    _wait_for_step(run, 1, proc)
    assert len(processes_mentioning(str(model_dir))) >= 3  # trainer + 2 servers
    proc.kill()
    proc.wait()
    wait_gone(str(model_dir), seconds=30)


def test_bad_train_config_is_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", "rollout.batch_sise=4"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "did you mean 'batch_size'" in out.stderr
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", "--resume",
                          str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "no config.yaml" in out.stderr


def test_derived_settings_are_not_settable():
    """The trainer's temperature is the sampler's, the LR horizon follows total_steps: neither
    can be set apart from what it derives from."""
    for key in ("train.temperature", "train.total_steps", "train.trainable", "critic.lora"):
        with pytest.raises(ConfigError, match=f"unknown key '{key}'"):
            TrainRunConfig.load(None, [f"{key}=1"])


def test_example_configs_validate_and_multi_turn_runs(model_dir, tmp_path):
    root = TESTS.parent / "configs"
    names = sorted(p.name for p in root.glob("train_*.yaml"))
    assert {"train_tiny.yaml", "train_chain.yaml", "train_vlm_tiny.yaml",
            "train_vlm_tiny_easy.yaml"} <= set(names), names
    for name in names:
        TrainRunConfig.load(str(root / name), [])
    cfg = TrainRunConfig.load(str(root / "train_multiturn.yaml"), [
        f"model.path={model_dir}", f"output_dir={tmp_path / 'mt'}", "total_steps=2",
        "max_train_seconds=null", "gconfig.n_samples=2", "gconfig.max_new_tokens=4",
        "rollout.batch_size=2", "rollout.max_concurrent_rollouts=4", "filter_uniform_groups=false",
        "eval.every=0", "logging.tensorboard=false", "inference.engine.max_num_seqs=16"])
    result = Trainer(cfg).train(reward=digit_reward)
    assert result.steps == 2
    rows = [m for m in metrics(tmp_path / "mt") if "reward/mean" in m]
    assert [m["batch/samples"] for m in rows] == [4.0, 4.0]  # 2 groups x 2 episodes


def torchrun_train(model_dir, run: Path, *overrides: str) -> subprocess.CompletedProcess:
    """`asyncrl train` of 2 steps on 2 gloo trainer ranks (torchrun), small batches."""
    env = helpers_env(OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", "2", "-m", "asyncrl.cli", "train", f"model.path={model_dir}",
           f"output_dir={run}", "reward=train_helpers:digit_reward", "total_steps=2",
           "max_train_seconds=null", "gconfig.n_samples=4", "gconfig.max_new_tokens=6",
           "rollout.batch_size=4", "rollout.max_concurrent_rollouts=8",
           "filter_uniform_groups=false", "logging.tensorboard=false", "checkpoint_every=2",
           "inference.engine.max_num_seqs=32", "torch_threads=1", "train.device=cpu",
           "inference.engine.device=cpu", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=280)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_torchrun_two_trainer_ranks(model_dir, tmp_path, estimator):
    """FSDP2 across 2 gloo ranks: rank 0 leads (engine, executor, logs), rank 1 follows; with
    gae the critic is sharded and trained alongside, and checkpointed."""
    run = tmp_path / "run"
    out = torchrun_train(model_dir, run, "eval.every=0", f"actor.advantage.estimator={estimator}")
    assert out.returncode == 0, out.stderr[-4000:]
    rows = [m for m in metrics(run) if "reward/mean" in m]
    assert [m["policy/version"] for m in rows] == [1.0, 2.0]
    before = load_file(str(Path(model_dir) / "model.safetensors"))
    after = load_file(str(run / "checkpoints/step_000002/policy/model.safetensors"))
    assert any(float((after[k] - before[k]).abs().max()) > 0 for k in before)
    parts = sharded_parts(run / "checkpoints/step_000002")
    assert parts == ({"trainer", "critic"} if estimator == "gae" else {"trainer"})
    if estimator == "gae":
        assert all(math.isfinite(m["critic/loss"]) for m in rows)
    assert out.stdout.count("run_dir=") == 1  # only rank 0 reports
    if estimator == "grpo":
        # the sharded checkpoint of 2 ranks resumes in one process (another world size)
        out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", "--resume", str(run),
                              "total_steps=3"], capture_output=True, text=True,
                             env=helpers_env(), timeout=200)
        assert out.returncode == 0, out.stderr[-4000:]
        rows = [m for m in metrics(run) if "reward/mean" in m]
        assert [m["policy/version"] for m in rows] == [1.0, 2.0, 3.0]
        assert "RNG states of 2 ranks" in out.stderr + out.stdout


def test_evaluations_every_so_many_training_seconds(model_dir, tmp_path):
    """eval.every_s: an evaluation after each step that ends `every_s` training seconds or more
    after the last one (eval.every=0: by time only), plus the start's and the end's."""
    cfg = small_config(model_dir, tmp_path / "run", total_steps=4, checkpoint_every=0,
                       **{"eval.every": 0, "eval.every_s": 1e-6})
    result = Trainer(cfg).train(reward=digit_reward)
    assert [step for step, _, _ in result.evals] == [0, 1, 2, 3, 4]
    cfg = small_config(model_dir, tmp_path / "run2", total_steps=3, checkpoint_every=0,
                       **{"eval.every": 0, "eval.every_s": 1e6})
    result = Trainer(cfg).train(reward=digit_reward)
    assert [step for step, _, _ in result.evals] == [0, 3]  # the start's and the end's


def test_evaluations_can_pause_the_training_episodes(model_dir, tmp_path, monkeypatch):
    """eval.pause_rollouts: while an evaluation runs no training episode is in flight and none
    starts (the executor is suspended and paused); after it they continue, and the run trains
    on (nothing lost: every step gets its batch)."""
    from asyncrl.launch import train_loop

    seen = []
    real = train_loop.bounded

    def spy(executor, coro, limit, what, setting):
        if what == "the evaluation":
            seen.append((len(executor._tasks), executor.paused))
        return real(executor, coro, limit, what, setting)

    monkeypatch.setattr(train_loop, "bounded", spy)
    cfg = small_config(model_dir, tmp_path / "run", total_steps=3, checkpoint_every=0,
                       **{"eval.every": 1, "eval.pause_rollouts": True,
                          "rollout.max_head_offpolicyness": 2})
    result = Trainer(cfg).train(reward=digit_reward)
    assert [step for step, _, _ in result.evals] == [0, 1, 2, 3]
    assert seen == [(0, True)] * 4
    assert result.steps == 3 and result.stopped_by == "total_steps"
