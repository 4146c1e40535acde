"""A slow synchronous reward (an HTTP verifier, an LLM judge) and the rollout event loop.

One group of --n completions is scored by a sync `reward(completion, row)` that blocks for
--sleep seconds, while a 10 ms heartbeat task runs on the same event loop (standing in for
every other rollout: token streams, HTTP replies). Reported per way of calling it:

    wall s        time to score the whole group
    worst gap s   the longest the heartbeat waited: how long every other rollout was frozen

The baseline is the reward called on the event loop (what a plain sync call inside an async
rollout does, and what asyncrl did before `reward` ran sync functions off the loop); the
others are `open_reward` with `executor: thread` (the default) and `executor: process`.
Ratios are baseline / ours.

Run from the repository root:

    python benchmarks/bench_reward_offloop.py            # 8 calls of 0.5 s
    python benchmarks/bench_reward_offloop.py --n 32 --sleep 0.2
"""
from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Awaitable
from typing import Any

from asyncrl.reward.call import call_rewards, inline
from asyncrl.reward.config import open_reward

SLEEP_ENV = "BENCH_REWARD_SLEEP"  # --sleep, read by every copy of this module (worker processes)


def slow_verifier(completion: str, row: dict[str, Any]) -> float:
    """Blocks its thread as a remote verifier would, then scores exact match."""
    time.sleep(float(os.environ.get(SLEEP_ENV, "0.5")))
    return 1.0 if completion.strip() == str(row["answer"]) else 0.0


async def with_heartbeat(work: Awaitable[Any]) -> tuple[Any, float, float]:
    """(work's result, wall seconds, the longest gap between 10 ms heartbeats while it ran)."""
    gaps: list[float] = []
    done = asyncio.Event()

    async def beat() -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    task = asyncio.create_task(beat())
    await asyncio.sleep(0.05)
    start = time.monotonic()
    try:
        result = await work
    finally:
        wall = time.monotonic() - start
        done.set()
        await task  # its last beat measures a stall that ended with the work
    return result, wall, max(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=8, help="completions in the group")
    parser.add_argument("--sleep", type=float, default=0.5, help="seconds one reward call blocks")
    args = parser.parse_args()
    os.environ[SLEEP_ENV] = str(args.sleep)
    row = {"id": 0, "answer": "12"}
    completions = ["12" if i % 2 == 0 else "13" for i in range(args.n)]
    expected = [1.0 if i % 2 == 0 else 0.0 for i in range(args.n)]

    results: dict[str, tuple[float, float]] = {}
    on_loop = inline(lambda text, r: slow_verifier(text, r))
    scores, wall, gap = asyncio.run(with_heartbeat(call_rewards(on_loop, completions, row)))
    assert scores == expected, scores
    results["on the loop (baseline)"] = (wall, gap)
    for executor in ("thread", "process"):
        spec = {"kind": "function", "path": "bench_reward_offloop:slow_verifier", "executor": executor,
                "max_workers": args.n}
        with open_reward(spec) as reward:
            scores, wall, gap = asyncio.run(with_heartbeat(call_rewards(reward, completions,
                                                                         row)))
        assert scores == expected, (executor, scores)
        results[f"executor: {executor}"] = (wall, gap)

    base_wall, base_gap = results["on the loop (baseline)"]
    print(f"{args.n} calls of a sync reward that blocks {args.sleep} s, one group")
    print(f"{'':26s} {'wall s':>8s} {'worst gap s':>12s} {'wall x':>8s} {'gap x':>8s}")
    for name, (wall, gap) in results.items():
        print(f"{name:26s} {wall:8.3f} {gap:12.3f} {base_wall / wall:8.1f} {base_gap / gap:8.1f}")


if __name__ == "__main__":
    main()
