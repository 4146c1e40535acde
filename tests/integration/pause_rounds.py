"""Interrupt generations on real servers with a pause + weight update, retrying a lost race
(and the vLLM suite's other helpers: a perturbed policy, a server metric).

A test starts requests, waits until the servers' own token count shows them a few tokens in,
then pauses (aborting them), updates and resumes. The pause travels through a busy API server:
on a loaded 2-core machine it has landed hundreds of tokens, once every one of a sequence's 1000
tokens, after the count passed the threshold. A round in which the pause interrupted nothing
(every sequence had already ended) is lifted without the update and run again.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable

from pathlib import Path

import httpx
import torch

from asyncrl.api import ModelRequest, ModelResponse
from asyncrl.models.export import save_weights_dir
from asyncrl.models.loading import load_causal_lm
from asyncrl.inference.remote import RemoteInferenceEngine


def perturbed(model_dir: Path, out: Path, seed: int = 7) -> Path:
    """A copy of the model (a VLM's vision tower and processor too) with every weight moved and
    an untied output head: version 1 of the policy, as a vLLM server reloads it."""
    model = load_causal_lm(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return save_weights_dir(model.state_dict(), model.config, out, untie=True,
                            processor_from=model_dir)


def metric(url: str, name: str) -> float:
    """A vLLM server's Prometheus metric `name`, summed over its label sets."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$",
                                                       text, re.M))


async def _until(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def _in_flight(engine: RemoteInferenceEngine) -> int:
    return sum(s["in_flight"] for s in engine.stats()["servers"])


async def _round(engine: RemoteInferenceEngine, requests: list[ModelRequest],
                 tokens: Callable[[], float], after: float,
                 update: Callable[[], Awaitable[None]]) -> tuple[int, list[ModelResponse]]:
    start = tokens()
    tasks = [asyncio.create_task(engine.agenerate(r)) for r in requests]
    # the servers' count: the client parses the streams behind the servers' progress
    while tokens() < start + after:
        assert not all(t.done() for t in tasks), "every sequence ended before the update"
        await asyncio.sleep(0.02)
    engine.pause()
    try:
        # every call returns: aborted ones (some servers end the stream without a reason)
        # wait in the client to continue; the others have finished
        await _until(lambda: _in_flight(engine) == 0, "the paused servers kept requests")
        await asyncio.sleep(0.1)  # for the finished calls' tasks to complete
        interrupted = sum(not t.done() for t in tasks)
        if interrupted:
            await update()
    finally:
        engine.resume()
    return interrupted, list(await asyncio.gather(*tasks))


def interrupt_with_update(engine: RemoteInferenceEngine,
                          requests: Callable[[int], list[ModelRequest]],
                          tokens: Callable[[], float], after: float,
                          update: Callable[[], Awaitable[None]],
                          rounds: int = 3) -> list[ModelResponse]:
    """Run `requests(round)` and apply `update` mid-generation once `tokens()` (the servers'
    generated-token count) has grown by `after`; returns the responses of the round in which
    the pause interrupted at least one sequence (each round on its own event loop)."""
    for attempt in range(rounds):
        interrupted, responses = asyncio.run(
            _round(engine, requests(attempt), tokens, after, update))
        print(f"round {attempt}: the pause interrupted {interrupted} of {len(responses)} "
              "sequences")
        if interrupted:
            return responses
    raise AssertionError(f"the pause landed after every sequence ended, {rounds} rounds in a row")
