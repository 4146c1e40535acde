"""AReaL's staleness ablation at tiny scale, on the main job (configs/train_tiny.yaml).

eta in {0, 4, 8} x objective in {naive PPO, decoupled PPO, decoupled + truncated IS}, the same
training-time budget and seeds for every cell, each an `asyncrl train` process as a user runs it:

- naive:      proximal = behaviour: PPO's trust region is centred on whatever stale policy
              sampled the token (`actor.proximal.proximal_logprobs=behaviour`);
- decoupled:  AReaL's decoupled objective with the exact proximal policy (an extra forward
              pass of the trainer's current weights, `proximal_logprobs=recompute`): the clip is
              centred on the recent policy, the stale sampler enters through w = pi_prox/pi_behav;
- decoupled+tis: the same with w truncated at 2 (`behav_imp_weight_cap=2`, mode cap).

AReaL's finding to check: the decoupled objective at eta = 4 keeps the accuracy of eta = 0
while naive PPO degrades. The table gives final and best held-out greedy accuracy (mean over
seeds, then each seed), steps, mean staleness of the consumed batches, and accuracy relative to
the synchronous naive cell (eta = 0), whichever way it comes out.

    python benchmarks/staleness_ablation.py --seconds 120 --seeds 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).parent))
from async_real import RunSummary, run_train  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "results" / "staleness_ablation.json"
OBJECTIVES = {
    "naive": ["actor.proximal.proximal_logprobs=behaviour"],
    "decoupled": ["actor.proximal.proximal_logprobs=recompute"],
    "decoupled+tis": ["actor.proximal.proximal_logprobs=recompute",
                      "actor.ppo.behav_imp_weight_cap=2.0", "actor.ppo.behav_imp_weight_mode=cap"],
}


def mean_staleness(run_dir: Path) -> float:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    vals = [r["staleness/mean"] for r in rows if "staleness/mean" in r]
    return sum(vals) / len(vals) if vals else float("nan")


def run_cells(etas: list[int], seeds: int, seconds: float, out: Path, console: Console,
              objectives: list[str], extra: list[str]) -> list[dict]:
    cells = []
    for eta in etas:
        for name in objectives:
            overrides = [*OBJECTIVES[name], *extra]
            for seed in range(seeds):
                run_dir = out / f"eta{eta}-{name}-seed{seed}"
                summary: RunSummary | None = run_train(
                    f"eta={eta} {name} seed={seed}", run_dir, str(ROOT / "configs/train_tiny.yaml"),
                    [f"rollout.max_head_offpolicyness={eta}", f"seed={seed}",
                     f"max_train_seconds={seconds}", *overrides], console)
                if summary is None:
                    raise SystemExit(f"eta={eta} {name} seed={seed} failed; see {run_dir}")
                cells.append({"eta": eta, "objective": name, "seed": seed,
                              "steps": summary.steps, "train_seconds": summary.train_seconds,
                              "final": summary.final_accuracy, "best": summary.best_accuracy,
                              "initial": summary.initial_accuracy,
                              "staleness_mean": mean_staleness(run_dir),
                              "curve": summary.curve})
    return cells


def late_accuracy(cell: dict, evals: int = 3) -> float:
    """Mean of the last `evals` evaluations: less noisy than the final one alone."""
    accs = [acc for _, _, acc in cell["curve"]][-evals:]
    return sum(accs) / len(accs)


def report(cells: list[dict], console: Console) -> None:
    base = [c["final"] for c in cells if c["eta"] == 0 and c["objective"] == "naive"]
    base_final = statistics.mean(base) if base else float("nan")
    table = Table(title="staleness ablation (main job; held-out greedy accuracy after equal "
                        "training time)")
    for col in ("eta", "objective", "final (mean)", "last 3 evals (mean)", "best (mean)",
                "final per seed", "steps", "staleness", "final vs eta=0 naive"):
        table.add_column(col, justify="right")
    keys = sorted({(c["eta"], c["objective"]) for c in cells},
                  key=lambda k: (k[0], list(OBJECTIVES).index(k[1])))
    for eta, name in keys:
        group = [c for c in cells if c["eta"] == eta and c["objective"] == name]
        final = statistics.mean(c["final"] for c in group)
        table.add_row(str(eta), name, f"{final:.1%}",
                      f"{statistics.mean(late_accuracy(c) for c in group):.1%}",
                      f"{statistics.mean(c['best'] for c in group):.1%}",
                      " ".join(f"{c['final']:.1%}" for c in group),
                      " ".join(str(c["steps"]) for c in group),
                      f"{statistics.mean(c['staleness_mean'] for c in group):.2f}",
                      f"{final - base_final:+.1%}")
    console.print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--etas", default="0,4,8")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=120.0, help="training time of every run")
    ap.add_argument("--objectives", default=",".join(OBJECTIVES))
    ap.add_argument("--out", default="runs/staleness_ablation")
    ap.add_argument("overrides", nargs="*", help="key=value for every run, e.g. "
                    "actor.ppo_n_minibatches=4 (recorded)")
    ap.add_argument("--record", default=str(RECORD), help="'' to write no record")
    ap.add_argument("--from-record", default=None, help="print the table of a record, run nothing")
    args = ap.parse_args()
    console = Console(width=160)
    if args.from_record:
        report(json.loads(Path(args.from_record).read_text())["cells"], console)
        return
    etas = [int(x) for x in args.etas.split(",")]
    objectives = args.objectives.split(",")
    bad = [o for o in objectives if o not in OBJECTIVES]
    if bad:
        raise SystemExit(f"--objectives {bad}: unknown; allowed {list(OBJECTIVES)}")
    cells = run_cells(etas, args.seeds, args.seconds, Path(args.out), console, objectives,
                      args.overrides)
    report(cells, console)
    if args.record:
        Path(args.record).parent.mkdir(parents=True, exist_ok=True)
        Path(args.record).write_text(json.dumps({
            "command": "python benchmarks/staleness_ablation.py " + " ".join(sys.argv[1:]),
            "date": datetime.date.today().isoformat(),
            "machine": {"cpus": torch.get_num_threads(), "processor": platform.processor(),
                        "torch": torch.__version__},
            "seconds": args.seconds, "overrides": args.overrides, "cells": cells}, indent=1))
        console.print(f"record written to {args.record}")


if __name__ == "__main__":
    main()
