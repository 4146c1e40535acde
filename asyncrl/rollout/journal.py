"""An episode's generation journal: what lets an episode in flight survive a checkpoint.

An episode is a coroutine, which cannot be saved. What it has generated can: `JournaledEngine`
wraps the engine an episode gets and records every generation call (request and response). When
the executor suspends episodes for a checkpoint it interrupts the engines; each call in flight
returns its partial output (stop reason ABORT), which is recorded as a *partial* call, and the
episode is unwound with `EpisodeSuspended`. The checkpoint keeps the journal.

To continue, the episode is run again from its start on a `JournaledEngine` replaying the
journal: a call equal to a finished one (same prompt ids and sampling parameters) gets that
response back without generating; a call equal to a partial one continues it from the tokens
already sampled (prompt + partial tokens, the remaining budget, see inference/continuation.py),
so one response holds tokens, logprobs and versions from before and after the restart; any
other call generates. Equal calls are interchangeable samples (a GRPO group asks the same
prompt n times), so they are matched in any order. Episodes are assumed deterministic given
their generations (rewards, environments); one that is not still trains on exact tokens.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from asyncrl.api import (EpisodeSuspended, GenerationConfig, InferenceEngine, ModelRequest,
                         ModelResponse, StopReason)
from asyncrl.inference.backend_protocol import Segment
from asyncrl.inference.continuation import Progress


def _key(input_ids: list[int], g: GenerationConfig) -> tuple:
    """What makes two calls the same request: the prompt ids and every sampling field."""
    return (list(input_ids), dataclasses.astuple(g))


@dataclass
class Call:
    """One generation call of an episode: the request, and its response (partial or whole)."""

    input_ids: list[int]
    gconfig: GenerationConfig
    response: ModelResponse

    @property
    def key(self) -> tuple:
        return _key(self.input_ids, self.gconfig)


@dataclass
class EpisodeJournal:
    finished: list[Call] = field(default_factory=list)
    partial: list[Call] = field(default_factory=list)  # interrupted by a suspension
    in_flight: int = 0  # calls not yet returned (a suspension waits for them to be recorded)

    def __getstate__(self) -> dict[str, Any]:
        return {"finished": self.finished, "partial": self.partial, "in_flight": 0}

    @property
    def tokens(self) -> int:
        return sum(c.response.output_len for c in self.finished + self.partial)

    def take(self, calls: list[Call], key: tuple) -> Call | None:
        for i, c in enumerate(calls):
            if c.key == key:
                return calls.pop(i)
        return None


class JournaledEngine:
    """The engine one episode sees: records calls into `journal`, replays `replay` first.

    `suspending()` tells whether the executor is suspending episodes: then a call raises
    EpisodeSuspended instead of generating, and an interrupted call is recorded as partial.
    It is an `InferenceEngine`, what a workflow may use of the engine."""

    def __init__(self, engine: InferenceEngine, journal: EpisodeJournal,
                 replay: EpisodeJournal | None, suspending: Any) -> None:
        self._engine, self.journal, self._suspending = engine, journal, suspending
        # a copy whose lists this episode consumes (the snapshot keeps the original)
        self._replay = (EpisodeJournal(list(replay.finished), list(replay.partial))
                        if replay is not None else None)
        self.replayed_calls = self.continued_calls = 0

    def get_version(self) -> int:
        return self._engine.get_version()

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        if self._suspending():
            raise EpisodeSuspended()
        key = _key(req.input_ids, req.gconfig)
        self.journal.in_flight += 1
        try:
            done = self._replay.take(self._replay.finished, key) if self._replay else None
            if done is not None:
                self.replayed_calls += 1
                resp = copy.deepcopy(done.response)
                resp.rid = req.rid
            else:
                part = self._replay.take(self._replay.partial, key) if self._replay else None
                resp = await (self._continue(req, part.response) if part is not None
                              else self._engine.agenerate(req))
            call = Call(list(req.input_ids), req.gconfig, resp)
            if resp.stop_reason is StopReason.ABORT and self._suspending():
                self.journal.partial.append(call)
                raise EpisodeSuspended()
            self.journal.finished.append(call)
            return resp
        finally:
            self.journal.in_flight -= 1

    async def _continue(self, req: ModelRequest, partial: ModelResponse) -> ModelResponse:
        """`req` continued from `partial`'s tokens; one response holding both."""
        self.continued_calls += 1
        progress = Progress(req, t0=0.0)
        progress.add(Segment(list(partial.output_tokens), list(partial.output_logprobs),
                             list(partial.output_versions), StopReason.ABORT), 0.0, 0.0)
        routes = partial.routes
        if progress.remaining > 0:
            more = await self._engine.agenerate(ModelRequest(
                input_ids=list(req.input_ids) + progress.tokens, gconfig=progress.next_config(),
                rid=req.rid, images=req.images))
            progress.add(Segment(more.output_tokens, more.output_logprobs, more.output_versions,
                                 more.stop_reason), 0.0, 0.0)
            routes = more.routes  # its prompt is the whole sequence so far
        # (routes: a mixture-of-experts engine's, whole: the continuation's cover everything)
        return dataclasses.replace(progress.response(), latency=partial.latency,
                                   ttft=partial.ttft, routes=routes)
