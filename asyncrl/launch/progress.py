"""The live view of a training run: a rich panel on a terminal, one plain line per step elsewhere.

`TrainProgress.update(step, metrics)` only stores numbers (it is called from the train loop every
step); the panel is redrawn by rich's refresh thread, which recomputes elapsed time and ETA so they
tick between steps. When the console is not a terminal (CI, a pipe, a log file) there is no live
panel: every `print_every` steps one line with the same fields is printed, so logs stay readable.

Metric keys read (the same dict the train loop passes to RunLogger.log): see `KEYS`.
Accuracy values are fractions in [0, 1], shown as percentages.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table

KEYS = {
    "reward": "reward/mean",
    "eval": "eval/greedy_accuracy",
    "stale_mean": "staleness/mean",
    "stale_max": "staleness/max",
    "gen_tps": "perf/gen_tokens_per_s",
    "train_tps": "perf/train_tokens_per_s",
    "version": "policy/version",
    "elapsed": "time/elapsed_s",
}
AGENT_EVAL = "eval/agent_reward"
RATE_WINDOW = 20  # steps/s is measured over this many recent updates, so warm-up fades out


def format_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds in (float("inf"), float("-inf")):
        return "?"
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s"


def _num(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if number == number else None  # NaN -> unknown


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


class TrainProgress:
    """Step, elapsed, ETA, reward, last eval, staleness, tokens/s and policy version of a run."""

    def __init__(self, total_steps: int | None, max_seconds: float | None = None,
                 console: Console | None = None, start_step: int = 0, print_every: int = 1,
                 refresh_per_second: float = 2.0):
        if print_every < 1:
            raise ValueError(f"print_every={print_every}: must be >= 1")
        self.total_steps = total_steps
        self.max_seconds = max_seconds
        self.console = console if console is not None else Console(stderr=True)
        self.start_step = self.step = start_step
        self.print_every = print_every
        self.live_mode = (self.console.is_terminal or self.console.is_jupyter) and \
            not self.console.is_dumb_terminal
        self._refresh = refresh_per_second
        self._live: Live | None = None
        self._t0 = time.monotonic()
        self._updated_at = self._t0
        self._history: collections.deque[tuple[float, int]] = collections.deque(maxlen=RATE_WINDOW)
        self._history.append((self._t0, start_step))
        self._values: dict[str, float | None] = {}
        self._eval: tuple[float, int] | None = None  # (accuracy, step)
        self._printed_step: int | None = None
        self._updates = 0

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> TrainProgress:
        self._t0 = self._updated_at = time.monotonic()
        self._history.clear()
        self._history.append((self._t0, self.step))
        if self.live_mode and self._live is None:
            self._live = Live(self, console=self.console, refresh_per_second=self._refresh,
                              transient=False)
            self._live.start()
        return self

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None
        elif not self.live_mode and self._updates and self._printed_step != self.step:
            self._print_line()  # the last step, if the print_every grid skipped it

    def __enter__(self) -> TrainProgress:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- input ---------------------------------------------------------------------------------
    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record step `step`'s metrics; a key missing from `metrics` keeps its last value."""
        now = time.monotonic()
        self.step = int(step)
        self._updated_at = now
        self._updates += 1
        self._history.append((now, self.step))
        values = dict(self._values)
        for name, key in KEYS.items():
            if key in metrics:
                values[name] = _num(metrics[key])
        if AGENT_EVAL in metrics:  # agent workflows score the agent's own reward
            values["eval"] = _num(metrics[AGENT_EVAL])
        self._values = values  # one assignment: the refresh thread sees old or new, never half
        accuracy = _num(metrics.get(KEYS["eval"], metrics.get(AGENT_EVAL)))
        if accuracy is not None:
            self._eval = (accuracy, self.step)
        if not self.live_mode and self._due():
            self._print_line()

    def message(self, text: str) -> None:
        """Print a line above the live panel (or in sequence with the plain lines)."""
        console = self._live.console if self._live is not None else self.console
        console.print(text, markup=False, highlight=False, soft_wrap=True)

    # -- derived numbers -----------------------------------------------------------------------
    def elapsed(self) -> float:
        """Run time: the loop's own time/elapsed_s (which survives resume) plus time since it."""
        logged = self._values.get("elapsed")
        now = time.monotonic()
        if logged is None:
            return now - self._t0
        return logged + (now - self._updated_at)

    def steps_per_second(self) -> float | None:
        (t_first, s_first), (t_last, s_last) = self._history[0], self._history[-1]
        if s_last <= s_first or t_last <= t_first:
            return None
        return (s_last - s_first) / (t_last - t_first)

    def eta(self) -> float | None:
        """Seconds until the run ends: by steps or by the time budget, whichever comes first."""
        candidates = []
        rate = self.steps_per_second()
        if self.total_steps is not None and rate:
            since_update = time.monotonic() - self._updated_at
            candidates.append(max(0.0, (self.total_steps - self.step) / rate - since_update))
        if self.max_seconds is not None:
            candidates.append(max(0.0, self.max_seconds - self.elapsed()))
        return min(candidates) if candidates else None

    def _due(self) -> bool:
        return ((self.step - self.start_step) % self.print_every == 0
                or (self.total_steps is not None and self.step >= self.total_steps))

    # -- output --------------------------------------------------------------------------------
    def fields(self) -> list[tuple[str, str]]:
        """(label, text) pairs shown by both the panel and the plain line."""
        v = self._values
        total = "?" if self.total_steps is None else str(self.total_steps)
        evaluation = "-" if self._eval is None else f"{self._eval[0]:.1%} @{self._eval[1]}"
        return [
            ("step", f"{self.step}/{total}"),
            ("elapsed", format_duration(self.elapsed())),
            ("eta", format_duration(self.eta())),
            ("reward", _fmt(v.get("reward"), ".3f")),
            ("eval", evaluation),
            ("staleness", f"{_fmt(v.get('stale_mean'), '.2f')}/{_fmt(v.get('stale_max'), '.0f')}"),
            ("gen", _fmt(v.get("gen_tps"), ",.0f", " tok/s")),
            ("train", _fmt(v.get("train_tps"), ",.0f", " tok/s")),
            ("version", _fmt(v.get("version"), ".0f")),
        ]

    def line(self) -> str:
        return " | ".join(f"{label} {text}" for label, text in self.fields())

    def _print_line(self) -> None:
        self._printed_step = self.step
        self.console.print(self.line(), markup=False, highlight=False, soft_wrap=True)

    def __rich__(self) -> Panel:
        """Called by rich's refresh thread: builds the panel from the stored numbers."""
        fields = dict(self.fields())
        grid = Table.grid(padding=(0, 2))
        for _ in range(4):
            grid.add_column(style="bold", justify="right")
            grid.add_column()
        grid.add_row("elapsed", fields["elapsed"], "eta", fields["eta"],
                     "reward", fields["reward"], "eval", fields["eval"])
        grid.add_row("staleness", fields["staleness"], "version", fields["version"],
                     "gen", fields["gen"], "train", fields["train"])
        bar = Table.grid(padding=(0, 2), expand=True)
        bar.add_column(ratio=1)
        bar.add_column(justify="right")
        total = float(self.total_steps) if self.total_steps else None  # None: a pulsing bar
        bar.add_row(ProgressBar(total=total, completed=self.step if total else 0),
                    f"step {fields['step']}")
        return Panel(Group(bar, grid), title="asyncrl train", expand=True)
