"""The async-vs-sync simulator (benchmarks/async_sim.py) and its CLI's sim mode."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import async_sim
from async_sim import (
    Placement,
    Refill,
    SimConfig,
    best_of,
    simulate,
    split_candidates,
)

from asyncrl.rollout import staleness

# Small but long-tailed: 32 prompts x 4 answers per step, lengths up to 16k.
SMALL = SimConfig(devices=8, batch_size=32, group_size=4, max_batch=32, steps=10, warmup_steps=2)
SPLITS = [0.5, 0.625, 0.75]


def test_drives_the_real_staleness_manager():
    assert async_sim.StalenessManager is staleness.StalenessManager


@pytest.mark.parametrize("placement", [Placement.COLOCATED, Placement.SPLIT])
def test_eta0_never_overlaps_generation_and_training(placement):
    # SPLIT keeps the servers free during training, so zero overlap there comes from admission.
    r = simulate(replace(SMALL, eta=0, placement=placement, gen_fraction=0.5))
    assert r.overlap_tokens == 0.0
    assert r.max_running_at_train == 0
    assert r.staleness == [0] * (SMALL.steps * SMALL.batch_size)
    assert r.stale_dropped == 0
    # ...whereas eta = 1 on the same split does generate while the trainer computes.
    r1 = simulate(replace(SMALL, eta=1, placement=Placement.SPLIT, gen_fraction=0.5))
    assert r1.overlap_tokens > 0 and r1.max_running_at_train > 0


def test_consumed_staleness_never_exceeds_eta():
    dropped = 0
    for eta in (1, 2, 4):
        for sigma, resample, seed in ((1.0, True, 0), (1.5, False, 1), (1.25, True, 2)):
            cfg = replace(SMALL, eta=eta, devices=16, sigma=sigma, resample_on_drop=resample,
                          refill=Refill.CONTINUOUS, seed=seed)
            r = simulate(cfg)
            assert len(r.staleness) == cfg.steps * cfg.batch_size
            assert 0 <= min(r.staleness) and r.max_staleness <= eta, (eta, sigma, seed)
            assert r.max_staleness >= 1  # genuinely off-policy data was consumed
            dropped += r.stale_dropped
    assert dropped > 0  # the too-stale drop path was exercised, and still the bound held


def test_async_beats_sync_on_a_long_tail():
    base = replace(SMALL, devices=16, sigma=1.0)
    sync = simulate(base)
    best = best_of([simulate(c) for c in split_candidates(replace(base, eta=4), SPLITS)])
    assert best.steps_per_hour > 1.5 * sync.steps_per_hour
    assert best.trained_tokens_per_s > sync.trained_tokens_per_s
    assert best.gen_util > sync.gen_util


def test_deterministic_for_a_seed():
    cfg = replace(SMALL, eta=2, devices=16)
    a, b = simulate(cfg), simulate(cfg)
    assert a == b
    c = simulate(replace(cfg, seed=1))
    assert c.staleness != a.staleness or c.steps_per_hour != a.steps_per_hour


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="SimConfig.eta=-1"):
        SimConfig(eta=-1)
    with pytest.raises(ValueError, match="warmup_steps"):
        SimConfig(steps=2, warmup_steps=2)


def test_split_candidates_are_distinct_and_keep_both_sides():
    cands = split_candidates(SimConfig(eta=1, devices=4), [0.1, 0.5, 0.625, 0.9])
    assert [(c.gen_servers, c.train_devices) for c in cands] == [(1, 3), (2, 2), (3, 1)]


def test_cli_quick_sim_runs():
    out = subprocess.run([sys.executable, str(BENCHMARKS / "bench_async.py"), "--mode", "sim",
                          "--quick", "--jobs", "1"], capture_output=True, text=True, timeout=60,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "MODEL" in out.stdout and "2.77x" in out.stdout and "speedup" in out.stdout


def test_real_mode_summary_reads_a_run(tmp_path):
    import json

    from async_real import SYNC, AsyncRun, idle_fraction, report, run_stats, summarise
    from rich.console import Console

    step = {"perf/wait_s": 1.0, "perf/train_s": 2.0, "perf/weight_sync_s": 1.0}
    rows = [{"step": 0, "eval/greedy_accuracy": 0.1, "time/elapsed_s": 0.0},
            {"step": 1, "reward/mean": 0.2, "time/elapsed_s": 5.0, "perf/gen_tokens_per_s": 9.0,
             "perf/rollout_idle_frac": 0.5, **step},
            {"step": 2, "reward/mean": 0.3, "time/elapsed_s": 9.0, "perf/gen_tokens_per_s": 11.0,
             "perf/rollout_idle_frac": 0.0, **step, "perf/train_s": 6.0,
             "eval/greedy_accuracy": 0.5}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    s = summarise(0, path, target=0.4)
    assert (s.steps, s.train_seconds, s.time_to_target) == (2, 9.0, 9.0)
    assert s.initial_accuracy == 0.1 and s.best_accuracy == 0.5 and s.gen_tokens_per_s == 11.0
    assert idle_fraction(path) == pytest.approx(0.5 * 4 / 12)  # weighted by each step's time
    stats = run_stats(path)
    assert stats["trainer_idle_frac"] == pytest.approx(2 / 12, abs=1e-3)  # waits over steps
    sync = AsyncRun(0, 0, SYNC, s, 0.3, stats).row()
    fast = AsyncRun(2, 0, "split", summarise(2, path, target=0.4), 0.0, stats).row()
    fast["steps_per_s"] *= 2
    fast["curve"] = [(0, 0.0, 0.1), (2, 3.0, 0.5)]  # the target 3x sooner
    console = Console(record=True, width=250)
    report([sync, fast], 0.4, console)
    text = console.export_text()
    assert "3.00x" in text and "2.00x" in text and "30.0%" in text


def test_same_placement_rows_compare_with_eta0_placed_alike():
    """A --same-placement record has no whole-machine synchronous run: each eta's ratios are
    against eta = 0 in the same placement."""
    from async_real import OWN, report_rows

    def run(eta, sps, reach_s):
        return {"eta": eta, "placement": OWN, "steps_per_s": sps, "gen_tokens_per_s": 10.0 * sps,
                "engine_idle_frac": 0.5, "initial_accuracy": 0.1, "final_accuracy": 0.8,
                "best_accuracy": 0.8, "train_seconds": 100.0,
                "curve": [(0, 0.0, 0.1), (5, reach_s, 0.8)]}

    rows = report_rows([run(0, 0.2, 30.0), run(2, 0.3, 20.0)], 0.7)
    assert [r["speedup"] for r in rows] == ["1.00x", "1.50x"]
    assert rows[1]["steps_vs_sync"] == pytest.approx(1.5)


def test_tool_study_ratios_are_per_seed_and_censored_runs_count_their_budget():
    """bench_async --tails: time to the target at each eta over eta 0's, seed by seed; a run
    that never reached it counts its whole budget and is marked censored."""
    from async_real import report_tails, tail_ratios
    from rich.console import Console

    def run(eta, seed, curve, seconds=100.0):
        return {"tail": 20.0, "eta": eta, "seed": seed, "train_seconds": seconds,
                "curve": curve, "steps_per_s": 1.0}

    rows = [run(0, 0, [(0, 0.0, 0.1), (5, 80.0, 0.5)]), run(4, 0, [(0, 0.0, 0.1), (9, 20.0, 0.5)]),
            run(0, 1, [(0, 0.0, 0.1), (5, 100.0, 0.2)]), run(4, 1, [(0, 0.0, 0.1), (9, 25.0, 0.4)])]
    ratios = tail_ratios(rows, 0.4)["r=20"]["eta=4"]
    assert ratios["per_seed"] == {"0": {"ratio": 0.25, "censored": False},
                                  "1": {"ratio": 0.25, "censored": True}}
    assert ratios["mean"] == pytest.approx(22.5 / 90.0, abs=1e-3)
    console = Console(record=True, width=250)
    report_tails(rows, [0.3, 0.4], console)
    assert "0.25" in console.export_text()
