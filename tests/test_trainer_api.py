"""The trainer's seams, used as a researcher would: a workflow, an evaluation and a loss written
outside the package (tests/user_plugins.py, public API only), handed to `Trainer` as objects and
as dotted paths from a config; and a reward and an inference backend registered from a file
outside the package (tests/plugin_kinds.py) and named by a config. A few real training steps
each (tiny model)."""

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
        "actor.loss": {"path": "user_plugins:ScaledReinforce", "kwargs": {"scale": 0.5}},
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


def test_objects_given_in_python_train(model_dir, tmp_path):
    """A workflow a factory made, a loss object and a reward function, passed to `train`."""
    user_plugins.ScaledReinforce.calls = 0
    cfg = small_config(model_dir, tmp_path / "run", **{"total_steps": 1, "eval.every": 0})
    workflow = user_plugins.make_workflow(load_tokenizer(model_dir), n=2)
    result = Trainer(cfg).train(workflow=workflow, loss=user_plugins.ScaledReinforce(0.5))
    assert result.steps == 1 and user_plugins.ScaledReinforce.calls >= 1
    steps = [m for m in rows(tmp_path / "run") if "reward/mean" in m]
    assert steps[0]["user/episodes"] >= 4  # the factory's workflow ran, with its own metrics
    rewarded = []

    def reward(completion, row):  # a reward function drives the config's built-in workflow
        rewarded.append(completion)
        return float(len(completion) % 2)

    cfg = small_config(model_dir, tmp_path / "run2", **{"total_steps": 1, "eval.every": 0})
    assert Trainer(cfg).train(reward=reward).steps == 1 and rewarded


def test_bad_plugins_are_one_line_errors(model_dir, tmp_path):
    cfg = small_config(model_dir, tmp_path / "run")
    with pytest.raises(UserError, match="has no 'nope'"):
        Trainer(small_config(model_dir, tmp_path / "p", workflow={"path": "user_plugins:nope"})
                ).train()
    with pytest.raises(UserError, match="expected a RolloutWorkflow"):
        Trainer(cfg).train(workflow=42)
    with pytest.raises(UserError, match="a reward function goes to Trainer.train"):
        Trainer(cfg).train(workflow=lambda completion, row: 1.0)
    with pytest.raises(ConfigError, match="unknown key 'actor.loss_kwargs'"):
        small_config(model_dir, tmp_path / "k", **{"actor.loss_kwargs": {"scale": 2}})
    with pytest.raises(ConfigError, match="missing required key 'path'"):
        small_config(model_dir, tmp_path / "k", workflow={"kind": "custom"})
    with pytest.raises(UserError, match="actor.loss"):
        Trainer(small_config(model_dir, tmp_path / "l", **{"actor.loss": "user_plugins:nope"})
                ).train(workflow=user_plugins.OddFirstTokenWorkflow(load_tokenizer(model_dir)))
    with pytest.raises(UserError, match="not a PolicyLoss"):
        Trainer(cfg).train(workflow=user_plugins.OddFirstTokenWorkflow(load_tokenizer(model_dir)),
                           loss=lambda logprobs, inputs, normalizer: (logprobs.sum(), {}))


def test_a_reward_and_a_backend_registered_outside_the_package_train(model_dir, tmp_path):
    """`plugins: [plugin_kinds]` registers a reward kind and a backend kind (tests/plugin_kinds.py);
    the config names both; the job starts the backend's servers with the command it writes,
    pushes weights the way it declares (disk: no HTTP tensors), and trains on its reward."""
    import plugin_kinds

    def over(**more):
        return {"plugins": ["plugin_kinds"], "reward": {"kind": "digit_share", "weight": 2.0},
                "inference": {"mode": "local", "backend": "polling",
                              "engine": {"max_num_seqs": 32}},
                "total_steps": 2, "eval.every": 0, **more}

    cfg = small_config(model_dir, tmp_path / "run", **over())
    assert cfg.inference.sync_kind == "disk"  # derived from the backend's declaration
    assert Trainer(cfg).train().steps == 2
    steps = [m for m in rows(tmp_path / "run") if "reward/mean" in m]
    assert [m["policy/version"] for m in steps] == [1.0, 2.0]
    assert all(0.0 <= m["reward/mean"] <= 2.0 for m in steps)
    assert (tmp_path / "run" / "weights" / "v2" / "config.json").is_file()  # pushed as a dir
    assert plugin_kinds.PollingBackendConfig.commands[-1][1:4] == ["-m", "asyncrl.cli", "serve"]
    # what the backend does not declare is refused when the config loads, naming what it allows
    with pytest.raises(ConfigError, match="weight_sync='tensors' is not supported by backend "
                                          "'polling'; allowed: auto, disk"):
        small_config(model_dir, tmp_path / "x", **over(**{"inference.weight_sync": "tensors"}))
    with pytest.raises(ConfigError, match="allowed backends: asyncrl, vllm"):
        small_config(model_dir, tmp_path / "y", **over(**{"train.lora": {"r": 4}}))
