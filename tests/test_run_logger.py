"""Run directory logger (metrics.jsonl, TensorBoard, W&B offline), the plot, and the progress view."""

import io
import json
import math
import struct
import sys
import time

import numpy as np
import pytest
import torch
from rich.console import Console

from asyncrl.errors import UserError
from asyncrl.launch.progress import TrainProgress, format_duration
from asyncrl.launch.run_logger import LoggingConfig, RunLogger, plot_metrics

NO_TB = LoggingConfig(tensorboard=False, plot=True)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def step_metrics(step):
    metrics = {"reward/mean": 0.1 * step, "staleness/mean": 0.5, "staleness/max": 2,
               "perf/gen_tokens_per_s": 1000.0 + step, "perf/train_tokens_per_s": 400,
               "time/elapsed_s": 30.0 * step, "policy/version": step}
    if step % 2 == 0:
        metrics["eval/greedy_accuracy"] = 0.2 + 0.05 * step
        metrics["eval/pass@4"] = 0.5
    return metrics


def png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # IHDR width, height


def test_metrics_jsonl_is_flushed_per_line_and_cleaned(tmp_path):
    logger = RunLogger(tmp_path / "run", NO_TB)
    logger.log(1, {"reward/mean": 0.5, "n": 3, "np": np.float32(0.25), "t": torch.tensor(2.0),
                   "nan": float("nan"), "inf": -math.inf, "note": "hi", "none": None,
                   "flag": True, "list": [1, 2], "big": torch.ones(3), "obj": object()})
    # readable before close: a crash after this line loses nothing
    (record,) = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert record == {"step": 1, "reward/mean": 0.5, "n": 3.0, "np": 0.25, "t": 2.0, "nan": None,
                      "inf": None, "note": "hi", "none": None, "flag": 1.0}
    assert isinstance(record["n"], float)
    logger.log(2, {"reward/mean": 0.75, "step": 99})
    logger.close()
    logger.close()  # idempotent
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert list(records[1]) == ["step", "reward/mean"]


def test_log_every_skips_off_grid_steps_but_keeps_eval(tmp_path):
    with RunLogger(tmp_path, LoggingConfig(tensorboard=False, log_every=5)) as logger:
        written = [logger.log(s, {"reward/mean": 1.0}) for s in range(1, 11)]
        assert logger.log(7, {"eval/greedy_accuracy": 0.5})
        assert logger.log(8, {"reward/mean": 1.0}, force=True)
    assert written == [s % 5 == 0 for s in range(1, 11)]
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [5, 10, 7, 8]


def test_config_validation():
    with pytest.raises(UserError, match="plot_every"):
        LoggingConfig.from_dict({"plot_every": 0})
    with pytest.raises(UserError, match="wandb"):
        LoggingConfig.from_dict({"wandb": "yes"})
    with pytest.raises(UserError, match="did you mean 'tensorboard'"):
        LoggingConfig.from_dict({"tensorbord": True})


def test_resume_truncates_later_steps_and_fresh_run_replaces(tmp_path):
    with RunLogger(tmp_path, NO_TB) as logger:
        for s in range(1, 8):
            logger.log(s, {"reward/mean": float(s)})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 8, "rew')  # torn line of a crashed run
    with RunLogger(tmp_path, NO_TB, resume_step=4) as logger:
        logger.log(5, {"reward/mean": 50.0})
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 3.0),
                                                                (4, 4.0), (5, 50.0)]
    assert not list(tmp_path.glob(".metrics.jsonl.*"))  # no temp file left behind
    with RunLogger(tmp_path, NO_TB, resume_step=None) as logger:
        logger.log(1, {"reward/mean": -1.0})
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "reward/mean": -1.0}]


def _tb_scalars(log_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_scalars_and_resume_purge(tmp_path):
    cfg = LoggingConfig(plot=False)
    with RunLogger(tmp_path, cfg) as logger:
        for s in range(1, 6):
            logger.log(s, {"reward/mean": float(s), "note": "text is not a scalar"})
    scalars = _tb_scalars(tmp_path / "tensorboard", "reward/mean")
    assert scalars == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 5.0)]
    with RunLogger(tmp_path, cfg, resume_step=3) as logger:
        logger.log(4, {"reward/mean": 40.0})
    assert _tb_scalars(tmp_path / "tensorboard", "reward/mean") == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]


