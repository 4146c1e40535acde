"""`asyncrl train --print-config`: every field with its value, default and description."""

from __future__ import annotations

import subprocess
import sys

import pydantic
import pytest

from asyncrl.config import Config
from asyncrl.config_docs import describe_field, format_config, walk_fields
from asyncrl.launch.sft_config import SFTRunConfig
from asyncrl.launch.train_config import TrainRunConfig


class _Documented(Config):
    # the comment block above
    # spans two lines
    above: int = 1
    inline: str = "x"  # the line's own comment
    field: float = pydantic.Field(0.5, ge=0.0, le=1.0, description="from Field")  # not this
    mode: str = "a"


def test_descriptions_come_from_field_then_comments_and_name_the_allowed_values():
    assert describe_field(_Documented, "above") == "the comment block above spans two lines"
    assert describe_field(_Documented, "inline") == "the line's own comment"
    assert describe_field(_Documented, "field") == "from Field (range: >= 0.0, <= 1.0)"
    assert describe_field(_Documented, "mode") == ""
    assert "allowed: \"float32\" | \"bfloat16\" | \"float16\"" in describe_field(
        TrainRunConfig.model_fields["model"].annotation, "dtype")


# The default config and the other members of its unions (data, workflow, inference.remote):
# the help a user gets must not have holes, so a new field without a description fails here.
VARIANTS = [
    [],
    ["workflow.kind=agent", "workflow.path=tests.agents_for_tests:SumAgent"],
    ["workflow.kind=multi_turn"],
    ["workflow.path=tests.user_plugins:make_workflow"],
    ["workflow.kind=command", "workflow.argv=[python, agent.py]"],
    ["workflow.kind=agent_env", "workflow.agent=a.b:Agent", "workflow.env=a.b:Env"],
    ["data.kind=chain"],
    ["data.kind=gsm8k", "data.path=x.jsonl"],
    ["data.kind=jsonl", "data.path=x.jsonl"],
    ["inference.mode=remote", "inference.remote.addresses=[http://h:1]"],
]


@pytest.mark.parametrize("overrides", VARIANTS, ids=lambda o: o[0] if o else "defaults")
def test_every_train_field_has_a_description(overrides):
    cfg = TrainRunConfig.load(None, overrides)
    missing = [d.key for d in walk_fields(cfg)
               if not d.description or d.description.startswith(("allowed:", "range:"))]
    assert missing == [], f"fields without a description (add a comment next to them): {missing}"


def test_every_sft_field_has_a_description():
    missing = [d.key for d in walk_fields(SFTRunConfig()) if not d.description]
    assert missing == []


def test_nested_defaults_are_the_run_configs_own():
    """rollout.batch_size defaults to 16 in TrainRunConfig (RolloutConfig's own default differs):
    the default shown is the one the run would get without the override."""
    docs = {d.key: d for d in walk_fields(TrainRunConfig.load(None, ["rollout.batch_size=8"]))}
    assert (docs["rollout.batch_size"].value, docs["rollout.batch_size"].default) == (8, 16)
    assert docs["gconfig.n_samples"].default == 8
    text = format_config(TrainRunConfig.load(None, ["rollout.batch_size=8"]))
    assert "rollout.batch_size = 8   (default 16)" in text
    assert "\nseed = 0\n" in text  # unchanged values show no default


def test_cli_prints_the_config_and_exits_without_training(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "train", "--print-config", "train.optimizer.lr=1e-4",
         f"output_dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "train.optimizer.lr = 0.0001   (default 1e-06)" in out.stdout
    assert "AdamW peak learning rate" in out.stdout
    assert "inference.weight_sync = \"auto\"" in out.stdout
    assert not (tmp_path / "run").exists()
    bad = subprocess.run([sys.executable, "-m", "asyncrl.cli", "train", "--print-config",
                          "train.optimizer.lrr=1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "did you mean 'lr'" in bad.stderr
