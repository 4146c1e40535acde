"""AReaL's staleness ablation at tiny scale, on the long-tailed chain job (configs/train_chain.yaml).

Cells: eta x objective x minibatches per batch x learning rate x seed, each an `asyncrl train`
process as a user runs it, with the same training-time budget. The objectives:

- naive:       proximal = behaviour: PPO's trust region is centred on whatever stale policy
               sampled the token (`actor.proximal.proximal_logprobs=behaviour`);
- decoupled:   the clip centred on the recomputed proximal policy (the trainer's weights before
               the step), no behaviour weight (`behav_imp_weight=false`; AReaL's default today);
- capped:      decoupled with w = pi_prox / pi_behav, tokens with w > 5 dropped (AReaL's
               behave_imp_weight_cap 5 with its masking);
- icepop:      decoupled with w, tokens outside [0.5, 2] dropped and left out of the normaliser;
- tis:         decoupled with w truncated at 2 (truncated importance sampling);
- loglinear:   the chain config's own setting: the proximal policy interpolated between the
               behaviour and current logprobs by version (no extra forward), w uncapped.

At eta = 0 the proximal policy is the behaviour one (up to the sampler's float mismatch), so
every objective is the same update: only `naive` runs there, the baseline of each (minibatches,
lr, seed). The record accumulates: a cell already in it (same settings, same seconds) is not run
again, so the grid can be filled over several sessions; `--from-record` prints the table.

    python benchmarks/staleness_ablation.py --etas 0,4 --minibatches 1 --seeds 0,1,2
    python benchmarks/staleness_ablation.py --from-record benchmarks/results/staleness_ablation_chain.json

`--config` runs it on another job, e.g. the main job (record staleness_ablation_main.json):

    python benchmarks/staleness_ablation.py --config configs/train_tiny.yaml --etas 0,4,8 \
        --seeds 0,1 --seconds 120 --objectives naive,decoupled,tis,loglinear --minibatches 1 \
        --lrs 1e-4 --record benchmarks/results/staleness_ablation_main.json checkpoint_every=0

One eta and one objective make it a learning-rate sweep of a job's own setting; the main job's
rate was chosen so (record main_job_lr.json):

    python benchmarks/staleness_ablation.py --config configs/train_tiny.yaml --etas 2 \
        --seeds 0,1 --seconds 150 --objectives loglinear --minibatches 1 \
        --lrs 1e-4,5e-5,2.5e-5,1.25e-5 --record benchmarks/results/main_job_lr.json checkpoint_every=0
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
RECORD = ROOT / "benchmarks" / "results" / "staleness_ablation_chain.json"
RECOMPUTE = "actor.proximal.proximal_logprobs=recompute"
OBJECTIVES = {
    "naive": ["actor.proximal.proximal_logprobs=behaviour"],
    "decoupled": [RECOMPUTE, "actor.ppo.behav_imp_weight=false"],
    "capped": [RECOMPUTE, "actor.ppo.behav_imp_weight_cap=5.0",
               "actor.ppo.behav_imp_weight_mode=mask"],
    "icepop": [RECOMPUTE, "actor.ppo.behav_imp_weight_cap=2.0",
               "actor.ppo.behav_imp_weight_mode=icepop", "actor.ppo.behav_imp_weight_renormalize=true"],
    "tis": [RECOMPUTE, "actor.ppo.behav_imp_weight_cap=2.0", "actor.ppo.behav_imp_weight_mode=cap"],
    "loglinear": ["actor.proximal.proximal_logprobs=loglinear"],
}
KEY = ("eta", "objective", "minibatches", "lr", "seed", "seconds")


def run_means(run_dir: Path) -> dict[str, float]:
    """Means over the run's steps: staleness, the behaviour weight's max and the mismatch."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {}
    for name, key in (("staleness_mean", "staleness/mean"), ("behav_weight_max",
                      "ppo/behav_weight_max"), ("behav_dropped_frac", "ppo/behav_masked_frac"),
                      ("clip_frac", "ppo/clip_frac")):
        vals = [r[key] for r in rows if key in r]
        out[name] = sum(vals) / len(vals) if vals else float("nan")
    return out


def late_accuracy(cell: dict, evals: int = 3) -> float:
    """Mean of the last `evals` evaluations: less noisy than the final one alone."""
    accs = [acc for _, _, acc in cell["curve"]][-evals:]
    return sum(accs) / len(accs)