def test_wandb_offline_writes_run_files_and_keeps_id_on_resume(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is an optional dependency (the test extra has it)")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")  # belt and braces: no network here
    cfg = LoggingConfig(tensorboard=False, plot=False, wandb="offline", wandb_run_name="t")
    with RunLogger(tmp_path, cfg, config={"lr": 1e-3}) as logger:
        logger.log(1, {"reward/mean": 0.5, "note": "skipped for W&B"})
        logger.log(2, {"reward/mean": float("nan")})
    run_id = (tmp_path / "wandb_id.txt").read_text().strip()
    runs = list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(runs) == 1
    assert (runs[0] / f"run-{run_id}.wandb").stat().st_size > 0
    with RunLogger(tmp_path, cfg, resume_step=2) as logger:
        logger.log(3, {"reward/mean": 0.7})
    assert (tmp_path / "wandb_id.txt").read_text().strip() == run_id
    with RunLogger(tmp_path, cfg) as logger:  # a fresh run gets its own id
        pass
    assert (tmp_path / "wandb_id.txt").read_text().strip() != run_id


def test_missing_wandb_is_a_user_error_at_construction(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    cfg = LoggingConfig(tensorboard=False, wandb="offline")
    with pytest.raises(UserError) as err:
        RunLogger(tmp_path / "run", cfg)
    assert str(err.value) == "logging.wandb='offline' needs the wandb package: pip install wandb"
    assert not (tmp_path / "run").exists()  # failed before writing anything
    RunLogger(tmp_path / "run", LoggingConfig(tensorboard=False)).close()  # off: no import


def test_plot_full_data_and_missing_series(tmp_path):
    with RunLogger(tmp_path / "full", NO_TB) as logger:
        for s in range(1, 31):
            logger.log(s, step_metrics(s))
        out = logger.plot()
    assert out == tmp_path / "full" / "plot.png"
    width, height = png_size(out)
    assert width > 600 and height > 300 and out.stat().st_size > 10_000
    assert not list((tmp_path / "full").glob(".plot.png.*"))

    with RunLogger(tmp_path / "sparse", NO_TB) as logger:  # no eval, no elapsed time, no staleness
        logger.log(1, {"reward/mean": 0.1, "note": "x"})
        logger.log(2, {"reward/mean": None})
        sparse = logger.plot()
    assert png_size(sparse) == (width, height)
    empty = plot_metrics(tmp_path / "missing.jsonl", tmp_path / "sub" / "empty.png")
    assert png_size(empty) == (width, height)
    assert RunLogger(tmp_path / "off", LoggingConfig(tensorboard=False, plot=False)).plot() is None


def test_progress_plain_lines_on_non_terminal():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=False, width=60)
    with TrainProgress(total_steps=4, max_seconds=600, console=console, print_every=3) as progress:
        assert not progress.live_mode
        for s in range(1, 5):
            progress.update(s, step_metrics(s))
            if s == 2:
                progress.message("eval at step 2: 30.0% [done]")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 3, lines  # step 3 (grid), the message, step 4 (last step)
    assert lines[0] == "eval at step 2: 30.0% [done]"
    step3, step4 = lines[1], lines[2]
    for field in ("step 3/4", "elapsed 1m30s", "reward 0.300", "eval 30.0% @2",
                  "staleness 0.50/2", "gen 1,003 tok/s", "train 400 tok/s", "version 3", "eta "):
        assert field in step3, (field, step3)
    assert "step 4/4" in step4 and "eval 40.0% @4" in step4 and "eta 0m00s" in step4


def test_progress_eta_uses_whichever_ends_first():
    progress = TrainProgress(total_steps=100, max_seconds=None,
                             console=Console(file=io.StringIO(), force_terminal=False))
    assert progress.eta() is None  # no rate yet, no budget
    progress._history.clear()
    progress._history.extend([(0.0, 0), (10.0, 10)])  # 1 step/s
    progress.step = 10
    progress._updated_at = time.monotonic()
    assert 85 <= progress.eta() <= 90
    progress.max_seconds = 60
    progress._values = {"elapsed": 30.0}
    assert 25 <= progress.eta() <= 30  # the budget ends first
    assert format_duration(3725) == "1h02m05s" and format_duration(None) == "?"


def test_progress_live_panel_on_terminal():
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=100)

    with TrainProgress(total_steps=10, max_seconds=None, console=console) as progress:
        assert progress.live_mode
        start = time.perf_counter()
        for s in range(1, 101):
            progress.update(s % 10 + 1, step_metrics(s))
        per_update = (time.perf_counter() - start) / 100
        progress.message("eval at step 2: 41.0%")
        console.print(progress.__rich__())
    assert per_update < 1e-2  # a few microseconds idle; only a long stall fails it
    out = buf.getvalue()
    for text in ("asyncrl train", "eval at step 2: 41.0%", "reward", "staleness", "tok/s"):
        assert text in out
    unknown = TrainProgress(total_steps=None, console=console)  # pulsing bar, no ETA
    console.print(unknown.__rich__())
