"""The tool service an agent's episodes wait on (asyncrl/rollout/tool_service.py): its seeded
long-tailed service times, and a real subprocess server on 127.0.0.1 whose injected failures
(503s, replies held past the client's timeout), rejected calls and a stopped server all come back
to the caller as readable tool replies, counted by kind.
"""

from __future__ import annotations

import asyncio
import statistics

import pytest

from asyncrl.config import ConfigError
from asyncrl.rollout.tool_service import (LatencyModel, ToolError, ToolServiceConfig,
                                          ToolServiceProcess)


def test_service_times_have_the_configured_median_and_tail():
    flat = LatencyModel(0.3, 1.0, seed=0)
    assert {flat.draw() for _ in range(100)} == {0.3}
    model = LatencyModel(0.5, 20.0, seed=1)
    draws = sorted(model.draw() for _ in range(200_000))
    median, p99 = statistics.median(draws), draws[int(0.99 * len(draws))]
    assert median == pytest.approx(0.5, rel=0.02)
    assert p99 / median == pytest.approx(20.0, rel=0.05)



def test_the_same_seed_gives_the_same_times():
    a, b = LatencyModel(0.5, 5.0, seed=3), LatencyModel(0.5, 5.0, seed=3)
    assert [a.draw() for _ in range(20)] == [b.draw() for _ in range(20)]


def test_rates_that_leave_no_success_are_refused():
    with pytest.raises(ConfigError, match="error_rate"):
        ToolServiceConfig.from_dict({"error_rate": 0.6, "hang_rate": 0.5})


def test_failures_reach_the_caller_as_tool_replies():
    cfg = ToolServiceConfig(median_s=0.01, p99_over_median=5.0, error_rate=0.3, hang_rate=0.2,
                            hang_s=30.0, client_timeout_s=3.0, seed=0)

    async def go(service):
        client = service.client()
        try:
            replies = await asyncio.gather(*(client.call("calc", {"expr": f"{i}*7"})
                                             for i in range(40)))
            bad = await client.call("calc", {"expression": "1+1"})
            unknown = await client.call("search", {"q": "x"})
        finally:
            await client.aclose()
        return replies, bad, unknown

    with ToolServiceProcess(cfg) as service:
        replies, bad, unknown = asyncio.run(go(service))
        import httpx

        stats = httpx.get(f"{service.url}/stats").json()
    kinds = [r.error for r in replies]
    ok = [(i, r) for i, r in enumerate(replies) if r.error is None]
    assert kinds.count(ToolError.SERVER) == stats["calls"]["error"] > 0
    assert kinds.count(ToolError.TIMEOUT) == stats["calls"]["hang"] > 0
    assert len(ok) == stats["calls"]["answer"] - 1 > 0  # the bad call was an answer's fate too
    assert all(r.text == str(i * 7) for i, r in ok)
    assert all(r.text.startswith("error: tool calc") for r in replies if r.error)
    assert bad.error == ToolError.BAD_CALL and "expression" in bad.text
    assert unknown.error == ToolError.BAD_CALL and "unknown tool 'search'" in unknown.text

    async def after_stop():
        client = service.client()
        try:
            return await client.call("calc", {"expr": "1+1"})
        finally:
            await client.aclose()

    gone = asyncio.run(after_stop())
    assert gone.error == ToolError.UNREACHABLE and "unreachable" in gone.text


def test_an_undelayed_call_is_answered_at_once_without_failures():
    """A client made with undelayed=True (what a job's evaluations use with
    workflow.eval_service_time=false) is answered at once and never fails on purpose; the
    service's own times and failures still apply to everyone else."""
    cfg = ToolServiceConfig(median_s=60.0, error_rate=0.5, hang_rate=0.0, client_timeout_s=0.5)

    async def go(service):
        fast, slow = service.client(undelayed=True), service.client()
        try:
            answers = await asyncio.gather(*(fast.call("calc", {"expr": f"{i}+1"})
                                             for i in range(20)))
            waited = await slow.call("calc", {"expr": "1+1"})
        finally:
            await fast.aclose()
            await slow.aclose()
        return answers, waited

    with ToolServiceProcess(cfg) as service:
        answers, waited = asyncio.run(go(service))
        import httpx

        stats = httpx.get(f"{service.url}/stats").json()
    assert [a.text for a in answers] == [str(i + 1) for i in range(20)]
    assert all(a.error is None and a.seconds < 30 for a in answers)
    assert waited.error == ToolError.TIMEOUT
    assert stats["calls"]["undelayed"] == 20


def test_the_service_exits_with_the_process_that_started_it(tmp_path):
    """A job killed outright (SIGKILL: no cleanup runs) leaves no tool service behind."""
    import os
    import signal
    import subprocess
    import sys
    import time

    script = ("from asyncrl.rollout.tool_service import ToolServiceConfig, ToolServiceProcess\n"
              "import sys, time\n"
              "p = ToolServiceProcess(ToolServiceConfig(median_s=0.0))\n"
              "print(p.proc.pid, flush=True)\n"
              "time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        if open(f"/proc/{child}/stat").read().split()[2] == "Z":  # exited, not yet reaped
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the tool service outlived its parent")
