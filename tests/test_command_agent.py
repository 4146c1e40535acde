"""Command agents (`workflow: {kind: command}`) and the Agent + Environment from config
(`workflow: {kind: agent_env}`), trained through `Trainer` with the in-process engine: real
subprocesses talking to the real proxy with the openai and anthropic SDKs; hanging, flooding,
failing and child-leaving programs are ended and rejected with their reason."""

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import pytest

from asyncrl import Trainer
from asyncrl.api import EpisodeRejected
from asyncrl.launch.train import TrainRunConfig
from asyncrl.proxy.command_agent import CommandAgent, CommandAgentError, CommandLimits
from tests.test_train_loop import metrics, small_config

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).parent.parent
AGENT = str(ROOT / "examples" / "command_agent" / "agent.py")


def run(agent: CommandAgent, data=None, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(agent.run(data or {"id": 1}, "http://127.0.0.1:9/v1",
                                                  "sk-test"), timeout))


def script(tmp_path, name: str, body: str) -> list[str]:
    path = tmp_path / name
    path.write_text(body)
    return [sys.executable, str(path)]


def test_the_program_gets_the_session_and_the_row_and_its_stdout_is_the_reward(tmp_path):
    argv = script(tmp_path, "echo.py", """
import json, os, sys
row = json.load(sys.stdin)
print("log line")
print(json.dumps({"env": [os.environ[k] for k in ("OPENAI_BASE_URL", "OPENAI_API_KEY",
      "ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY", "EXTRA")], "row": row}), file=sys.stderr)
print(0.5 if row["id"] == 7 else 0)
""")
    assert run(CommandAgent(argv, env={"EXTRA": "x"}), {"id": 7}) == 0.5
    per_id = script(tmp_path, "ids.py", 'print(\'{"cmpl-1": 1.0, "cmpl-2": 0.0}\')')
    assert run(CommandAgent(per_id)) == {"cmpl-1": 1.0, "cmpl-2": 0.0}
    assert run(CommandAgent(per_id, reward="reward_fn")) is None


@pytest.mark.parametrize("body, kind", [
    ("import sys; sys.exit(3)", "exit_code"),
    ("print('no number here')", "no_reward"),
    ("import sys\nwhile True: sys.stdout.write('x' * 65536)", "output_limit"),
    ("import subprocess, sys\n"
     "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\nprint(1)",
     "left_children"),
])
def test_failures_are_named_and_nothing_is_left_running(tmp_path, body, kind):
    marker = f"asyncrl-marker-{kind}"
    argv = script(tmp_path, f"{marker}.py", body)
    with pytest.raises(CommandAgentError) as err:
        run(CommandAgent(argv, max_output_bytes=1 << 20))
    assert err.value.kind == kind, err.value
    _gone(marker)


def _gone(marker: str) -> None:
    """Wait until no process of `marker` is left (SIGKILL lands at once; the kernel tears the
    process down asynchronously)."""
    deadline = time.monotonic() + 30
    while _running(marker):
        assert time.monotonic() < deadline, f"a process of {marker} outlived its agent"
        time.sleep(0.1)


