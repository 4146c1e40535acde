"""Asynchronous (staleness bound eta > 0) vs synchronous (eta = 0) RL, at equal hardware.

--mode real: the actual `asyncrl train` job on the long-tailed chain task (configs/train_chain.yaml)
    for every seed and eta: eta = 0 is the synchronous loop on the whole machine (one process;
    the engine generates with every core, then the trainer trains with every core); eta > 0 puts
    the engine in a server process on half of the cores and the trainer on the other half, as
    on separate GPUs (benchmarks/async_real.py). It prints steps/s, generated tokens/s, the
    engine's idle share (training time with no rollout running), the training time to
    --target-accuracy and the ratios against eta = 0; --record keeps every run as JSON.
--mode sim: a discrete-event MODEL (benchmarks/async_sim.py, virtual time, runs in seconds) of many
    inference servers with long-tailed generation lengths. Admission and consumption are the real
    `StalenessManager`, driven as `WorkflowExecutor.prepare_batch` drives it. Synchronous RL is the
    colocated loop (every device generates, then every device trains); asynchronous RL splits the
    same devices into serving and training ones (--gen-fraction, and the best of --splits). It
    reports training steps per hour, trained tokens/s, utilisation, consumed staleness (checked
    <= eta) and the speedup over eta = 0, then how the speedup scales with the number of devices
    (fixed batch, and batch growing with devices), with the tail of the length distribution and
    with the rollout queue's refill policy. The published reference (AReaL) is up to 2.77x for
    fully asynchronous over synchronous RL at equal hardware; these numbers come from a model,
    not a measurement, and move with its parameters (every one is a flag). Virtual time does not
    depend on this machine, so unlike the other benchmarks no matmul GFLOP/s is printed.

Run from the repository root:

    python benchmarks/bench_async.py --mode real --record benchmarks/results/bench_async_real.json
    python benchmarks/bench_async.py --mode real --report benchmarks/results/bench_async_real.json

    python benchmarks/bench_async.py --mode sim                    # full grid, < 60 s on 2 cores
    python benchmarks/bench_async.py --mode sim --quick            # a few seconds
    python benchmarks/bench_async.py --mode sim --devices 32 --etas 0,4 --sigma 1.5 --sync-s 10
"""
from __future__ import annotations

import argparse
from pathlib import Path
import math
import os
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import fields, replace

from async_sim import Refill, SimConfig, SimResult, best_of, simulate, split_candidates
from rich.console import Console
from rich.table import Table

AREAL_SPEEDUP = 2.77  # AReaL paper: fully asynchronous over synchronous RL, equal hardware
SIM_HELP = {  # SimConfig fields exposed as flags (eta and devices are lists, given separately)
    "gen_fraction": "async: share of the devices that serve (also always tried: --splits)",
    "batch_size": "episodes (prompts) per training step", "group_size": "answers per prompt",
    "max_batch": "concurrent sequences per server", "oversubscribe":
    "max_concurrent_rollouts = this * server slots / group_size (extra sequences queue)",
    "step_a": "decode step seconds, fixed part", "step_b": "decode step seconds per sequence",
    "prefill_tps": "prefill / post-update KV recompute tokens/s per server",
    "median_len": "generated length, lognormal median", "sigma": "lognormal sigma (tail)",
    "max_len": "generation cap (tokens)", "prompt_len": "prompt tokens",
    "train_tps": "trained tokens/s per training device", "sync_s": "weight-sync pause per step",
    "steps": "training steps simulated", "warmup_steps": "steps excluded from the rates",
    "resample_on_drop": "a dropped prompt draws new lengths (--no-...: the same lengths again)",
    "refill": "when the rollout queue is topped up (every_call = WorkflowExecutor today)",
    "seed": "length sampling seed",
}

def make_console() -> Console:
    console = Console()  # wide tables: never squeeze them below 150 columns (pipes default to 80)
    return console if console.width >= 150 else Console(width=150)


QUICK = {"devices": "4,16", "weak_prompts_per_device": 4, "etas": "0,2,4", "splits": "0.5,0.75",
         "sigmas": "0.5,1.0", "batch_size": 64, "steps": 6, "warmup_steps": 1}


def run_real(args: argparse.Namespace) -> None:
    """Time to --target-accuracy of the real loop, eta = 0 vs each of --etas, every seed."""
    import json

    from async_real import report, report_tails, run_real_benchmark

    tails, targets = floats(args.tails) if args.tails else None, floats(args.targets)
    if args.report:
        rec = json.loads(Path(args.report).read_text())
        if rec.get("tails"):
            report_tails(rec["runs"], rec["targets"], Console(width=200))
        else:
            report(rec["runs"], args.target_accuracy, Console(width=160))
        return
    if tails and len(targets) < 1:
        raise SystemExit("--tails needs --targets (e.g. 0.3,0.4,0.5)")
    run_real_benchmark(args.etas, ints(args.seeds), args.target_accuracy, args.max_seconds,
                       args.config, args.set, Path(args.out),
                       Path(args.record) if args.record else None, args.sync_split, args.shared,
                       tails, targets, args.same_placement)


