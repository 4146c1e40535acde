"""Every code block of the tutorials (docs/tutorials/*.md) runs as written (tests/tutorial_blocks.py
says how a block is run, shortened or skipped): yaml blocks load as run configs (default suite);
bash and python blocks run in subprocesses against random tiny models (`slow`: they train and
serve for real). A skipped block must say why."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from tutorial_blocks import ROOT, Block, blocks, with_overrides

from asyncrl.config import load_yaml
from asyncrl.launch.train_config import TrainRunConfig

BLOCKS = blocks()
KNOWN = {"yaml", "bash", "python"}


def params(langs: set[str]):
    return [pytest.param(b, id=b.id) for b in BLOCKS if b.lang in langs]


def test_every_block_is_known_and_every_skip_says_why():
    assert BLOCKS
    for b in BLOCKS:
        assert b.lang in KNOWN, f"{b.id}: a fence needs its language, one of {sorted(KNOWN)}"
        if b.directive and b.directive.startswith("skip"):
            assert len(b.skip_reason or "") > 10, f"{b.id}: a skipped block says why"


def deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = deep_merge(base[k], v) if isinstance(v, dict) and isinstance(
            base.get(k), dict) and v.get("kind", base[k].get("kind")) == base[k].get("kind") else v
    return out


@pytest.mark.parametrize("block", params({"yaml"}))
def test_a_yaml_block_is_a_valid_run_config(block: Block):
    if block.skip_reason:
        pytest.skip(block.skip_reason)
    fragment = yaml.safe_load(block.code)
    assert isinstance(fragment, dict), f"{block.id} is not a YAML mapping"
    base = load_yaml(ROOT / block.base_config)
    TrainRunConfig.from_dict(deep_merge(base, fragment), source=block.id)


@pytest.fixture(scope="module")
def env(tmp_path_factory, model_dir):
    from asyncrl.models.presets import build_preset_model

    out = tmp_path_factory.mktemp("tutorial")
    data = out / "train.jsonl"  # 100 sums as question/answer rows
    data.write_text("".join(json.dumps({"question": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(10) for b in range(10)))
    return {**os.environ, "TINY": str(model_dir), "OUT": str(out), "DATA": str(data),
            "TINY_VL": str(build_preset_model("tiny-vl", out / "tiny-vl")),
            "TINY_MOE": str(build_preset_model("tiny-moe", out / "tiny-moe")),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("block", params({"bash", "python"}))
def test_a_code_block_runs(block: Block, env, tmp_path):
    if block.skip_reason:
        pytest.skip(block.skip_reason)
    env = {**env, "OUT": str(tmp_path)}
    for name in ("configs", "examples"):  # a block runs in a scratch copy of the repository root
        (tmp_path / name).symlink_to(ROOT / name)
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(block.code)
        cmd = [sys.executable, str(script), *[re.sub(r"\$(\w+)", lambda m: env[m[1]], o)
                                              for o in block.overrides]]
    else:  # bash expands $NAME itself
        code = with_overrides(block.code, block.overrides)
        cmd = ["bash", "-euo", "pipefail", "-c", code.replace("asyncrl ", f"{sys.executable} "
                                                                          "-m asyncrl.cli ")]
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=850)
    assert run.returncode == 0, f"{block.id} failed:\n{block.code}\n{run.stdout[-2000:]}\n" \
                                f"{run.stderr[-4000:]}"


def test_overrides_go_to_each_train_command():
    code = "asyncrl build-model $OUT/m\nasyncrl train a.yaml \\\n  x=1  # note\necho done"
    assert with_overrides(code, ["total_steps=2"]).split("\n") == [
        "asyncrl build-model $OUT/m", "asyncrl train a.yaml \\", "  x=1 total_steps=2",
        "echo done"]
    assert Path(ROOT / "docs" / "tutorials").is_dir()