def test_a_hanging_program_is_killed_with_its_children_on_timeout(tmp_path):
    marker = "asyncrl-marker-hang"
    argv = script(tmp_path, f"{marker}.py",
                  "import subprocess, sys, time\n"
                  "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                  "time.sleep(60)\n")
    with pytest.raises((TimeoutError, asyncio.TimeoutError)):
        run(CommandAgent(argv), timeout=3)
    _gone(marker)


def test_limits_are_set_in_the_program(tmp_path):
    argv = script(tmp_path, "limits.py",
                  "import resource\nprint(resource.getrlimit(resource.RLIMIT_FSIZE)[0])")
    got = run(CommandAgent(argv, limits=CommandLimits(max_file_bytes=12345)))
    assert got == 12345


def _running(marker: str) -> bool:
    """Whether any process's command line names `marker` (the script, or its child's parent)."""
    for pid in os.listdir("/proc"):
        if pid.isdigit() and pid != str(os.getpid()):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            if marker.encode() in cmdline and ") Z " not in stat:
                return True
    return False


def command_config(model_dir, out, **over):
    return small_config(model_dir, out, **{
        "workflow": {"kind": "command", "argv": [sys.executable, AGENT], "timeout_s": 60},
        "gconfig.max_new_tokens": 8, "total_steps": 2, "eval.every": 0,
        "rollout.batch_size": 2, "gconfig.n_samples": 2, **over})


@pytest.mark.slow  # (a minute on a busy 2-core machine; the default suite's refusals stay)
@pytest.mark.parametrize("anthropic", [False, True], ids=["openai", "anthropic"])
def test_the_example_command_agent_trains(model_dir, tmp_path, anthropic):
    argv = [sys.executable, AGENT] + (["--anthropic"] if anthropic else [])
    cfg = command_config(model_dir, tmp_path / "run", **{"workflow.argv": argv})
    result = Trainer(cfg).train()
    assert result.steps == 2
    steps = [m for m in metrics(tmp_path / "run") if "reward/mean" in m]
    assert all(m["batch/samples"] == 4.0 for m in steps), steps
    assert all(m["proxy/completions"] >= 4 for m in steps)


def test_reward_fn_scores_the_sessions_last_reply(model_dir, tmp_path):
    cfg = command_config(model_dir, tmp_path / "fn", **{
        "workflow.reward": "reward_fn", "reward": "exact"})
    assert Trainer(cfg).train().steps == 2
    with pytest.raises(ValueError, match="argv"):
        TrainRunConfig.from_dict({"workflow": {"kind": "command", "argv": []}})


def test_a_failing_command_episode_is_rejected_with_its_kind(model_dir, tmp_path):
    """The agent workflow turns a CommandAgentError into a rejected episode named by kind."""
    from asyncrl.inference.async_engine import AsyncLLMEngine
    from asyncrl.inference.engine import EngineConfig
    from asyncrl.models.loading import load_tokenizer
    from asyncrl.proxy.config import AgentConfig
    from asyncrl.proxy.server import ProxyServer
    from asyncrl.proxy.workflow import AgentWorkflow

    engine = AsyncLLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=128))
    tok = load_tokenizer(model_dir)
    wf = AgentWorkflow(CommandAgent([sys.executable, "-c", "print('?')"]),
                       ProxyServer(engine, tok), AgentConfig())

    async def go():
        try:
            with pytest.raises(EpisodeRejected, match="last stdout line is"):
                await wf.arun_episode(engine, {"id": 3, "messages": [], "answer": 1})
        finally:
            await wf.aclose()

    try:
        asyncio.run(go())
    finally:
        engine.shutdown()
    assert wf.metrics()["agent/rejected_command_no_reward"] == 1.0


def test_agent_env_from_config_trains(model_dir, tmp_path):
    cfg = small_config(model_dir, tmp_path / "env", **{
        "workflow": {"kind": "agent_env", "agent": "asyncrl.rollout.arithmetic_env:ChatAgent",
                     "env": "examples.agent_env.env:SingleStepTaskEnv", "max_steps": 1},
        "reward": "exact", "total_steps": 2, "eval.every": 0})
    assert Trainer(cfg).train().steps == 2
    steps = [m for m in metrics(tmp_path / "env") if "reward/mean" in m]
    assert all(m["batch/samples"] == 16.0 for m in steps)  # 4 groups x 4 one-step episodes


def test_example_configs_validate():
    for name, kind in [("command_agent", "command"), ("agent_env", "agent_env")]:
        cfg = TrainRunConfig.load(str(ROOT / "examples" / name / "train.yaml"), [])
        assert cfg.workflow.kind == kind
    with pytest.raises(ValueError, match="env"):
        TrainRunConfig.from_dict({"workflow": {"kind": "agent_env", "agent": "a:b"}})
    assert json.dumps(CommandLimits(cpu_seconds=2).rlimits()) == '{"RLIMIT_CPU": 2}'


@pytest.mark.slow
@pytest.mark.parametrize("example", ["agent_env", "command_agent"])
def test_the_examples_train_through_asyncrl_train(model_dir, tmp_path, example):
    """`asyncrl train examples/<example>/train.yaml` as a user runs it (a subprocess from the
    repository root), shortened to 2 steps on the tiny model."""
    import subprocess

    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "train", f"examples/{example}/train.yaml",
         f"model.path={model_dir}", "total_steps=2", "eval.every=0", "gconfig.n_samples=2",
         "rollout.batch_size=2", "gconfig.max_new_tokens=6", "max_train_seconds=null",
         "filter_uniform_groups=false",  # the untrained tiny model earns 0 everywhere
         f"output_dir={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, ASYNCRL_CACHE=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [m for m in metrics(out) if "reward/mean" in m]
    assert [m["policy/version"] for m in steps] == [1.0, 2.0]
