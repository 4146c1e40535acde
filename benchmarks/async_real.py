"""Real mode of bench_async: the actual `asyncrl train` job at several staleness bounds.

Each eta runs as its own `asyncrl train` process with the same config, seed and training-time
budget; the benchmark reads each run's metrics.jsonl and reports throughput (steps and generated
tokens per second of training time) and the training time to the first evaluation at or above the
target accuracy, with ratios against eta = 0 (the synchronous loop).
"""

from __future__ import annotations

import json
import os
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


SYNC = "sync: whole machine"
SHARED = "shared: in process"
OWN = "the config's own"


def placement(eta: int, split: bool, shared: bool = False,
              own: bool = False) -> tuple[str, list[str]]:
    """Where generation and training run, as config overrides.

    - sync (eta = 0): the synchronous loop on the whole machine, in one process: the engine
      generates with every core, then the trainer trains with every core.
    - split (eta > 0, and eta = 0 with --sync-split): as on separate GPUs, the engine is a server
      process (`inference.mode=local`) on the first half of the cores and the trainer on the
      rest (launcher.trainer_cpus / server_cpus). Its logprob canary runs every 20th push, as
      in process (a canary per push costs a server 1-4 s on this machine).
    - shared (eta > 0 with --shared): the main job's placement, the engine on a thread of the
      trainer's process (`inference.engine.num_threads` 1) sharing every core with it.
    - own (--same-placement): every eta as the config places it (the tool-calling job: its
      episodes wait on a service, so the placement is held equal and only eta changes)."""
    cpus = sorted(os.sched_getaffinity(0))
    if own:
        return OWN, []
    if shared:
        return SHARED, ["inference.mode=inprocess", "inference.engine.num_threads=1"]
    if not split:
        return SYNC, ["inference.mode=inprocess",
                                       f"inference.engine.num_threads={len(cpus)}"]
    half = max(1, len(cpus) // 2)
    serve, train = cpus[:half], cpus[half:] or cpus[:half]
    return (f"split: engine {serve}, trainer {train}",
            ["inference.mode=local", f"inference.engine.num_threads={len(serve)}",
             "inference.check_logprobs_every=20",
             f"launcher.trainer_cpus={json.dumps(train)}",
             f"launcher.server_cpus={json.dumps(serve)}"])


def idle_fraction(metrics_path: Path) -> float:
    """Share of the training time in which no rollout ran (step-time weighted)."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "perf/rollout_idle_frac" in r]
    span = [r["perf/wait_s"] + r["perf/train_s"] + r["perf/weight_sync_s"] for r in steps]
    return sum(r["perf/rollout_idle_frac"] * t for r, t in zip(steps, span)) / max(sum(span), 1e-9)


def trainer_idle_fraction(metrics_path: Path) -> float:
    """Share of the training time the trainer spent waiting for a batch."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "perf/wait_s" in r]
    wait = sum(r["perf/wait_s"] for r in steps)
    span = sum(r["perf/wait_s"] + r["perf/train_s"] + r["perf/weight_sync_s"] for r in steps)
    return wait / max(span, 1e-9)


def run_stats(metrics_path: Path) -> dict:
    """Per run: the staleness trained on and, for tool-calling runs, the observed tool latency
    (the call-weighted mean of each step's median and 99th percentile) and failures."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward/mean" in r]
    out = {"staleness_mean": round(mean([r.get("staleness/mean", 0.0) for r in steps]), 3),
           "staleness_max": max([r.get("staleness/max", 0.0) for r in steps], default=0.0),
           "trainer_idle_frac": round(trainer_idle_fraction(metrics_path), 3)}
    gen = [r for r in steps if "perf/engine_idle_frac" in r]
    if gen:  # the in-process engine with nothing to generate (rollouts may be waiting on tools)
        span = [r["perf/wait_s"] + r["perf/train_s"] + r["perf/weight_sync_s"] for r in gen]
        out["engine_generating_idle_frac"] = round(sum(
            r["perf/engine_idle_frac"] * t for r, t in zip(gen, span)) / max(sum(span), 1e-9), 3)
    tools = [r for r in steps if r.get("tools/calls")]
    if tools:
        calls = sum(r["tools/calls"] for r in tools)
        for q in ("p50", "p99"):
            out[f"tool_latency_{q}_s"] = round(sum(
                r[f"tools/latency_{q}_s"] * r["tools/calls"] for r in tools) / calls, 3)
        out["tool_calls"] = int(calls)
        out["tool_error_frac"] = round(sum(r["tools/error_frac"] * r["tools/calls"]
                                           for r in tools) / calls, 4)
    return out


@dataclass
class AsyncRun:
    eta: int
    seed: int
    where: str
    summary: RunSummary
    idle: float
    stats: dict
    tail: float | None = None  # the tool service's p99/median (--tails), else None

    def row(self) -> dict:
        s = self.summary
        return {"eta": self.eta, "seed": self.seed, "placement": self.where, "steps": s.steps,
                "train_seconds": round(s.train_seconds, 1),
                "steps_per_s": round(s.steps / max(s.train_seconds, 1e-9), 4),
                "gen_tokens_per_s": round(s.gen_tokens_per_s, 1),
                "engine_idle_frac": round(self.idle, 3),
                "initial_accuracy": s.initial_accuracy, "final_accuracy": s.final_accuracy,
                "best_accuracy": s.best_accuracy, "time_to_target_s": s.time_to_target,
                **self.stats, **({} if self.tail is None else {"tail": self.tail}),
                "curve": s.curve}


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def report_rows(rows: list[dict], target: float | None) -> list[dict]:
    """Per (eta, placement), the mean over seeds; ratios against eta = 0: the synchronous loop
    on the whole machine, or eta = 0 placed as the row is (a --same-placement record).
    Time to target: training seconds to the first evaluation at or above `target`, the mean over
    seeds where a seed that never reached it counts its whole budget (so the mean is a lower
    bound, marked >=; k/n says how many reached it). The speedup is marked >= or <= when one side
    is such a bound, ~ when both are."""
    by = {}
    for r in rows:
        by.setdefault((r["eta"], r["placement"]), []).append(r)

    def reached(run: dict) -> tuple[float, bool]:
        """Training seconds to the target (from the curve, so --report can take another
        target), or the run's whole budget, censored, when it never got there."""
        hit = next((t for _, t, acc in run["curve"] if target is not None and acc >= target),
                   None)
        return (hit, False) if hit is not None else (run["train_seconds"], True)

    def to_target(runs: list[dict]) -> tuple[float, int]:
        """Mean over seeds (a censored run counts its budget: a lower bound), seeds that hit."""
        got = [reached(r) for r in runs]
        return mean([t for t, _ in got]), sum(not c for _, c in got)

    out = []
    for (eta, where), runs in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1] != SYNC)):
        base = by.get((0, SYNC)) or by.get((0, where))
        sps, gen = mean([r["steps_per_s"] for r in runs]), mean([r["gen_tokens_per_s"]
                                                                 for r in runs])
        t_mean, hits = to_target(runs)
        speed = "1.00x" if runs is base else "-"
        if base and hits and runs is not base:
            b_mean, b_hits = to_target(base)
            bound = (">=" if b_hits < len(base) else "") if hits == len(runs) else "<=" \
                if b_hits == len(base) else "~"
            speed = f"{bound}{b_mean / t_mean:.2f}x"
        out.append({
            "eta": eta, "placement": where, "seeds": len(runs), "steps_per_s": sps,
            "gen_tokens_per_s": gen,
            "engine_idle": mean([r["engine_idle_frac"] for r in runs]),
            "acc_start": mean([r["initial_accuracy"] or 0 for r in runs]),
            "acc_end": mean([r["final_accuracy"] or 0 for r in runs]),
            "acc_best": mean([r["best_accuracy"] or 0 for r in runs]),
            "to_target": (f"{'>=' if hits < len(runs) else ''}{t_mean:.0f} s "
                          f"({hits}/{len(runs)})"),
            "steps_vs_sync": sps / mean([r["steps_per_s"] for r in base]) if base else None,
            "gen_vs_sync": gen / mean([r["gen_tokens_per_s"] for r in base]) if base else None,
            "speedup": speed})
    return out