def run_cells(plan: list[dict], cells: list[dict], config: str, out: Path, console: Console,
              extra: list[str], save: callable) -> None:
    done = {tuple(c[k] for k in KEY) for c in cells}
    for cell in plan:
        key = tuple(cell[k] for k in KEY)
        if key in done:
            continue
        name = "-".join(f"{k}{cell[k]}" for k in KEY[:-1])
        run_dir = out / name
        summary: RunSummary | None = run_train(
            name, run_dir, config,
            [f"rollout.max_head_offpolicyness={cell['eta']}", f"seed={cell['seed']}",
             f"max_train_seconds={cell['seconds']}", f"actor.ppo_n_minibatches={cell['minibatches']}",
             f"train.optimizer.lr={cell['lr']}", *OBJECTIVES[cell["objective"]], *extra], console)
        if summary is None:
            raise SystemExit(f"{name} failed; see {run_dir}")
        cells.append({**cell, "steps": summary.steps, "train_seconds": summary.train_seconds,
                      "final": summary.final_accuracy, "best": summary.best_accuracy,
                      "initial": summary.initial_accuracy, **run_means(run_dir),
                      "curve": summary.curve})
        save(cells)


COLUMNS = ("eta", "objective", "mb", "lr", "seeds", "final", "last 3 evals", "best",
           "final per seed", "steps", "staleness", "w max", "dropped", "clip frac",
           "vs eta=0 (per seed)")


def objective_order(cells: list[dict]) -> list[str]:
    """OBJECTIVES' order, then any other name in the cells (older records' names)."""
    return list(OBJECTIVES) + sorted({c["objective"] for c in cells} - set(OBJECTIVES))


def table_rows(cells: list[dict]) -> list[tuple[str, ...]]:
    """One row per (eta, objective, minibatches, lr), in COLUMNS' order."""
    groups: dict[tuple, list[dict]] = {}
    for c in cells:
        groups.setdefault((c["eta"], c["objective"], c["minibatches"], c["lr"]), []).append(c)
    order = objective_order(cells)
    rows = []
    for (eta, name, mb, lr), group in sorted(groups.items(), key=lambda kv: (
            kv[0][2], kv[0][3], kv[0][0], order.index(kv[0][1]))):
        base = groups.get((0, "naive", mb, lr), [])
        late = statistics.mean(late_accuracy(c) for c in group)
        vs = ""
        if base and eta:
            vs = f"{late - statistics.mean(late_accuracy(c) for c in base):+.1%}"
            by_seed = {c["seed"]: late_accuracy(c) for c in base}
            paired = [f"{100 * (late_accuracy(c) - by_seed[c['seed']]):+.1f}"
                      for c in group if c["seed"] in by_seed]
            vs += f" ({' / '.join(paired)})" if paired else ""
        clip = [c.get("clip_frac", float("nan")) for c in group]
        steps = [c["steps"] for c in group]
        rows.append((str(eta), name, str(mb), f"{lr:g}", str(len(group)),
                     f"{statistics.mean(c['final'] for c in group):.1%}", f"{late:.1%}",
                     f"{statistics.mean(c['best'] for c in group):.1%}",
                     " / ".join(f"{100 * c['final']:.1f}" for c in group) + "%",
                     f"{min(steps)}-{max(steps)}" if min(steps) != max(steps) else str(steps[0]),
                     f"{statistics.mean(c['staleness_mean'] for c in group):.2f}",
                     f"{statistics.mean(c['behav_weight_max'] for c in group):.2f}",
                     f"{statistics.mean(c['behav_dropped_frac'] for c in group):.2%}",
                     "-".join(dict.fromkeys((f"{min(clip):.1%}", f"{max(clip):.1%}"))), vs))
    return rows


TUNED_COLUMNS = ("mb", "eta", "objective", "rates (last 3 evals)", "best rate", "seeds",
                 "vs eta=0 at its best rate (per seed)")


def tuned_rows(cells: list[dict]) -> list[tuple[str, ...]]:
    """Each (minibatches, eta, objective) at the learning rate it does best with.

    A cell's rates compete only among those run with its most seeds, so a rate tried on one seed
    cannot win over one measured on three. The difference is against eta = 0 at eta 0's own best
    rate with the same minibatches, paired by seed."""
    groups: dict[tuple, dict[float, list[dict]]] = {}
    for c in cells:
        groups.setdefault((c["minibatches"], c["eta"], c["objective"]), {}).setdefault(
            c["lr"], []).append(c)

    def best(by_lr: dict[float, list[dict]]) -> tuple[float, list[dict]]:
        most = max(len(g) for g in by_lr.values())
        return max(((lr, g) for lr, g in by_lr.items() if len(g) == most),
                   key=lambda kv: statistics.mean(late_accuracy(c) for c in kv[1]))

    order = objective_order(cells)
    rows = []
    for (mb, eta, name), by_lr in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], order.index(kv[0][2]))):
        lr, group = best(by_lr)
        late = statistics.mean(late_accuracy(c) for c in group)
        rates = ", ".join(f"{r:g}: {statistics.mean(late_accuracy(c) for c in g):.1%}"
                          + (f" ({len(g)} seed{'s' * (len(g) > 1)})" if len(g) != len(group) else "")
                          for r, g in sorted(by_lr.items(), reverse=True))
        vs = ""
        base = groups.get((mb, 0, "naive"))
        if base and eta:
            base_lr, base_group = best(base)
            by_seed = {c["seed"]: late_accuracy(c) for c in base_group}
            vs = (f"{late - statistics.mean(by_seed.values()):+.1%} vs {base_lr:g} ("
                  + " / ".join(f"{100 * (late_accuracy(c) - by_seed[c['seed']]):+.1f}"
                               for c in group if c["seed"] in by_seed) + ")")
        rows.append((str(mb), str(eta), name, rates, f"{lr:g}", str(len(group)), vs))
    return rows


