"""The trainer's seams, used as a researcher would: a workflow, an evaluation and a loss written
outside the package (tests/user_plugins.py, public API only), handed to `Trainer` as objects and
as dotted paths from a config. A few real training steps each (in-process engine, tiny model)."""

import json
from pathlib import Path

import pytest
import user_plugins
from test_train_loop import small_config

from asyncrl import Trainer
from asyncrl.config import ConfigError
from asyncrl.errors import UserError
from asyncrl.models.loading import load_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")


def rows(run_dir):
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def test_workflow_object_and_own_evaluation_train_three_steps(model_dir, tmp_path):
    workflow = user_plugins.OddFirstTokenWorkflow(load_tokenizer(model_dir), n=4)
    cfg = small_config(model_dir, tmp_path / "run", **{"eval.every": 3})
    result = Trainer(cfg).train(workflow=workflow,
                                eval_workflow=user_plugins.GreedyOddEval(load_tokenizer(model_dir)))
    assert result.steps == 3 and result.stopped_by == "total_steps"
    steps = [m for m in rows(tmp_path / "run") if "reward/mean" in m]
    assert [m["policy/version"] for m in steps] == [1.0, 2.0, 3.0]
    assert steps[-1]["user/episodes"] >= 12  # the workflow's own metrics, logged every step
    evals = [m for m in rows(tmp_path / "run") if "eval/odd_share" in m]
    assert len(evals) == 2  # before training and at step 3, by the given evaluation
    assert result.initial_accuracy == evals[0]["eval/odd_share"]


def test_dotted_paths_from_the_config_train_with_a_user_loss(model_dir, tmp_path):
    user_plugins.ScaledReinforce.calls = 0
    cfg = small_config(model_dir, tmp_path / "run", **{
        "workflow": {"path": "user_plugins:make_workflow", "kwargs": {"n": 2}},
        "actor.loss": "user_plugins:ScaledReinforce", "actor.loss_kwargs": {"scale": 0.5},
        "eval.every": 3})
    assert cfg.workflow.kind == "custom"
    result = Trainer(cfg).train()
    assert result.steps == 3
    steps = [m for m in rows(tmp_path / "run") if "reward/mean" in m]
    assert all("user/loss_calls" in m and "ppo/clip_frac" not in m for m in steps)
    assert user_plugins.ScaledReinforce.calls >= 3
    assert [m["batch/samples"] for m in steps] == [8.0] * 3  # 4 groups of n=2
    # no aevaluate on this workflow: one episode per held-out row, mean reward
    evals = [m for m in rows(tmp_path / "run") if "eval/reward" in m]
    assert len(evals) == 2 and 0.0 <= evals[-1]["eval/reward"] <= 1.0


def test_a_factory_function_passed_as_an_object(model_dir, tmp_path):
    """`make_workflow(tokenizer, n=4)` requires only context names: a factory (called with the
    tokenizer), not a reward function (which requires the completion and the row)."""
    cfg = small_config(model_dir, tmp_path / "run", **{"total_steps": 1, "eval.every": 0})
    assert Trainer(cfg).train(workflow=user_plugins.make_workflow).steps == 1
    steps = [m for m in rows(tmp_path / "run") if "reward/mean" in m]
    assert steps[0]["user/episodes"] >= 4  # the factory's workflow ran, with its own metrics


def test_bad_plugins_are_one_line_errors(model_dir, tmp_path):
    cfg = small_config(model_dir, tmp_path / "run")
    with pytest.raises(UserError, match="has no 'nope'"):
        Trainer(cfg).train(workflow="user_plugins:nope")
    with pytest.raises(UserError, match="expected a RolloutWorkflow"):
        Trainer(cfg).train(workflow=42)
    with pytest.raises(ConfigError, match="actor.loss_kwargs"):
        small_config(model_dir, tmp_path / "k", **{"actor.loss_kwargs": {"scale": 2}})
    with pytest.raises(ConfigError, match="workflow.path"):
        small_config(model_dir, tmp_path / "k", workflow={"kind": "custom"})
    with pytest.raises(UserError, match="actor.loss"):
        Trainer(cfg).train(workflow=user_plugins.OddFirstTokenWorkflow(load_tokenizer(model_dir)),
                           loss="user_plugins:nope")