def report(rows: list[dict], target: float | None, console: Console) -> None:
    """report_rows as a table, then every run's curve."""
    table = Table(title="asyncrl train: each eta against eta = 0 (the synchronous loop on the "
                        "whole machine, else eta = 0 placed alike); target "
                        f"{'-' if target is None else f'{target:.0%}'} held-out greedy accuracy; "
                        "mean over seeds")
    for col in ("eta", "placement", "seeds", "steps/s", "gen tok/s", "engine idle",
                "acc start", "acc end", "acc best", "t to target (k/n)", "steps/s vs sync",
                "gen tok/s vs sync", "time-to-target speedup"):
        table.add_column(col, justify="right")
    pct = lambda x: "-" if x is None or x != x else f"{x:.1%}"  # noqa: E731
    ratio = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    for r in report_rows(rows, target):
        table.add_row(str(r["eta"]), r["placement"], str(r["seeds"]), f"{r['steps_per_s']:.3f}",
                      f"{r['gen_tokens_per_s']:,.0f}", pct(r["engine_idle"]),
                      pct(r["acc_start"]), pct(r["acc_end"]), pct(r["acc_best"]),
                      r["to_target"], ratio(r["steps_vs_sync"]), ratio(r["gen_vs_sync"]),
                      r["speedup"])
    console.print(table)
    for r in rows:
        pts = ", ".join(f"{step}:{acc:.0%}@{t:.0f}s" for step, t, acc in r["curve"])
        console.print(f"eta={r['eta']} seed={r['seed']} ({r['placement']}) curve "
                      f"(step:accuracy@training seconds): {pts}", soft_wrap=True)