# ---- simulation --------------------------------------------------------------------------------


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def run_all(configs: list[SimConfig], jobs: int) -> dict[SimConfig, SimResult]:
    """Every distinct config once, over `jobs` processes (each run is deterministic)."""
    unique = list(dict.fromkeys(configs))
    if jobs <= 1:
        return dict(zip(unique, map(simulate, unique)))
    with ProcessPoolExecutor(max_workers=jobs) as pool:
        return dict(zip(unique, pool.map(simulate, unique, chunksize=1)))


def candidates(base: SimConfig, eta: int, devices: int, splits: list[float]) -> list[SimConfig]:
    cfg = replace(base, eta=eta, devices=devices)
    return [cfg] if eta == 0 else split_candidates(cfg, [base.gen_fraction, *splits])


def check_staleness(r: SimResult) -> None:
    if r.max_staleness > r.config.eta:  # simulate() raises first; this guards the printout
        raise SystemExit(f"consumed staleness {r.max_staleness} > eta={r.config.eta}")


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def main_table(base: SimConfig, args: argparse.Namespace,
               res: dict) -> dict[tuple[int, int], float]:
    t = Table(title="Steady-state throughput (MODEL, virtual time)", title_justify="left")
    for name, just in [("devices", "right"), ("eta", "right"), ("gen+train", "right"),
                       ("steps/h", "right"), ("trained tok/s", "right"), ("gen util", "right"),
                       ("train util", "right"), ("stale mean/max", "right"),
                       ("dropped (tok)", "right"), ("mean len", "right"), ("speedup", "right"),
                       ("tok/s x", "right"), ("best split", "right"), ("best speedup", "right")]:
        t.add_column(name, justify=just)
    best_speedups = {}
    for dev in args.devices:
        sync = res[candidates(base, 0, dev, [])[0]]
        for eta in args.etas:
            runs = [res[c] for c in candidates(base, eta, dev, args.splits)]
            for r in runs:
                check_staleness(r)
            flag, best = runs[0], best_of(runs)
            best_speedups[dev, eta] = best.steps_per_hour / sync.steps_per_hour
            where = "colocated" if eta == 0 else f"{flag.gen_servers}+{flag.train_devices}"
            t.add_row(
                str(dev), str(eta), where, f"{flag.steps_per_hour:.1f}",
                f"{flag.trained_tokens_per_s:,.0f}", pct(flag.gen_util), pct(flag.train_util),
                f"{flag.mean_staleness:.2f} / {flag.max_staleness}",
                f"{pct(flag.drop_rate)} ({pct(flag.wasted_token_share)})",
                f"{flag.consumed_mean_len:,.0f}",
                f"{flag.steps_per_hour / sync.steps_per_hour:.2f}x",
                f"{flag.trained_tokens_per_s / sync.trained_tokens_per_s:.2f}x",
                "-" if eta == 0 else f"{best.gen_servers}+{best.train_devices}",
                f"[bold]{best_speedups[dev, eta]:.2f}x[/bold]")
        t.add_section()
    make_console().print(t)
    return best_speedups


def weak(base: SimConfig, args: argparse.Namespace, dev: int) -> SimConfig:
    return replace(base, batch_size=args.weak_prompts_per_device * dev)


def scaling_table(base: SimConfig, args: argparse.Namespace, res: dict,
                  best: dict[tuple[int, int], float]) -> None:
    etas, top, ppd = [e for e in args.etas if e > 0], max(args.etas), args.weak_prompts_per_device
    t = Table(title=f"Speedup over eta=0 vs devices (best split; published AReaL reference: up to "
                    f"{AREAL_SPEEDUP}x)", title_justify="left")
    t.add_column("devices", justify="right")
    for eta in etas:
        t.add_column(f"eta={eta}\n{base.batch_size} prompts", justify="right")
    if ppd:
        t.add_column(f"eta={top}\n{ppd} prompts/device", justify="right")
    t.add_column("AReaL (paper)", justify="right")
    for dev in args.devices:
        extra = []
        if ppd:
            b = weak(base, args, dev)
            sync = res[candidates(b, 0, dev, [])[0]]
            r = best_of([res[c] for c in candidates(b, top, dev, args.splits)])
            check_staleness(r)
            extra = [f"{r.steps_per_hour / sync.steps_per_hour:.2f}x"]
        t.add_row(str(dev), *[f"{best[dev, e]:.2f}x" for e in etas], *extra, f"{AREAL_SPEEDUP}x")
    make_console().print(t)


