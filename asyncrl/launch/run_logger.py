"""The run directory's record of training: metrics.jsonl, TensorBoard, optional W&B, and a plot.

`RunLogger.log(step, metrics)` appends one JSON line (flushed, so a crash loses nothing), writes
TensorBoard scalars and, when enabled, W&B. On resume the metrics file is cut back to the resumed
step and TensorBoard is told to purge later events, so the curve continues without duplicate steps.
`plot_metrics` turns a metrics.jsonl into a PNG of reward / eval accuracy / staleness against steps
and wall time; it reads only the file, so it also works on a finished or crashed run.

Heavy imports (TensorBoard, wandb, matplotlib) happen only when the feature is used.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import secrets
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

import pydantic

from asyncrl.config import Config
from asyncrl.errors import UserError

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "plot.png"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_id.txt"
# Keys that are logged rarely; a call carrying one is written even off the log_every grid.
ALWAYS_LOGGED_PREFIXES = ("eval/",)


class LoggingConfig(Config):
    tensorboard: bool = True  # write RUN/tensorboard/ event files
    # Weights & Biases: offline writes RUN/wandb/ to sync later
    wandb: Literal["off", "offline", "online"] = "off"
    wandb_project: str = "asyncrl"  # the W&B project of the run
    wandb_run_name: str | None = None  # None: W&B picks a name
    plot: bool = True  # draw RUN/curves.png (reward, accuracy, loss, staleness)
    plot_every: int = pydantic.Field(10, ge=1)  # the train loop calls RunLogger.plot() this often
    log_every: int = pydantic.Field(1, ge=1)  # steps between written records (eval always written)
    # groups of each batch written token by token to RUN/samples/ (versions, sampler and trainer
    # logprobs, advantages) for `asyncrl view`; 0: none
    sample_groups: int = pydantic.Field(4, ge=0)


_SKIP = object()  # marks a value that is not a number


def _as_number(value: Any) -> Any:
    """float for anything numeric (bools, numpy/torch scalars included), None for NaN/inf, _SKIP
    for the rest. Never raises: a bad metric must not stop training."""
    if not isinstance(value, numbers.Real) and hasattr(value, "item"):
        try:
            value = value.item()  # numpy / torch scalar or one-element array
        except (ValueError, RuntimeError, TypeError):
            return _SKIP
    if not isinstance(value, numbers.Real):
        return _SKIP
    try:
        number = float(value)
    except (ValueError, TypeError, OverflowError):
        return _SKIP
    return number if math.isfinite(number) else None


def clean_metrics(metrics: Mapping[Any, Any]) -> tuple[dict[str, Any], dict[str, float]]:
    """(JSON record values, finite scalars for TensorBoard/W&B).

    Numbers become floats (NaN/inf -> null in JSON, absent from the scalars); strings and None
    stay in JSON only; anything else (lists, dicts, many-element tensors) is dropped.
    """
    record: dict[str, Any] = {}
    scalars: dict[str, float] = {}
    for key, value in metrics.items():
        key = str(key)
        if key == "step":  # the record's own step wins
            continue
        if isinstance(value, str) or value is None:
            record[key] = value
            continue
        number = _as_number(value)
        if number is _SKIP:
            continue
        record[key] = number
        if number is not None:
            scalars[key] = number
    return record, scalars


def read_metrics(path: Path) -> Iterator[dict[str, Any]]:
    """Records of a metrics.jsonl; skips a torn last line or any line that is not a JSON object."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
                yield record


