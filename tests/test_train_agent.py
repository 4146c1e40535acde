"""`asyncrl train` with agent workflows: the agent program, the proxy and the trainer together
(in-process engine, tiny model, a few steps), plus the example agents' configs."""

import logging
from pathlib import Path

import pytest

from asyncrl import Trainer
from asyncrl.launch.train import TrainRunConfig
from tests import agents_for_tests as agents
from tests.test_train_loop import metrics, small_config

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).parent.parent


def agent_config(model_dir, out, **over):
    over = {"workflow": {"kind": "agent", "path": "tests.agents_for_tests:DigitAgent"}, **over}
    return small_config(model_dir, out, **over)


def test_agent_job_trains_and_survives_a_flaky_agent(model_dir, tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    cfg = agent_config(model_dir, tmp_path / "run")
    result = Trainer(cfg).train(workflow=agents.DigitAgent(fail_every=5))
    assert result.steps == 3 and result.stopped_by == "total_steps"
    rows = metrics(tmp_path / "run")
    steps = [m for m in rows if "reward/mean" in m]
    assert [m["policy/version"] for m in steps] == [1.0, 2.0, 3.0]
    # 4 groups x 4 agent runs, minus the rejected runs (a group keeps its survivors)
    assert all(8.0 <= m["batch/samples"] <= 16.0 for m in steps)
    assert steps[-1]["agent/rejected_error"] >= 1  # the flaky runs were rejected ...
    assert "flaky agent failure" in caplog.text  # logged (once in full, then summarised)
    evals = [m for m in rows if "eval/agent_reward" in m]
    assert len(evals) >= 2 and 0.0 <= evals[-1]["eval/agent_reward"] <= 1.0
    assert (tmp_path / "run" / "plot.png").is_file()


def test_agent_by_dotted_path_in_subprocesses(model_dir, tmp_path):
    cfg = agent_config(model_dir, tmp_path / "sub", **{
        "workflow.path": "tests.agents_for_tests:SyncEnvAgent", "workflow.mode": "subproc",
        "workflow.subproc_max_workers": 2, "total_steps": 1, "eval.every": 0,
        "rollout.batch_size": 2, "gconfig.n_samples": 2})
    result = Trainer(cfg).train()
    assert result.steps == 1
    (step,) = [m for m in metrics(tmp_path / "sub") if "reward/mean" in m]
    assert step["reward/mean"] == 0.25 and step["batch/samples"] == 4.0


def test_agent_config_errors_are_one_line(model_dir, tmp_path):
    from asyncrl.errors import UserError

    cfg = agent_config(model_dir, tmp_path / "e", **{"workflow.path": None})
    with pytest.raises(UserError, match="workflow.kind=agent needs workflow.path"):
        Trainer(cfg).train()
    cfg = agent_config(model_dir, tmp_path / "f", **{"workflow.path": "tests.agents_for_tests:NotAnAgent"})
    with pytest.raises(UserError, match="must define `async def run"):
        Trainer(cfg).train()
    with pytest.raises(ValueError, match="mode"):
        TrainRunConfig.from_dict({"workflow": {"kind": "agent", "mode": "thread"}})


def test_example_agent_configs_validate():
    for name in ("math_agent", "retry_agent", "tool_agent", "agents_sdk", "langchain_agent"):
        path = ROOT / "examples" / name / "train.yaml"
        if path.is_file():
            cfg = TrainRunConfig.load(str(path), [])
            assert cfg.workflow.kind == "agent"