def time_to(run: dict, target: float) -> tuple[float, bool]:
    """Training seconds to the first evaluation at or above `target` (from the curve), or the
    run's whole budget, censored (True), when it never got there."""
    hit = next((t for _, t, acc in run["curve"] if acc >= target), None)
    return (hit, False) if hit is not None else (run["train_seconds"], True)


def tail_ratios(rows: list[dict], target: float) -> dict:
    """Per tail and eta > 0: time to `target` over eta 0's (seed by seed, and the mean over
    seeds; < 1: sooner). A censored time is the run's budget, so a ratio with one is a bound."""
    out: dict = {}
    for tail in sorted({r["tail"] for r in rows}):
        base = {r["seed"]: time_to(r, target) for r in rows if r["tail"] == tail
                and r["eta"] == 0}
        for eta in sorted({r["eta"] for r in rows if r["tail"] == tail and r["eta"]}):
            runs = [r for r in rows if r["tail"] == tail and r["eta"] == eta
                    and r["seed"] in base]
            per_seed = {}
            for r in runs:
                (t, cut), (t0, cut0) = time_to(r, target), base[r["seed"]]
                per_seed[str(r["seed"])] = {"ratio": round(t / t0, 3), "censored": cut or cut0}
            if runs:
                t = mean([time_to(r, target)[0] for r in runs])
                t0 = mean([base[r["seed"]][0] for r in runs])
                out.setdefault(f"r={tail:g}", {})[f"eta={eta}"] = {
                    "mean": round(t / t0, 3), "per_seed": per_seed}
    return out


def report_tails(rows: list[dict], targets: list[float], console: Console) -> None:
    """The tool-calling study: per tail r and eta, mean over seeds; times to each target and
    their ratio to eta 0's (a censored run counts its budget: >= marks a lower bound)."""
    table = Table(title="Episodes that wait on a tool (configured service time, lognormal, "
                        "p99 = r x median): eta 0 (synchronous) vs asynchronous, same config, "
                        "concurrency and budget; mean over seeds")
    cols = ["r", "eta", "seeds", "steps/s", "engine idle", "trainer waits", "tool p50 s",
            "tool p99 s", "staleness", "acc start", "acc end",
            *[f"t to {t:.0%}" for t in targets], *[f"vs eta 0 @{t:.0%}" for t in targets]]
    for col in cols:
        table.add_column(col, justify="right")
    pct = lambda x: "-" if x is None else f"{x:.1%}"  # noqa: E731
    for tail in sorted({r["tail"] for r in rows}):
        base = [r for r in rows if r["tail"] == tail and r["eta"] == 0]
        for eta in sorted({r["eta"] for r in rows if r["tail"] == tail}):
            runs = [r for r in rows if r["tail"] == tail and r["eta"] == eta]
            times, ratios = [], []
            for target in targets:
                got = [time_to(r, target) for r in runs]
                t = mean([x for x, _ in got])
                times.append(f"{'>=' if any(c for _, c in got) else ''}{t:.0f}s "
                             f"({sum(not c for _, c in got)}/{len(got)})")
                if eta and base:
                    t0 = mean([time_to(r, target)[0] for r in base])
                    ratios.append(f"{t / t0:.2f}")
                else:
                    ratios.append("1.00" if not eta else "-")
            avg = lambda key: mean([r.get(key, float("nan")) for r in runs])  # noqa: E731
            table.add_row(f"{tail:g}", str(eta), str(len(runs)), f"{avg('steps_per_s'):.3f}",
                          pct(avg("engine_generating_idle_frac")),
                          pct(avg("trainer_idle_frac")),
                          f"{avg('tool_latency_p50_s'):.2f}", f"{avg('tool_latency_p99_s'):.2f}",
                          f"{avg('staleness_mean'):.2f}", pct(avg("initial_accuracy")),
                          pct(avg("final_accuracy")), *times, *ratios)
    console.print(table)
    console.print("vs eta 0: the time to the target over eta 0's (< 1: sooner); a run that never "
                  "reached it counts its whole budget")