def _atomic_write_text(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def truncate_metrics(path: Path, keep_through_step: int) -> int:
    """Rewrite `path` atomically with only records of step <= keep_through_step; returns their count."""
    if not path.exists():
        return 0
    kept = [r for r in read_metrics(path) if r["step"] <= keep_through_step]
    _atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return len(kept)


class RunLogger:
    """Writes a run's metrics to RUN/metrics.jsonl, RUN/tensorboard/ and (optionally) W&B.

    resume_step=None starts a fresh record (an existing metrics.jsonl is replaced, earlier
    TensorBoard events are purged from view, a new W&B run id is made); resume_step=k keeps
    records up to step k and continues the same W&B run.
    """

    def __init__(self, run_dir: str | Path, cfg: LoggingConfig | None = None,
                 config: Mapping[str, Any] | None = None, resume_step: int | None = None):
        self.cfg = cfg = cfg if cfg is not None else LoggingConfig()
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / METRICS_FILE
        self.plot_path = self.run_dir / PLOT_FILE
        if resume_step is not None and resume_step < 0:
            raise UserError(f"resume_step={resume_step}: must be >= 0 or None")
        wandb = _import_wandb(cfg.wandb) if cfg.wandb != "off" else None  # fail before any write
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._tb = self._wandb_run = None
        if resume_step is None:
            self._file = open(self.metrics_path, "w", encoding="utf-8")
        else:
            truncate_metrics(self.metrics_path, resume_step)
            self._file = open(self.metrics_path, "a", encoding="utf-8")
        try:
            if cfg.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step hides events at >= that step left by an earlier (crashed) run
                purge = 0 if resume_step is None else resume_step + 1
                self._tb = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIR),
                                         purge_step=purge, flush_secs=10)
            if wandb is not None:
                self._wandb_run = wandb.init(
                    project=cfg.wandb_project, name=cfg.wandb_run_name, dir=str(self.run_dir),
                    mode=cfg.wandb, config=dict(config or {}), resume="allow",
                    id=self._wandb_id(fresh=resume_step is None))
        except BaseException:
            self.close()
            raise

    def _wandb_id(self, fresh: bool) -> str:
        """A run id stored in the run directory, so a resumed run appends to the same W&B run."""
        path = self.run_dir / WANDB_ID_FILE
        if not fresh and path.exists() and path.read_text().strip():
            return path.read_text().strip()
        run_id = secrets.token_hex(6)
        _atomic_write_text(path, run_id + "\n")
        return run_id

    def log(self, step: int, metrics: Mapping[str, Any], force: bool = False) -> bool:
        """Record `metrics` at `step`; returns whether it was written (see log_every).

        Steps off the log_every grid are skipped unless `force` or a key starts with "eval/".
        Non-numeric values never raise: they are kept in JSON when they are JSON scalars
        (str, bool, None) and dropped otherwise; TensorBoard and W&B see finite numbers only.
        """
        step = int(step)
        if not (force or step % self.cfg.log_every == 0
                or any(str(k).startswith(ALWAYS_LOGGED_PREFIXES) for k in metrics)):
            return False
        record, scalars = clean_metrics(metrics)
        if self._file is not None:
            self._file.write(json.dumps({"step": step, **record}) + "\n")
            self._file.flush()
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, global_step=step)
        if self._wandb_run is not None:
            self._wandb_run.log(scalars, step=step)
        return True

    def plot(self) -> Path | None:
        """Redraw RUN/plot.png from metrics.jsonl; None when plotting is off."""
        if not self.cfg.plot:
            return None
        if self._tb is not None:
            self._tb.flush()
        return plot_metrics(self.metrics_path, self.plot_path)

    def close(self) -> None:
        """Flush and close every sink; safe to call twice."""
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _import_wandb(mode: str) -> Any:
    try:
        import wandb
    except ImportError:
        raise UserError(f"logging.wandb={mode!r} needs the wandb package: pip install wandb") from None
    return wandb


# (title, series predicate) per column; eval accuracy also shows any eval/pass@k present.
PANELS: tuple[tuple[str, Any], ...] = (
    ("reward mean", lambda key: key == "reward/mean"),
    ("eval accuracy", lambda key: key in ("eval/greedy_accuracy", "eval/agent_reward",
                                          "eval/tool_call_frac") or key.startswith("eval/pass@")),
    ("staleness", lambda key: key in ("staleness/mean", "staleness/max")
     or key.startswith("staleness/hist_")),
    ("sampler vs trainer |logprob diff|",
     lambda key: key.startswith("mismatch/logprob_diff_")),
    ("importance weight tails", lambda key: key in ("mismatch/iw_p99", "mismatch/iw_max")),
)
ELAPSED_KEY = "time/elapsed_s"


def _series(records: list[dict[str, Any]]) -> dict[str, list[tuple[float, float | None, float]]]:
    """key -> [(step, elapsed minutes or None, value)] over records with a numeric value."""
    out: dict[str, list[tuple[float, float | None, float]]] = {}
    for r in records:
        elapsed = r.get(ELAPSED_KEY)
        minutes = elapsed / 60.0 if isinstance(elapsed, (int, float)) else None
        for key, value in r.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                out.setdefault(key, []).append((float(r["step"]), minutes, float(value)))
    return out


def plot_metrics(metrics_jsonl: str | Path, out_png: str | Path) -> Path:
    """Draw reward / eval accuracy / staleness vs step (top row) and vs wall-clock minutes
    (bottom row) into `out_png` (written atomically). Missing series give a "no data" panel."""
    from matplotlib.figure import Figure  # object API: no pyplot global state, no backend switch

    metrics_jsonl, out_png = Path(metrics_jsonl), Path(out_png)
    records = list(read_metrics(metrics_jsonl)) if metrics_jsonl.exists() else []
    series = _series(records)
    fig = Figure(figsize=(3.6 * len(PANELS), 8), dpi=80, layout="constrained")
    axes = fig.subplots(2, len(PANELS), squeeze=False)
    for col, (title, wanted) in enumerate(PANELS):
        keys = sorted(k for k in series if wanted(k))
        for row, (xlabel, xi) in enumerate((("training step", 0), ("elapsed time (min)", 1))):
            ax = axes[row][col]
            ax.set_title(f"{title} vs {'step' if row == 0 else 'time'}")
            ax.set_xlabel(xlabel)
            ax.grid(True, alpha=0.3)
            drawn = 0
            for key in keys:
                points = [(p[xi], p[2]) for p in series[key] if p[xi] is not None]
                if not points:
                    continue
                xs, ys = zip(*points)
                marker = "o" if len(points) <= 50 else None
                ax.plot(xs, ys, label=key, marker=marker, markersize=3)
                drawn += 1
            if drawn:
                ax.legend(fontsize="small")
            else:
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes,
                        color="gray", fontsize=14)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_png.parent, prefix=f".{out_png.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format="png")
        os.replace(tmp, out_png)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out_png
