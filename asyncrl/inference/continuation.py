"""Stitching one response from several generation calls.

A weight update aborts in-flight requests with their partial output; the remote client resubmits
prompt + tokens so far with what remains of the budget and accumulates every segment here, so one
response holds tokens of several policy versions, each with the logprob it was sampled with.

The continuation's sampling parameters: `max_new_tokens` is what remains, `min_new_tokens` shrinks
by the tokens already produced, and a fixed seed becomes `seed + tokens so far`, because
resubmitting the same seed would replay, at later positions, the noise already used for the
earlier ones (still deterministic for a given interruption point).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from asyncrl.api import GenerationConfig, ModelRequest, ModelResponse, StopReason
from asyncrl.inference.backend_protocol import Segment


@dataclass
class Progress:
    """What one request has produced so far, across segments."""

    req: ModelRequest
    t0: float
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls: int = 0
    ttft: float | None = None
    stop: StopReason = StopReason.ABORT

    @property
    def remaining(self) -> int:
        return self.req.gconfig.max_new_tokens - len(self.tokens)

    def next_config(self) -> GenerationConfig:
        g, done = self.req.gconfig, len(self.tokens)
        if done == 0:
            return g
        return g.replace(max_new_tokens=self.remaining,
                         min_new_tokens=max(0, g.min_new_tokens - done),
                         seed=None if g.seed is None else g.seed + done)

    def add(self, seg: Segment, submitted_at: float, now: float) -> None:
        if seg.tokens and self.ttft is None:
            self.ttft = (submitted_at - self.t0) + (seg.ttft if seg.ttft else now - submitted_at)
        self.tokens += seg.tokens
        self.logprobs += seg.logprobs
        self.versions += seg.versions or []
        self.stop = seg.stop_reason
        if self.stop is StopReason.ABORT and self.remaining <= 0:
            self.stop = StopReason.LENGTH

    def response(self) -> ModelResponse:
        return ModelResponse(
            input_tokens=list(self.req.input_ids), output_tokens=self.tokens,
            output_logprobs=self.logprobs, output_versions=self.versions, stop_reason=self.stop,
            latency=time.perf_counter() - self.t0, ttft=self.ttft or 0.0, rid=self.req.rid)