def run_real_benchmark(etas: list[int], seeds: list[int], target: float | None,
                       max_seconds: float, config: str | None, overrides: list[str], out: Path,
                       record: Path | None, sync_split: bool = False,
                       shared: bool = False, tails: list[float] | None = None,
                       targets: list[float] | None = None,
                       same_placement: bool = False) -> list[dict]:
    """Every (seed, eta) as its own `asyncrl train` process, seeds outermost (a stopped run
    leaves balanced seeds); the record is rewritten after each run. `tails`: for the
    tool-calling job, every (tail, seed, eta) with the tool service's p99/median set to the
    tail, reported against `targets` (the middle one's ratios are the record's
    `time_to_target_ratio`)."""
    console = Console(width=200)
    rows: list[dict] = []
    plan = [(seed, eta, eta > 0 and not same_placement, False)
            for seed in seeds for eta in sorted(set([0, *etas]))]
    if sync_split:
        plan += [(seed, 0, True, False) for seed in seeds]
    if shared:
        plan += [(seed, eta, False, True) for seed in seeds for eta in sorted(set(etas)) if eta]
    plan_tails: list[float | None] = list(tails) if tails else [None]
    if record is not None and record.is_file():  # add to it: runs already there are kept
        old = json.loads(record.read_text())
        same = {"config": config, "max_seconds": max_seconds, "overrides": overrides}
        if {k: old.get(k) for k in same} != same:
            raise SystemExit(f"{record} holds runs of other settings "
                             f"({ {k: old.get(k) for k in same} }); give another --record")
        rows = old["runs"]
    done = {(r.get("tail"), r["seed"], r["eta"], r["placement"]) for r in rows}
    for tail in plan_tails:
        for seed, eta, split, inproc in plan:
            where, place = placement(eta, split, inproc, same_placement)
            if (tail, seed, eta, where) in done:
                continue
            at = [] if tail is None else [f"workflow.service.p99_over_median={tail}"]
            label = f"{'' if tail is None else f'r={tail:g} '}eta={eta} seed={seed} ({where})"
            suffix = "-split" if split and eta == 0 else "-shared" if inproc else ""
            run_dir = (out if tail is None else out / f"r{tail:g}") / f"seed{seed}" / \
                f"eta{eta}{suffix}"
            summary = run_train(label, run_dir, config,
                                [f"rollout.max_head_offpolicyness={eta}", f"seed={seed}",
                                 f"max_train_seconds={max_seconds}", *place, *at, *overrides],
                                console, target)
            if summary is None:
                continue
            metrics = run_dir / "metrics.jsonl"
            rows.append(AsyncRun(eta, seed, where, summary, idle_fraction(metrics),
                                 run_stats(metrics), tail).row())
            if record is not None:
                body = {"command": " ".join(["python", *sys.argv]), "config": config,
                        "max_seconds": max_seconds, "target": target, "overrides": overrides,
                        "cpus": sorted(os.sched_getaffinity(0)), "runs": rows}
                if tails:
                    middle = sorted(targets)[len(targets) // 2]
                    body.update(targets=targets, tails=tails, middle_target=middle,
                                time_to_target_ratio=tail_ratios(rows, middle),
                                ratio_definition="training seconds to the middle target at "
                                "this eta over eta 0's, same seed (< 1: sooner); a run that "
                                "never reached it counts its whole budget (censored)")
                record.write_text(json.dumps(body, indent=1))
    if tails:
        report_tails(rows, targets, console)
    else:
        report(rows, target, console)
    return rows
