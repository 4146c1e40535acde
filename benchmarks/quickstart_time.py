"""How long the README's quick start takes from a fresh clone, as a new user runs it.

    python benchmarks/quickstart_time.py            # record: benchmarks/results/quickstart.json

Clones this repository's HEAD into a scratch directory, makes a new virtual environment there,
runs the README's install command in it (`pip install torch==2.13.0 -e .`; packages come from
pip's own download cache when it has them, as on any machine that has installed them before),
then the README's first command (`asyncrl train configs/train_tiny.yaml`) with an empty asyncrl
cache, and records the wall time of each phase, the total, and the held-out greedy accuracy at
step 0 and at the end of the run. Run it on a quiet machine: the run's budget is training time,
so a busy machine trains fewer steps in it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECORD = ROOT / "benchmarks" / "results" / "quickstart.json"
INSTALL = "pip install torch==2.13.0 -e ."
FIRST = "asyncrl train configs/train_tiny.yaml"


def timed(label: str, cmd: list[str], **kw) -> float:
    print(f"[{label}] {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, **kw)
    took = time.perf_counter() - t0
    print(f"[{label}] {took:.1f} s", flush=True)
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--record", default=str(RECORD), help="'' to write none")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = ap.parse_args()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout.strip()
    scratch = Path(tempfile.mkdtemp(prefix="asyncrl-quickstart-"))
    clone, venv, cache = scratch / "asyncrl", scratch / "venv", scratch / "cache"
    phases = {"clone": timed("clone", ["git", "clone", "-q", str(ROOT), str(clone)])}
    bin_dir = venv / "bin"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               VIRTUAL_ENV=str(venv), ASYNCRL_CACHE=str(cache))
    env.pop("PYTHONPATH", None)
    phases["install"] = (timed("venv", [sys.executable, "-m", "venv", str(venv)])
                         + timed("install", ["bash", "-c", f"python -m {INSTALL} -q"],
                                 cwd=clone, env=env))
    run_dir = scratch / "run"
    phases["first_command"] = timed(
        "first command", ["bash", "-c", f"{FIRST} output_dir={run_dir}"], cwd=clone, env=env)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    accs = [(e["step"], e["score"]) for e in events if e["kind"] == "eval"]
    total = sum(phases.values())
    print(f"total {total / 60:.1f} min: " + ", ".join(f"{k} {v:.0f} s" for k, v in phases.items()))
    if accs:
        print(f"held-out greedy accuracy: {accs[0][1]:.1%} at step {accs[0][0]} -> "
              f"{accs[-1][1]:.1%} at step {accs[-1][0]}")
    if args.record:
        Path(args.record).write_text(json.dumps({
            "command": "python benchmarks/quickstart_time.py", "date":
            datetime.date.today().isoformat(), "commit": head, "cpus": os.cpu_count(),
            "install": INSTALL, "first": FIRST, "seconds": {k: round(v, 1) for k, v in
                                                            phases.items()},
            "total_seconds": round(total, 1), "accuracy_first_last": accs[:1] + accs[-1:],
        }, indent=1) + "\n")
        print(f"record written to {args.record}")
    if not args.keep:
        subprocess.run(["rm", "-rf", str(scratch)], check=False)


if __name__ == "__main__":
    main()
