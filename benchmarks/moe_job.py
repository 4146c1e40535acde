"""The tiny mixture-of-experts job with and without rollout routing replay (R3), synchronous and
asynchronous: `asyncrl train configs/train_moe_tiny.yaml` for every (replay, eta, seed).

    python benchmarks/moe_job.py --seeds 0,1,2 --etas 0,4 --max-seconds 150

Each run is its own `asyncrl train` process with `actor.moe.routing_replay`,
`rollout.max_head_offpolicyness` (eta), `seed` and `max_train_seconds` set; the warm start
(configs/train_moe_tiny.yaml's, built once and cached) is shared. Per run, from its
metrics.jsonl: the held-out greedy accuracy at step 0 and at the end, the mean reward of the last
10 steps, the route-flip share over fresh samples (`moe/route_flip_frac`) and over stale ones
(`moe/route_flip_frac_stale`), the trained tokens' logprob gap to the sampler
(`mismatch/logprob_diff_mean`/`_max`: with replay, the gap replay leaves) and, under replay, the
gap the same forward shows without it (`moe/logprob_diff_unreplayed_*`). Prints the per-run rows
and the mean over seeds of each (replay, eta); writes benchmarks/results/moe_job.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_real import run_train  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "configs/train_moe_tiny.yaml"
RECORD = ROOT / "benchmarks" / "results" / "moe_job.json"
# (column, metrics.jsonl key) averaged over a run's steps
STEP_MEANS = {
    "flip_fresh": "moe/route_flip_frac",
    "flip_stale": "moe/route_flip_frac_stale",
    "gap_mean": "mismatch/logprob_diff_mean",
    "gap_max": "mismatch/logprob_diff_max",
    "gap_unreplayed_mean": "moe/logprob_diff_unreplayed_mean",
    "gap_unreplayed_max": "moe/logprob_diff_unreplayed_max",
    "staleness": "staleness/mean",
}


def run_row(replay: bool, eta: int, seed: int, metrics: Path, wall: float) -> dict:
    """One run's figures from its metrics.jsonl (a key no step logged is None)."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    evals = [(r["step"], round(r.get("time/elapsed_s", 0.0), 1), r["eval/greedy_accuracy"])
             for r in rows if r.get("eval/greedy_accuracy") is not None]
    out = {"replay": replay, "eta": eta, "seed": seed, "steps": len(steps),
           "train_seconds": round(steps[-1]["time/elapsed_s"], 1) if steps else 0.0,
           "wall_seconds": round(wall, 1),
           "initial_accuracy": evals[0][2] if evals else None,
           "final_accuracy": evals[-1][2] if evals else None,
           "reward_last10": round(statistics.mean(r["reward/mean"] for r in steps[-10:]), 4)
           if steps else None}
    for col, key in STEP_MEANS.items():
        vals = [r[key] for r in steps if r.get(key) is not None]
        out[col] = round(statistics.mean(vals), 6) if vals else None
    out["curve"] = evals
    return out


def cell(rows: list[dict], replay: bool, eta: int) -> list[dict]:
    return [r for r in rows if r["replay"] == replay and r["eta"] == eta]


def mean_of(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r[key] is not None]
    return statistics.mean(vals) if vals else None