def record_cells(path: Path) -> tuple[dict, list[dict]]:
    """A record and its cells."""
    rec = json.loads(Path(path).read_text())
    return rec, rec["cells"]


def report(cells: list[dict], console: Console, markdown: bool = False) -> None:
    rows = table_rows(cells)
    if markdown:  # the docs' tables (benchmarks/results_pages.py writes them into the page)
        from results_pages import markdown_table

        print(markdown_table(COLUMNS, rows))
        print(markdown_table(TUNED_COLUMNS, tuned_rows(cells)), end="")
        return
    console.print(rich_table("staleness ablation (held-out greedy accuracy after equal training "
                             "time; mean over seeds)", COLUMNS, rows))
    console.print("vs eta=0: the last-3-evaluation mean against eta = 0 (naive) with the same "
                  "minibatches and learning rate; in brackets the paired difference of each seed "
                  "(points); clip frac: the range over seeds of each run's mean clipped share")
    console.print(rich_table("each cell at its best learning rate", TUNED_COLUMNS,
                             tuned_rows(cells)))


def rich_table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> Table:
    table = Table(title=title)
    for col in columns:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    return table


def shown(path: str) -> str:
    """A path as a reader of the record runs it: relative to the repository when inside it."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--etas", default="0,4,8")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--seconds", type=float, default=180.0, help="training time of every run")
    ap.add_argument("--objectives", default=",".join(OBJECTIVES))
    ap.add_argument("--minibatches", default="1,4", help="actor.ppo_n_minibatches values")
    ap.add_argument("--lrs", default="1e-4", help="learning rates (train.optimizer.lr)")
    ap.add_argument("--config", default=str(ROOT / "configs/train_chain.yaml"))
    ap.add_argument("--out", default="runs/staleness_ablation")
    ap.add_argument("overrides", nargs="*", help="key=value for every run (recorded)")
    ap.add_argument("--record", default=str(RECORD), help="'' to write no record")
    ap.add_argument("--from-record", default=None, help="print the table of a record, run nothing")
    ap.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = ap.parse_args()
    console = Console(width=200)
    if args.from_record:
        report(record_cells(Path(args.from_record))[1], console, args.markdown)
        return
    objectives = args.objectives.split(",")
    bad = [o for o in objectives if o not in OBJECTIVES]
    if bad:
        raise SystemExit(f"--objectives {bad}: unknown; allowed {list(OBJECTIVES)}")
    record = Path(args.record) if args.record else None
    previous = json.loads(record.read_text()) if record and record.is_file() else {}
    cells = previous.get("cells", [])
    plan = [{"eta": eta, "objective": name, "minibatches": mb, "lr": lr, "seed": seed,
             "seconds": args.seconds}
            for seed in map(int, args.seeds.split(","))
            for mb in map(int, args.minibatches.split(","))
            for lr in map(float, args.lrs.split(","))
            for eta in map(int, args.etas.split(","))
            for name in (["naive"] if eta == 0 else objectives)]

    def save(cells: list[dict]) -> None:
        if record is None:
            return
        record.parent.mkdir(parents=True, exist_ok=True)
        command = "python benchmarks/staleness_ablation.py " + " ".join(sys.argv[1:])
        commands = previous.get("commands", [previous["command"]] if "command" in previous else [])
        record.write_text(json.dumps({
            **{k: v for k, v in previous.items() if k != "command"},  # keep notes made by hand
            "commands": commands + [command] * (command not in commands),
            "date": datetime.date.today().isoformat(), "config": shown(args.config),
            "machine": {"cpus": torch.get_num_threads(), "processor": platform.processor(),
                        "torch": torch.__version__},
            "overrides": args.overrides, "cells": cells}, indent=1))

    run_cells(plan, cells, args.config, Path(args.out), console, args.overrides, save)
    report(cells, console, args.markdown)


if __name__ == "__main__":
    main()
