"""The GPU run's scripts, rehearsed on the CPU so that a session lent a GPU spends its device time
measuring, not finding a script broken by a change made since the last GPU run.

benchmarks/gpu_checks.sh runs on a CUDA machine; here it is checked for its syntax and for the
test files it names, and its benchmarks run as CPU smoke runs (the tiny preset, real
subprocesses, their JSON records read back). The CUDA-only sides (graphs captured, HF's compiled
static cache) need a GPU and are not run here.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_checks.sh"


def run(args: list[str], tmp_path: Path) -> dict:
    record = tmp_path / "record.json"
    proc = subprocess.run([sys.executable, *args, "--device", "cpu", "--preset", "tiny",
                           "--record", str(record)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(record.read_text())


def test_gpu_checks_script_parses_and_names_existing_tests():
    for script in (SCRIPT, ROOT / "benchmarks" / "gpu_wheels.sh"):
        subprocess.run(["bash", "-n", str(script)], check=True)
    text = SCRIPT.read_text()
    named = set(re.findall(r"tests/[\w/]+\.py", text))
    assert len(named) >= 10, named
    assert not [t for t in named if not (ROOT / t).is_file()]
    benchmarks = set(re.findall(r"benchmarks/\w+\.py", text))
    assert {"benchmarks/bench_gpu_engine.py", "benchmarks/bench_gpu_train.py"} <= benchmarks
    assert not [b for b in benchmarks if not (ROOT / b).is_file()]


def test_engine_benchmark_cpu_smoke_run(tmp_path):
    rec = run(["benchmarks/bench_gpu_engine.py", "--batch-sizes", "1,2", "--prompt-len", "8",
               "--new-tokens", "4", "--repeats", "1"], tmp_path)
    rows = {(r["batch"], r["side"]): r for r in rec["rows"]}
    assert set(rows) == {(b, s) for b in (1, 2) for s in ("eager", "hf")}
    assert all(r["tok_s"] > 0 for r in rows.values())
    assert rows[1, "eager"]["trainer_logprob_gap"] < 1e-4  # fp32 on the CPU
    assert rows[2, "eager"]["over_hf"] > 0


def test_trainer_benchmark_cpu_smoke_run(tmp_path):
    rec = run(["benchmarks/bench_gpu_train.py", "--samples", "4", "--min-len", "8",
               "--max-len", "32", "--repeats", "1"], tmp_path)
    assert rec["ours_tok_s"] > 0 and rec["hf_tok_s"] > 0
    assert rec["ours_computed_per_real_token"] == 1.0  # packed: no padding computed
    assert rec["hf_computed_per_real_token"] >= 1.0


def test_weight_push_benchmark_cpu_smoke_run(tmp_path):
    rec = run(["benchmarks/bench_nccl_sync.py"], tmp_path)
    assert rec["backend"] == "gloo"
    (row,) = rec["rows"]
    assert set(row["best_seconds"]) == {"buckets", "flat", "per_tensor"}
    assert all(s > 0 for s in row["best_seconds"].values())