def report(rows: list[dict], console: Console) -> dict:
    """Per-run table, then the mean over seeds per (replay, eta); returns the means."""
    pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    num = lambda x: "-" if x is None else f"{x:.2e}"  # noqa: E731
    cols = ("replay", "eta", "seed", "steps", "acc step 0", "acc end", "reward (last 10)",
            "flips fresh", "flips stale", "gap mean", "gap max", "gap w/o replay mean",
            "gap w/o replay max", "staleness")

    def table(title: str, data: list[dict]) -> None:
        t = Table(title=title)
        for c in cols:
            t.add_column(c, justify="right")
        for r in data:
            t.add_row("on" if r["replay"] else "off", str(r["eta"]), str(r["seed"]),
                      str(r["steps"]), pct(r["initial_accuracy"]), pct(r["final_accuracy"]),
                      "-" if r["reward_last10"] is None else f"{r['reward_last10']:.3f}",
                      pct(r["flip_fresh"]), pct(r["flip_stale"]), num(r["gap_mean"]),
                      num(r["gap_max"]), num(r["gap_unreplayed_mean"]),
                      num(r["gap_unreplayed_max"]),
                      "-" if r["staleness"] is None else f"{r['staleness']:.2f}")
        console.print(t)

    table(f"asyncrl train {CONFIG}: every run", rows)
    means = []
    for replay in (False, True):
        for eta in sorted({r["eta"] for r in rows}):
            runs = cell(rows, replay, eta)
            if not runs:
                continue
            m = {"replay": replay, "eta": eta, "seed": f"mean of {len(runs)}",
                 "steps": round(statistics.mean(r["steps"] for r in runs))}
            for key in ("initial_accuracy", "final_accuracy", "reward_last10", *STEP_MEANS):
                m[key] = mean_of(runs, key)
            means.append(m)
    table("mean over seeds", means)
    return {f"replay={'on' if m['replay'] else 'off'},eta={m['eta']}": m for m in means}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--etas", default="0,4")
    ap.add_argument("--replay", default="off,on", help="which of off,on to run")
    ap.add_argument("--max-seconds", type=float, default=150.0,
                    help="each run's training-time budget (max_train_seconds)")
    ap.add_argument("--out", default="runs/moe_job", help="run directories go here")
    ap.add_argument("--record", default=str(RECORD),
                    help="runs already in it are kept and skipped; '' writes none")
    ap.add_argument("--report", action="store_true", help="print --record's report; run nothing")
    args = ap.parse_args()
    console = Console(width=200)
    record_path = Path(args.record) if args.record else None
    old = (json.loads(record_path.read_text())
           if record_path is not None and record_path.exists() else None)
    rows: list[dict] = list(old["runs"]) if old else []
    if args.report:
        report(rows, console)
        return
    done = {(r["replay"], r["eta"], r["seed"]) for r in rows}
    for replay in [v == "on" for v in args.replay.split(",")]:
        for eta in [int(e) for e in args.etas.split(",")]:
            for seed in [int(s) for s in args.seeds.split(",")]:
                if (replay, eta, seed) in done:
                    continue
                run_dir = Path(args.out) / f"replay{int(replay)}_eta{eta}_seed{seed}"
                t0 = time.perf_counter()
                summary = run_train(f"replay={replay} eta={eta} seed={seed}", run_dir, CONFIG, [
                    f"seed={seed}", f"rollout.max_head_offpolicyness={eta}",
                    f"actor.moe.routing_replay={str(replay).lower()}",
                    f"max_train_seconds={args.max_seconds}", "checkpoint_every=0"], console)
                if summary is None:
                    raise SystemExit(f"replay={replay} eta={eta} seed={seed} failed; see above")
                rows.append(run_row(replay, eta, seed, run_dir / "metrics.jsonl",
                                    time.perf_counter() - t0))
                if record_path is not None:
                    record_path.parent.mkdir(parents=True, exist_ok=True)
                    record_path.write_text(json.dumps({
                        "command": f"python benchmarks/moe_job.py --seeds {args.seeds} --etas "
                                   f"{args.etas} --max-seconds {args.max_seconds:g}",
                        "date": datetime.date.today().isoformat(),
                        "machine": {"cpus": os.cpu_count(), "processor": platform.processor(),
                                    "torch": torch.__version__},
                        "config": CONFIG, "max_train_seconds": args.max_seconds,
                        "runs": rows}, indent=1) + "\n")
    means = report(rows, console)
    if record_path is not None and rows:
        rec = json.loads(record_path.read_text())
        rec["means"] = means
        record_path.write_text(json.dumps(rec, indent=1) + "\n")
        console.print(f"record written to {record_path}")


if __name__ == "__main__":
    main()
