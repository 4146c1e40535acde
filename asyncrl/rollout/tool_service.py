"""Tools behind HTTP with a configured service time: what an agent's episode waits on.

In agentic RL much of an episode's time is spent waiting on tools, sandboxes, search and remote
judges, with long tails. This service models such a tool: each call is answered after a seeded
service time drawn from a lognormal whose median is `median_s` and whose 99th percentile is
`p99_over_median` times that (1: a constant wait), and a share of calls fails on purpose (a 503,
or a reply held past the client's timeout). The latency is configured, not measured: it stands for
remote tools this machine does not have.

`ToolServiceProcess` runs it as a subprocess on 127.0.0.1 (a job starts it and stops it);
`ToolClient` calls it and turns every failure (timeout, 5xx, refused connection, a call the tool
rejects) into a `ToolReply` whose text the policy reads as the tool's answer and whose `error`
the workflow counts, so a failing tool never ends a run. Tools are functions `f(**arguments) ->
str` named by `package.module:function` (the YAML edge), e.g.
`asyncrl.rollout.calculator:calc`, the default.

    python -m asyncrl.rollout.tool_service --config '{"median_s": 0.5, "tools": {...}}'
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import enum
import json
import math
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pydantic

from asyncrl.config import Config
from asyncrl.listening import listening_socket

READY = "asyncrl tool service: listening on "
# a request with this header set to "1" is answered at once and never fails on purpose: the
# configured service time models training episodes' waits; an evaluation (whose time a training
# job's clock leaves out) needs only the answer
UNDELAYED = "x-asyncrl-undelayed"
PR_SET_PDEATHSIG = 1  # prctl: a signal when the parent exits
Z99 = 2.3263478740408408  # the standard normal's 99th percentile


class ToolServiceConfig(Config):
    # name -> `package.module:function`, called with the call's JSON arguments as keywords
    tools: dict[str, str] = {"calc": "asyncrl.rollout.calculator:calc"}
    median_s: float = pydantic.Field(0.5, ge=0.0)  # median service time
    # the 99th percentile's ratio to the median: the tail (1: every call takes median_s)
    p99_over_median: float = pydantic.Field(1.0, ge=1.0)
    seed: int = 0  # of the service times and the injected failures
    error_rate: float = pydantic.Field(0.0, ge=0.0, lt=1.0)  # calls answered 503
    hang_rate: float = pydantic.Field(0.0, ge=0.0, lt=1.0)  # calls held for hang_s
    hang_s: float = pydantic.Field(60.0, gt=0.0)
    client_timeout_s: float = pydantic.Field(30.0, gt=0.0)  # ToolClient's per-call limit

    @pydantic.model_validator(mode="after")
    def _rates(self) -> ToolServiceConfig:
        if self.error_rate + self.hang_rate >= 1.0:
            raise ValueError(f"error_rate + hang_rate = {self.error_rate + self.hang_rate} is "
                             "out of range; allowed < 1 (some calls must succeed)")
        return self


class LatencyModel:
    """Seeded service times: median * exp(sigma * N(0, 1)), sigma = ln(p99 / median) / z99."""

    def __init__(self, median_s: float, p99_over_median: float, seed: int) -> None:
        self.median_s = median_s
        self.sigma = math.log(p99_over_median) / Z99
        self.rng = random.Random(seed)

    def draw(self) -> float:
        if self.sigma == 0.0:
            return self.median_s
        return self.median_s * math.exp(self.sigma * self.rng.gauss(0.0, 1.0))


class Fate(str, enum.Enum):
    ANSWER = "answer"
    ERROR = "error"  # a 503 after the service time
    HANG = "hang"  # held for hang_s


def resolve_tools(tools: dict[str, str]) -> dict[str, Callable[..., str]]:
    from asyncrl.imports import import_object

    return {name: import_object(ref, f"tools.{name}") for name, ref in tools.items()}


def create_tool_app(cfg: ToolServiceConfig, tools: dict[str, Callable[..., str]]) -> Any:
    """The FastAPI app: POST /tools/{name} (JSON object of arguments -> {"result": text}),
    GET /health, GET /stats (calls by fate, observed service-time median and p99). A call with
    the UNDELAYED header is answered at once, without injected failures (counted apart)."""
    from fastapi import Body, FastAPI, Header
    from fastapi.responses import JSONResponse

    app = FastAPI(title="asyncrl tool service")
    latency = LatencyModel(cfg.median_s, cfg.p99_over_median, cfg.seed)
    fates = random.Random(cfg.seed + 1)
    counts: collections.Counter[str] = collections.Counter()
    seconds: collections.deque[float] = collections.deque(maxlen=100_000)

    @app.post("/tools/{name}")
    async def call(name: str, arguments: dict[str, Any] = Body(...),
                   undelayed: str | None = Header(None, alias=UNDELAYED)) -> Any:
        if name not in tools:
            counts["unknown_tool"] += 1
            return JSONResponse({"error": f"unknown tool {name!r}; allowed: {sorted(tools)}"},
                                status_code=404)
        if undelayed == "1":
            counts["undelayed"] += 1
        else:
            wait, u = latency.draw(), fates.random()
            fate = (Fate.ERROR if u < cfg.error_rate else
                    Fate.HANG if u < cfg.error_rate + cfg.hang_rate else Fate.ANSWER)
            counts[fate.value] += 1
            await asyncio.sleep(cfg.hang_s if fate == Fate.HANG else wait)
            seconds.append(cfg.hang_s if fate == Fate.HANG else wait)
            if fate == Fate.ERROR:
                return JSONResponse({"error": "injected failure"}, status_code=503)
        try:
            result = tools[name](**arguments)
        except TypeError as err:  # arguments the function does not take
            counts["bad_call"] += 1
            return JSONResponse({"error": f"tool {name!r}: {err}"}, status_code=400)
        return {"result": str(result)}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> dict:
        ordered = sorted(seconds)
        q = (lambda p: ordered[min(len(ordered) - 1, int(p * len(ordered)))]) if ordered else (
            lambda p: None)
        return {"calls": dict(counts), "median_s": q(0.5), "p99_s": q(0.99)}

    return app


class ToolError(str, enum.Enum):
    TIMEOUT = "timeout"
    SERVER = "server_error"
    UNREACHABLE = "unreachable"
    BAD_CALL = "bad_call"


@dataclass
class ToolReply:
    text: str  # what the policy reads as the tool's answer
    error: ToolError | None
    seconds: float


class ToolClient:
    """Calls a tool service; failures come back as replies the policy can read."""

    def __init__(self, url: str, timeout_s: float, undelayed: bool = False) -> None:
        """`undelayed`: ask the service (this module's) to answer at once (UNDELAYED)."""
        import httpx

        self.url, self.timeout_s = url.rstrip("/"), timeout_s
        self.http = httpx.AsyncClient(
            timeout=timeout_s, headers={UNDELAYED: "1"} if undelayed else None,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolReply:
        import httpx

        start = time.perf_counter()

        def reply(text: str, error: ToolError | None) -> ToolReply:
            return ToolReply(text, error, time.perf_counter() - start)

        try:
            r = await self.http.post(f"{self.url}/tools/{name}", json=arguments)
        except httpx.TimeoutException:
            return reply(f"error: tool {name} timed out after {self.timeout_s:g} s",
                         ToolError.TIMEOUT)
        except httpx.ConnectError:
            return reply(f"error: tool {name} is unreachable", ToolError.UNREACHABLE)
        except httpx.HTTPError as err:
            return reply(f"error: tool {name} failed ({type(err).__name__})",
                         ToolError.UNREACHABLE)
        if r.status_code >= 500:
            return reply(f"error: tool {name} failed ({r.status_code})", ToolError.SERVER)
        if r.status_code >= 400:
            return reply(f"error: {r.json().get('error', r.text)}", ToolError.BAD_CALL)
        return reply(r.json()["result"], None)

    async def aclose(self) -> None:
        await self.http.aclose()


class ToolServiceProcess:
    """The service as a subprocess on 127.0.0.1 (a free port), started and stopped by a job."""

    def __init__(self, cfg: ToolServiceConfig, start_timeout_s: float = 60.0) -> None:
        self.cfg = cfg
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "asyncrl.rollout.tool_service", "--die-with-parent",
             "--config", cfg.model_dump_json()],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + start_timeout_s
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith(READY) or not line:
                break
        if not line.startswith(READY):
            self.stop()
            err = self.proc.stderr.read() if self.proc.stderr else ""
            raise RuntimeError(f"the tool service did not start: {err.strip()[-2000:]}")
        self.url = line[len(READY):].strip()

    def client(self, undelayed: bool = False) -> ToolClient:
        return ToolClient(self.url, self.cfg.client_timeout_s, undelayed)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> ToolServiceProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="{}", help="ToolServiceConfig as JSON")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--die-with-parent", action="store_true",
                    help="exit when the process that started it does (Linux)")
    args = ap.parse_args(argv)
    if args.die_with_parent and sys.platform == "linux":
        import ctypes
        import signal

        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    cfg = ToolServiceConfig.from_dict(json.loads(args.config), source="--config")
    app = create_tool_app(cfg, resolve_tools(cfg.tools))
    sock = listening_socket(args.host, args.port, 4096)  # early clients wait in the backlog
    host, port = sock.getsockname()[:2]
    print(f"{READY}http://{host}:{port}", flush=True)
    # a stop does not wait out held calls (an injected hang is a failure, not work)
    uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                  timeout_keep_alive=120, timeout_graceful_shutdown=1)
                   ).run(sockets=[sock])


if __name__ == "__main__":
    main()
