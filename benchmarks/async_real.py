"""Real mode of bench_async: the actual `asyncrl train` job at several staleness bounds.

Each eta runs as its own `asyncrl train` process with the same config, seed and training-time
budget; the benchmark reads each run's metrics.jsonl and reports throughput (steps and generated
tokens per second of training time) and the training time to the first evaluation at or above the
target accuracy, with ratios against eta = 0 (the synchronous loop).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table


@dataclass
class RunSummary:
    label: str | int  # the eta, or the seed
    steps: int
    train_seconds: float
    initial_accuracy: float | None
    final_accuracy: float | None
    best_accuracy: float | None
    time_to_target: float | None  # training seconds at the first eval >= target
    gen_tokens_per_s: float
    train_tokens: int  # prompt + completion tokens of every trained sample
    curve: list[tuple[int, float, float]]  # (step, training seconds, greedy accuracy)

    @property
    def seconds_per_step(self) -> float:
        return self.train_seconds / self.steps if self.steps else float("nan")


def summarise(label: str | int, metrics_path: Path, target: float | None) -> RunSummary:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    curve = [(r["step"], r.get("time/elapsed_s", 0.0), r["eval/greedy_accuracy"])
             for r in rows if r.get("eval/greedy_accuracy") is not None]
    hit = next((t for _, t, acc in curve if target is not None and acc >= target), None)
    train_s = steps[-1]["time/elapsed_s"] if steps else 0.0
    gen = [r.get("perf/gen_tokens_per_s", 0.0) for r in steps[1:]] or [0.0]
    accs = [acc for _, _, acc in curve]
    return RunSummary(label, len(steps), train_s, accs[0] if accs else None,
                      accs[-1] if accs else None, max(accs) if accs else None, hit,
                      sum(gen) / len(gen), int(sum(r.get("batch/tokens", 0) for r in steps)),
                      curve)


def run_train(label: str | int, run_dir: Path, config: str | None, overrides: list[str],
              console: Console, target: float | None = None) -> RunSummary | None:
    """One `asyncrl train` process (as a user runs it) -> its summary; None if it failed."""
    cmd = [sys.executable, "-m", "asyncrl.cli", "train", *([config] if config else []),
           f"output_dir={run_dir}", "logging.tensorboard=false", *overrides]
    console.print(f"[bold]{label}[/]: asyncrl {' '.join(cmd[3:])}", soft_wrap=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        console.print(f"[red]{label} failed with exit {proc.returncode}[/]")
        return None
    console.print(proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "")
    return summarise(label, run_dir / "metrics.jsonl", target)


def report(runs: list[RunSummary], target: float | None, console: Console) -> None:
    base = next((r for r in runs if r.label == 0), None)
    table = Table(title=f"asyncrl train, eta = 0 (synchronous) vs asynchronous; target accuracy "
                        f"{'-' if target is None else f'{target:.0%}'}")
    for col in ("eta", "steps", "s/step", "gen tok/s", "acc start", "acc end", "acc best",
                "t to target", "steps/s vs eta=0", "time-to-target speedup"):
        table.add_column(col, justify="right")
    for r in runs:
        rate = (base.seconds_per_step / r.seconds_per_step) if base and r.steps else float("nan")
        speed = (f"{base.time_to_target / r.time_to_target:.2f}x"
                 if base and base.time_to_target and r.time_to_target else "-")
        fmt = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
        table.add_row(str(r.label), str(r.steps), f"{r.seconds_per_step:.2f}",
                      f"{r.gen_tokens_per_s:,.0f}", fmt(r.initial_accuracy),
                      fmt(r.final_accuracy), fmt(r.best_accuracy),
                      "-" if r.time_to_target is None else f"{r.time_to_target:.0f}s",
                      f"{rate:.2f}x", speed)
    console.print(table)
    for r in runs:
        pts = ", ".join(f"{step}:{acc:.0%}@{t:.0f}s" for step, t, acc in r.curve)
        console.print(f"eta={r.label} curve (step:accuracy@training seconds): {pts}", soft_wrap=True)


def run_real_benchmark(etas: list[int], target: float | None, max_seconds: float,
                       config: str | None, overrides: list[str], out: Path) -> list[RunSummary]:
    console = Console(width=160)
    runs = []
    for eta in sorted(set([0, *etas])):
        summary = run_train(eta, out / f"eta{eta}", config,
                            [f"rollout.max_head_offpolicyness={eta}",
                             f"max_train_seconds={max_seconds}", *overrides], console, target)
        if summary is not None:
            runs.append(summary)
    report(runs, target, console)
    return runs
