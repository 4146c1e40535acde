"""`asyncrl train` with counters: what the in-process engine did and where the CPU time went.

    python benchmarks/train_counters.py OUT.json train configs/train_tiny.yaml total_steps=100 \
        max_train_seconds=null output_dir=/tmp/x

Runs the CLI unchanged (every argument after OUT.json is `asyncrl`'s), wrapping the engine's
model runner, request intake and weight updates with counters: prefill calls/sequences/tokens,
decode calls/sequences, requests, weight updates and the sequences in flight at each (their KV
cache is recomputed under the new weights). A sampler thread reads each thread's CPU seconds from
/proc every 2 s (Linux). OUT.json gets both at exit. Used to compare two trees of the code on one
machine (benchmarks/results/issue27_same_machine.txt): run it from each tree in turn.
"""
from __future__ import annotations

import atexit
import collections
import json
import os
import sys
import threading
import time

import asyncrl.inference.engine as engine_mod
import asyncrl.inference.model_runner as runner_mod
from asyncrl.inference.scheduler import Phase

counts: collections.Counter[str] = collections.Counter()
cpu_seconds: dict[int, tuple[str, float]] = {}


def _wrap(cls, name, before):
    original = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        before(self, *args)
        return original(self, *args, **kwargs)
    setattr(cls, name, wrapper)


def _on_run(runner, batch) -> None:
    if batch.phase == Phase.DECODE:
        counts["decode_calls"] += 1
        counts["decode_seqs"] += len(batch.seqs)
    else:
        counts["prefill_calls"] += 1
        counts["prefill_seqs"] += len(batch.seqs)
        counts["prefill_tokens"] += sum(s.num_tokens for s in batch.seqs)


def _on_request(engine, req) -> None:
    counts["requests"] += 1
    counts["request_prompt_tokens"] += len(req.input_ids)


def _on_update(engine, *args) -> None:
    counts["weight_updates"] += 1
    counts["seqs_in_flight_at_updates"] += len(engine.scheduler.running)


def _sample_threads() -> None:
    tick = os.sysconf("SC_CLK_TCK")
    while True:
        names = {t.native_id: t.name for t in threading.enumerate()}
        names[os.getpid()] = "MainThread"
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # the thread ended
            cpu_seconds[int(tid)] = (names.get(int(tid), "native (torch/OpenMP)"),
                                     (int(fields[11]) + int(fields[12])) / tick)
        time.sleep(2)


def _dump(path: str) -> None:
    threads: dict[str, float] = collections.defaultdict(float)
    for name, seconds in cpu_seconds.values():
        threads[name] += seconds
    with open(path, "w") as f:
        json.dump({"engine": counts, "thread_cpu_s": threads}, f, indent=1)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    _wrap(runner_mod.ModelRunner, "run", _on_run)
    _wrap(engine_mod.LLMEngine, "add_request", _on_request)
    _wrap(engine_mod.LLMEngine, "update_weights_from_state_dict", _on_update)
    threading.Thread(target=_sample_threads, daemon=True, name="counter-sampler").start()
    atexit.register(_dump, sys.argv[1])
    from asyncrl.cli import main

    sys.exit(main(sys.argv[2:]))