def tail_table(base: SimConfig, args: argparse.Namespace, res: dict) -> None:
    eta, dev = max(args.etas), args.tail_devices
    t = Table(title=f"Speedup vs tail heaviness ({dev} devices, eta={eta}, best split; lengths "
                    f"lognormal median {base.median_len:.0f}, cap {base.max_len})",
              title_justify="left")
    for name in ("sigma", "p99 len", "mean len", "sync steps/h", "sync gen util",
                 "async steps/h", "split", "speedup"):
        t.add_column(name, justify="right")
    for sigma in args.sigmas:
        b = replace(base, sigma=sigma)
        sync = res[candidates(b, 0, dev, [])[0]]
        best = best_of([res[c] for c in candidates(b, eta, dev, args.splits)])
        check_staleness(best)
        p99 = min(base.max_len, base.median_len * math.exp(2.326 * sigma))
        t.add_row(f"{sigma:g}", f"{p99:,.0f}", f"{sync.consumed_mean_len:,.0f}",
                  f"{sync.steps_per_hour:.1f}", pct(sync.gen_util), f"{best.steps_per_hour:.1f}",
                  f"{best.gen_servers}+{best.train_devices}",
                  f"[bold]{best.steps_per_hour / sync.steps_per_hour:.2f}x[/bold]")
    make_console().print(t)


REFILL_TEXT = {Refill.WHEN_SHORT: "when_short (old executor)",
               Refill.EVERY_CALL: "every_call (executor today)",
               Refill.CONTINUOUS: "continuous"}


def refill_table(base: SimConfig, args: argparse.Namespace, res: dict) -> None:
    eta = max(args.etas)
    t = Table(title=f"Speedup by rollout-queue refill policy (eta={eta}, best split). when_short: "
                    "prepare_batch submits only while fewer than a batch are ready (the first "
                    "WorkflowExecutor); every_call: also when a batch is ready (today's "
                    "executor); continuous: "
                    "also during training", title_justify="left")
    t.add_column("devices", justify="right")
    for refill in Refill:
        t.add_column(REFILL_TEXT[refill], justify="right")
    for dev in args.devices:
        sync = res[candidates(base, 0, dev, [])[0]]
        cells = []
        for refill in Refill:
            b = replace(base, refill=refill)
            r = best_of([res[c] for c in candidates(b, eta, dev, args.splits)])
            check_staleness(r)
            cells.append(f"{r.steps_per_hour / sync.steps_per_hour:.2f}x (gen {pct(r.gen_util)}, "
                         f"train {pct(r.train_util)})")
        t.add_row(str(dev), *cells)
    make_console().print(t)


