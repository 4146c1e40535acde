"""What a request costs on a kept-alive connection to asyncrl's own HTTP servers.

Clients keep connections open (httpx pools them; the tool workflow's `ToolClient` keeps up to 64),
so every request after a connection's first rides on it. A server whose replies wait for the
client's delayed ACK (Nagle's algorithm left on, see asyncrl/listening.py) adds that wait to each
such request. This benchmark starts the real servers as subprocesses on 127.0.0.1: `asyncrl
serve` (tiny model) and the tool service (no configured service time, the calculator tool), then
times sequential requests on one kept-alive connection against the baseline of a new connection
for every request, alternating the two in rounds so machine noise hits both alike:

- serve /health: `GET /health` (the remote client's probe);
- serve /generate: a 2-token non-streaming `POST /generate` (the logprob canary's call shape);
- tool call: `POST /tools/calc`, the request the tool workflow's `ToolClient` sends (with the
  header that skips the configured service time).

    python benchmarks/bench_http_keepalive.py                 # 40 requests per side and round
    python benchmarks/bench_http_keepalive.py --json benchmarks/results/bench_http_keepalive.json

Prints the median milliseconds per request of each side and the ratio kept-alive / new
connection (below 1: reusing the connection is cheaper, as it should be).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx

from asyncrl.inference.backend_protocol import READY_PREFIX
from asyncrl.models.config import TinyModelConfig
from asyncrl.models.tiny import build_tiny_model
from asyncrl.rollout.tool_service import UNDELAYED, ToolServiceConfig, ToolServiceProcess


def start_serve(model_dir: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "serve", "--model",
                             str(model_dir), "--port", "0"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith(READY_PREFIX):
        proc.kill()
        raise RuntimeError(f"asyncrl serve did not start: {line!r}")
    return proc, line[len(READY_PREFIX):].strip()


async def timed(call: Callable[[], Awaitable[object]], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await call()
        out.append((time.perf_counter() - t0) * 1000)
    return out


async def measure(serve_url: str, tool_url: str, n: int, rounds: int) -> dict[str, dict]:
    fresh = httpx.Limits(max_keepalive_connections=0)  # a new connection for every request
    sides: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for label, limits in (("kept-alive", httpx.Limits()), ("new connection", fresh)):
            async with httpx.AsyncClient(timeout=60, limits=limits) as http:
                calls = {
                    "serve /health": lambda: http.get(serve_url + "/health"),
                    "serve /generate": lambda: http.post(serve_url + "/generate", json={
                        "input_ids": [5, 6, 7], "max_new_tokens": 2, "min_new_tokens": 2}),
                    # the request ToolClient sends for a tool workflow's call (answered at once)
                    "tool call": lambda: http.post(tool_url + "/tools/calc", json={
                        "expr": "12+30"}, headers={UNDELAYED: "1"}),
                }
                for name, call in calls.items():
                    await call()  # the connection is made outside the timing
                    sides.setdefault(name, {}).setdefault(label, []).extend(
                        await timed(call, n))
    return {name: {label: statistics.median(ms) for label, ms in by.items()}
            for name, by in sides.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40, help="per side, per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the medians here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(TinyModelConfig(), Path(tmp) / "model")
        proc, serve_url = start_serve(model)
        try:
            with ToolServiceProcess(ToolServiceConfig(median_s=0.0)) as tools:
                result = asyncio.run(measure(serve_url, tools.url, args.requests, args.rounds))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    print(f"median ms per request ({args.requests} x {args.rounds} per side, sequential)")
    print(f"{'request':<18}{'kept-alive':>12}{'new connection':>16}{'ratio':>8}")
    for name, by in result.items():
        kept, new = by["kept-alive"], by["new connection"]
        print(f"{name:<18}{kept:>12.2f}{new:>16.2f}{kept / new:>8.2f}")
    if args.json:
        args.json.write_text(json.dumps({"command": " ".join(["python", *sys.argv]),
                                         "requests": args.requests, "rounds": args.rounds,
                                         "median_ms": result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
