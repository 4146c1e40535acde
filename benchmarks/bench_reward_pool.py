"""asyncrl's RewardPool against a pebble ProcessPool (the peer baseline), in the same run.

Both pools get 2 worker processes started with "forkserver" and score the same module-level
functions. Reported:

    per call (sequential)   wall time of one trivial call, one caller: the pool's own overhead
    per call (concurrent)   the same with --calls calls in flight at once (ours: asyncio.gather
                            over pool.score; pebble: schedule() them all, then wait)
    hung call               a call that never returns, timeout 1 s: when the caller gets its
                            answer, and when the next call has succeeded (a fresh worker)
    worker killed           a worker SIGKILLed from outside (the OOM killer, an operator) while
                            calls stream through: seconds from the kill until --after further
                            calls have all succeeded; --trials times, each capped at --cap s

Ratios are pebble / ours (above 1: ours is faster). The last row is why the pool is not built on
pebble: when a worker dies while it holds the pool's shared task-queue lock, pebble's other
workers wait on that lock (pebble issue #163) and the pool stalls until its manager notices.

Run from the repository root (nothing else running: it times processes on a 2-core machine):

    python benchmarks/bench_reward_pool.py
    python benchmarks/bench_reward_pool.py --calls 400 --trials 20 --cap 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import os
import random
import signal
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import wait

import pebble

from asyncrl.reward.pool import RewardPool, RewardPoolConfig, RewardStatus

WORKERS = 2


def trivial(i: int) -> float:
    return 1.0


def worker_pid(i: int) -> int:
    return os.getpid()


def hang(i: int) -> float:
    time.sleep(3600)
    return 1.0


class Ours:
    name = "asyncrl RewardPool"

    def __init__(self, timeout: float = 10.0) -> None:
        self.pool = RewardPool(RewardPoolConfig(num_workers=WORKERS, timeout_seconds=timeout,
                                                preload=[]))

    def call(self, fn: Callable[[int], float], i: int) -> float | None:
        """The score, or None when the call failed (timeout, crash)."""
        out = self.pool.score_sync(fn, i)
        return out.score if out.status is RewardStatus.OK else None

    def many(self, n: int) -> None:
        async def run() -> None:
            await asyncio.gather(*(self.pool.score(trivial, i) for i in range(n)))
        asyncio.run(run())

    def close(self) -> None:
        self.pool.close()

    abandon = close


class Pebble:
    name = "pebble ProcessPool"

    def __init__(self, timeout: float = 10.0) -> None:
        self.timeout = timeout
        self.pool = pebble.ProcessPool(max_workers=WORKERS,
                                       context=multiprocessing.get_context("forkserver"))

    def call(self, fn: Callable[[int], float], i: int) -> float | None:
        try:
            return self.pool.schedule(fn, args=(i,), timeout=self.timeout).result()
        except Exception:  # noqa: BLE001 (TimeoutError, ProcessExpired: the call failed)
            return None

    def many(self, n: int) -> None:
        wait([self.pool.schedule(trivial, args=(i,)) for i in range(n)])

    def close(self) -> None:
        self.pool.stop()
        self.pool.join()

    def abandon(self) -> None:
        """A stalled pool: stop() kills its workers; its threads may never join."""
        self.pool.stop()


def per_call_us(pool, calls: int, rounds: int = 5) -> tuple[float, float]:
    """Median µs per call over `rounds`: sequential, then `calls` in flight at once."""
    for i in range(20):
        pool.call(trivial, i)  # warm: workers up, code imported
    seq, conc = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        for i in range(calls):
            pool.call(trivial, i)
        seq.append((time.perf_counter() - start) / calls * 1e6)
        start = time.perf_counter()
        pool.many(calls)
        conc.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(seq), statistics.median(conc)


def hung_call(make) -> tuple[float, float]:
    """(s until the hung call's caller is answered, s until the next call has succeeded)."""
    pool = make(timeout=1.0)
    try:
        pool.call(trivial, 0)
        start = time.monotonic()
        assert pool.call(hang, 0) is None
        answered = time.monotonic() - start
        while pool.call(trivial, 0) != 1.0:
            pass
        return answered, time.monotonic() - start
    finally:
        pool.close()


def killed_worker(make, trials: int, after: int, cap: float, seed: int) -> list[float]:
    """Seconds from SIGKILLing a worker (at a random moment of a stream of calls) until `after`
    sequential calls have succeeded; `cap` when they had not by then (the pool stalled)."""
    rng = random.Random(seed)
    out: list[float] = []
    for trial in range(trials):
        pool = make()
        stop = threading.Event()
        pids: set[int] = set()

        def traffic() -> None:  # one caller per worker, each taking and answering calls
            with contextlib.suppress(Exception):  # the pool closed under it: the trial is over
                while not stop.is_set():
                    pid = pool.call(worker_pid, 0)
                    if pid is not None:
                        pids.add(int(pid))  # ours returns scores as floats

        streams = [threading.Thread(target=traffic, daemon=True) for _ in range(WORKERS)]
        for t in streams:
            t.start()
        while len(pids) < WORKERS:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.05, 0.3))
        os.kill(rng.choice(sorted(pids)), signal.SIGKILL)
        killed = time.monotonic()
        stop.set()
        done = threading.Event()

        def probe() -> None:
            with contextlib.suppress(Exception):
                ok = 0
                while ok < after:
                    ok += pool.call(trivial, 0) == 1.0
                done.set()

        threading.Thread(target=probe, daemon=True).start()
        recovered = done.wait(cap)
        out.append(time.monotonic() - killed if recovered else cap)
        print(f"  {pool.name}: trial {trial + 1}/{trials}: {out[-1]:.2f} s"
              + ("" if recovered else f" (no recovery within {cap:.0f} s)"), flush=True)
        if recovered:
            pool.close()
        else:
            pool.abandon()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--after", type=int, default=20, help="calls that must succeed after a kill")
    ap.add_argument("--cap", type=float, default=30.0, help="seconds a kill trial may take")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"{WORKERS} workers, forkserver, {os.cpu_count()} cores")
    rows = {}
    for cls in (Ours, Pebble):
        pool = cls()
        try:
            rows[cls] = {"seq": 0.0, "conc": 0.0}
            rows[cls]["seq"], rows[cls]["conc"] = per_call_us(pool, args.calls)
        finally:
            pool.close()
        rows[cls]["hung"] = hung_call(cls)
    for cls in (Ours, Pebble):
        rows[cls]["kill"] = killed_worker(cls, args.trials, args.after, args.cap, args.seed)
    print()
    print(f"{'':24s} {'ours':>12s} {'pebble':>12s} {'pebble/ours':>12s}")

    def row(label: str, a: float, b: float, unit: str) -> None:
        print(f"{label:24s} {a:10.1f}{unit:>2s} {b:10.1f}{unit:>2s} {b / a:11.2f}x")

    o, p = rows[Ours], rows[Pebble]
    row("per call (sequential)", o["seq"], p["seq"], "us")
    row("per call (concurrent)", o["conc"], p["conc"], "us")
    row("hung call: answered", o["hung"][0], p["hung"][0], "s")
    row("hung call: next ok", o["hung"][1], p["hung"][1], "s")
    row("worker killed: median", statistics.median(o["kill"]), statistics.median(p["kill"]), "s")
    row("worker killed: worst", max(o["kill"]), max(p["kill"]), "s")
    stalls = {k: sum(x >= args.cap for x in v["kill"]) for k, v in rows.items()}
    print(f"{'trials stalled >= cap':24s} {stalls[Ours]:10d}/{args.trials} "
          f"{stalls[Pebble]:10d}/{args.trials}")
    os._exit(0)  # a stalled pebble pool's threads would keep the interpreter alive


if __name__ == "__main__":
    main()