def run_sim(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    base = SimConfig(**{name: getattr(args, name) for name in SIM_HELP})
    etas = sorted(set(args.etas) | {0})
    args.etas = etas
    cfgs = [c for d in args.devices for e in etas for c in candidates(base, e, d, args.splits)]
    for sigma in args.sigmas:
        b = replace(base, sigma=sigma)
        cfgs += [c for e in (0, max(etas))
                 for c in candidates(b, e, args.tail_devices, args.splits)]
    if args.weak_prompts_per_device:
        cfgs += [c for d in args.devices for e in (0, max(etas))
                 for c in candidates(weak(base, args, d), e, d, args.splits)]
    for refill in Refill:
        b = replace(base, refill=refill)
        cfgs += [c for d in args.devices for c in candidates(b, max(etas), d, args.splits)]
    res = run_all(cfgs, args.jobs)

    b = base
    peak = b.max_batch / b.step_time(b.max_batch)
    console = make_console()
    console.print(
        "[bold]Asynchronous vs synchronous RL at equal hardware: a discrete-event MODEL, not a "
        "measurement.[/bold]\n"
        f"Per step: {b.batch_size} prompts x {b.group_size} answers; lengths lognormal(median "
        f"{b.median_len:.0f}, sigma {b.sigma:g}) capped at {b.max_len}, prompt {b.prompt_len}. "
        f"Server: <= {b.max_batch} sequences, decode step {b.step_a * 1e3:g} + "
        f"{b.step_b * 1e3:g} ms x batch (peak {peak:,.0f} tok/s), prefill {b.prefill_tps:,.0f} "
        f"tok/s. Trainer {b.train_tps:,.0f} tok/s per device; weight sync {b.sync_s:g} s/step. "
        f"{b.steps} steps ({b.warmup_steps} warm-up), seed {b.seed}.\n"
        "eta=0: every device generates, then every device trains ('colocated', synchronous). "
        "eta>0: 'gen+train' devices run concurrently (split --gen-fraction); 'best split' tries "
        f"{', '.join(f'{s:g}' for s in args.splits)}. Admission is the real StalenessManager; "
        "consumed staleness is checked <= eta. gen util = generated tokens / what the serving "
        "devices decode at full batch; dropped = trajectories staler than eta (re-run), with "
        "the share of generated tokens wasted; mean len = generated length of trained "
        "sequences (drops bias it short).")
    best = main_table(base, args, res)
    scaling_table(base, args, res, best)
    tail_table(base, args, res)
    refill_table(base, args, res)
    console.print(
        f"Reference: AReaL reports up to {AREAL_SPEEDUP}x for fully asynchronous over synchronous "
        "RL at equal hardware (a measurement on GPUs). The numbers above come from a model whose "
        "speedup is mostly the synchronous loop's idle time (waiting for the longest answer, "
        "generation idle while training), so they grow with the tail and with devices per "
        "prompt (with a hard length cap the tail speedup peaks once p99 reaches the cap: beyond "
        "it sync's barrier stops growing while every step's bulk work still does); "
        "not modelled: learning efficiency per step (stale data), prompt-dependent "
        "lengths, network and memory limits, stragglers and failures. "
        f"{len(res)} runs in {time.perf_counter() - start:.1f} s wall.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("real", "sim"), default="real")
    ap.add_argument("--etas", default=None, help="comma-separated staleness bounds (eta=0 always "
                    "run as the baseline); default 0,1,2,4,8")
    real = ap.add_argument_group("real mode")
    real.add_argument("--target-accuracy", type=float, default=0.35,
                      help="held-out greedy accuracy to reach (real mode)")
    real.add_argument("--max-seconds", type=float, default=240.0,
                      help="training seconds per run (real)")
    real.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (real)")
    real.add_argument("--config", default="configs/train_chain.yaml",
                      help="train config YAML (default: the long-tailed chain job)")
    real.add_argument("--sync-split", action="store_true",
                      help="also run eta = 0 with the split placement (what the split costs)")
    real.add_argument("--shared", action="store_true", help="also run each eta > 0 with the "
                      "engine in the trainer's process, sharing every core (the main job's way)")
    real.add_argument("--tails", default=None, help="tool-calling job (configs/train_tools.yaml)"
                      ": run every eta at each of these tool-latency tails (p99/median, "
                      "comma-separated, e.g. 1,5,20)")
    real.add_argument("--targets", default="", help="with --tails: held-out accuracies to time "
                      "(comma-separated; the middle one's ratios are the record's "
                      "time_to_target_ratio)")
    real.add_argument("--same-placement", action="store_true", help="every eta placed as the "
                      "config places it (no split): only eta changes")
    real.add_argument("--record", default=None, help="write the runs here as JSON (runs it "
                      "already holds are kept and not run again)")
    real.add_argument("--report", default=None, help="reprint the table of a --record file")
    real.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                      help="train config override, repeatable (e.g. --set eval.every=5)")
    real.add_argument("--out", default="runs/bench_async", help="run directories go here")
    sim = ap.add_argument_group("sim mode")
    sim.add_argument("--devices", default="4,8,16,32,64", help="total devices (comma-separated)")
    sim.add_argument("--splits", default="0.5,0.625,0.75,0.875",
                     help="gen fractions tried for the best split")
    sim.add_argument("--sigmas", default="0.5,0.75,1.0,1.25,1.5", help="tail sweep")
    sim.add_argument("--tail-devices", type=int, default=16, help="devices for the tail sweep")
    sim.add_argument("--weak-prompts-per-device", type=int, default=16,
                     help="scaling table: also run batch = this * devices (0: skip)")
    sim.add_argument("--quick", action="store_true", help="small grid, few steps (seconds)")
    sim.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes")
    defaults = SimConfig()
    for f in fields(SimConfig):
        if f.name not in SIM_HELP:
            continue
        value, flag = getattr(defaults, f.name), "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            sim.add_argument(flag, action=argparse.BooleanOptionalAction, default=value,
                             help=SIM_HELP[f.name])
        elif isinstance(value, Refill):
            sim.add_argument(flag, type=Refill, choices=list(Refill), default=value,
                             help=f"{SIM_HELP[f.name]} (default {value.value})")
        else:
            sim.add_argument(flag, type=type(value), default=value,
                             help=f"{SIM_HELP[f.name]} (default {value:g})")
    args = ap.parse_args()
    if args.quick:
        ap.set_defaults(**QUICK)
        args = ap.parse_args()
    args.etas = ints(args.etas or "0,1,2,4,8")
    if args.mode == "real":
        run_real(args)
        return
    args.devices, args.splits = ints(args.devices), floats(args.splits)
    args.sigmas = floats(args.sigmas)
    if args.quick and args.tail_devices not in args.devices:
        args.tail_devices = max(args.devices)
    try:
        run_sim(args)
    except ValueError as e:  # a flag out of range: SimConfig names the field and the range
        ap.error(str(e))


if __name__ == "__main__":
    main()
