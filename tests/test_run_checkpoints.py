"""The checkpoint layout's lookups (asyncrl.launch.run_checkpoints), without training anything."""

import pytest

from asyncrl.errors import UserError
from asyncrl.launch.run_checkpoints import (
    LATEST,
    STATE,
    _prune,
    latest_checkpoint,
    latest_step_dir,
    step_dir,
    step_dirs,
)


def make_step(run, step, complete=True):
    path = step_dir(run, step)
    path.mkdir(parents=True)
    if complete:
        (path / STATE).write_text("{}")
    return path


def test_step_dirs_are_ordered_by_step_and_skip_half_written_saves(tmp_path):
    for step in (1_000_000, 50, 999_999):
        make_step(tmp_path, step)
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / ".step_000300.tmp").mkdir()
    (checkpoints / "step_notanumber").mkdir()
    assert [p.name for p in step_dirs(checkpoints)] == [
        "step_000050", "step_999999", "step_1000000"]
    assert step_dirs(tmp_path / "missing") == []
    _prune(checkpoints, keep=2)
    assert [p.name for p in step_dirs(checkpoints)] == ["step_999999", "step_1000000"]


def test_resume_takes_latest_else_the_newest_complete_checkpoint(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    with pytest.raises(UserError, match="no checkpoint found under"):
        latest_checkpoint(tmp_path)
    make_step(tmp_path, 10)
    twenty = make_step(tmp_path, 20)
    make_step(tmp_path, 30, complete=False)  # e.g. a rank died before state.json
    assert latest_checkpoint(tmp_path) == twenty
    (checkpoints / LATEST).write_text("step_000010\n")
    assert latest_checkpoint(tmp_path) == step_dir(tmp_path, 10)
    (checkpoints / LATEST).write_text("step_000099\n")  # stale: resume goes on from what is there
    assert latest_checkpoint(tmp_path) == twenty


def test_latest_step_dir_for_eval_is_strict_about_latest(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    assert latest_step_dir(checkpoints) is None
    make_step(tmp_path, 5, complete=False)
    assert latest_step_dir(checkpoints) == step_dir(tmp_path, 5)
    (checkpoints / LATEST).write_text("")
    with pytest.raises(UserError, match="names '', which is not a directory"):
        latest_step_dir(checkpoints)
