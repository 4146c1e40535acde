"""The checkpoint layout's lookups (asyncrl.launch.run_checkpoints), and the run checkpointer
saving and restoring every registered part through its state_dict / load_state_dict."""

import json

import pytest
import torch

from asyncrl.errors import UserError
from asyncrl.launch.data_stream import DataStream
from asyncrl.launch.run_checkpoints import (
    LATEST,
    SUMMARY,
    LoopState,
    PolicyExport,
    RunCheckpointer,
    _prune,
    latest_checkpoint,
    step_dir,
    step_dirs,
)


def make_step(run, step, complete=True):
    path = step_dir(run, step)
    path.mkdir(parents=True)
    if complete:
        (path / SUMMARY).write_text("{}")
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


def test_every_registered_part_is_saved_and_restored(tmp_path):
    """A policy engine (sharded part), the loop's counters and the data stream (plain parts),
    registered once: `save` writes them with the policy export, `load` puts them back into
    fresh parts, and `latest` names the checkpoint."""
    from asyncrl.models.loading import load_causal_lm, load_tokenizer
    from asyncrl.models.tiny import build_tiny_model
    from conftest import TINY, make_samples
    from asyncrl.train.engine import HFTrainEngine, sft_token_loss

    model_dir = build_tiny_model(TINY, tmp_path / "tiny")
    tok = load_tokenizer(model_dir)

    def parts():
        engine = HFTrainEngine(load_causal_lm(model_dir))
        stream = DataStream([{"id": i} for i in range(5)], seed=1)
        return engine, LoopState(), stream

    engine, loop, stream = parts()
    engine.train_batch(make_samples([6, 9]), sft_token_loss)
    engine.version.advance()
    loop.step, loop.train_seconds = 1, 2.5
    [next(stream) for _ in range(3)]
    saver = RunCheckpointer(tmp_path / "run", engine.parallel, {"trainer": engine},
                            {"loop": loop, "data": stream}, PolicyExport(engine, tok))
    ckpt = saver.save(1)
    assert (ckpt / "policy" / "config.json").is_file()
    assert json.loads((ckpt / SUMMARY).read_text())["data"] == {"position": 3}
    assert latest_checkpoint(tmp_path / "run") == ckpt

    engine2, loop2, stream2 = parts()
    RunCheckpointer(tmp_path / "run", engine2.parallel, {"trainer": engine2},
                    {"loop": loop2, "data": stream2}).load(ckpt)
    assert (loop2.step, loop2.train_seconds, stream2.position) == (1, 2.5, 3)
    assert engine2.version.value == 1 and engine2.step == 1
    for a, b in zip(engine.model.parameters(), engine2.model.parameters()):
        assert torch.equal(a, b)
    assert next(stream2) == next(stream)  # the stream goes on where it stopped
