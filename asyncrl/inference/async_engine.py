"""`AsyncLLMEngine`: the api `InferenceEngine` protocol over `LLMEngine`, stepped on a thread.

The engine is single-threaded, so every call that touches it becomes a command run by the engine
thread between two steps; that is what makes a weight update and its version bump atomic with
respect to sampled tokens. Results reach callers through `loop.call_soon_threadsafe`, so any number
of event loops may share one engine; torch releases the GIL inside its kernels, so the event loop
keeps running while a step computes.

`n_samples > 1` is rejected (ValueError): a request is one sequence, and rollout code expands a
group into one request per sample, which also lets the samples share the batch freely.
"""

from __future__ import annotations

import asyncio
import logging
import concurrent.futures
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.api import (ModelRequest, ModelResponse, StopReason, WeightUpdateKind,
                         WeightUpdateMeta)
from asyncrl.inference.engine import EngineConfig, LLMEngine
from asyncrl.inference.model_runner import iter_safetensors

log = logging.getLogger(__name__)


CONTROL_TIMEOUT_S = 300.0  # pause / resume / abort: applied between two engine steps


MAX_FAILED_STEPS = 3  # steps failing in a row stop the engine thread (the fault is not a request)


class EngineDeadError(RuntimeError):
    """The engine thread stopped on an error; the original exception is the __cause__."""


class EngineStepError(RuntimeError):
    """An engine step failed while this request was unfinished; the engine goes on."""


@dataclass
class TokenDelta:
    """Tokens sampled since the previous item of an `agenerate_stream`."""

    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]


@dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future | None = None  # agenerate: resolved once
    queue: asyncio.Queue | None = None  # agenerate_stream: deltas, then the response or an error
    sent: int = 0  # tokens already streamed
    interval: int = 1  # agenerate_stream: a delta once this many tokens are new
    done: bool = field(default=False)


def _resolve(fut: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled meanwhile
        return
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(result)


class AsyncLLMEngine:
    def __init__(
        self, engine: EngineConfig | LLMEngine, detokenize: Callable[[list[int]], str] | None = None
    ) -> None:
        self.engine = engine if isinstance(engine, LLMEngine) else LLMEngine(engine, detokenize)
        self.max_seq_len, self.device = self.engine.max_seq_len, self.engine.device  # fixed
        self.model_path = self.engine.config.model_path  # what it was started from
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _waiters, touched by callers and the engine thread
        self._waiters: dict[str, _Waiter] = {}
        self._closed = False
        self._interrupted = False  # `interrupt`: new requests return at once, empty
        self._error: BaseException | None = None
        self._merger: Any = None  # LoRA: base copies of the adapted weights, made on first use
        self._idle_total = 0.0  # seconds the engine thread waited with nothing to generate
        self._idle_since: float | None = None  # when its current wait began
        self._thread = threading.Thread(target=self._run, name="asyncrl-engine", daemon=True)
        self._thread.start()

    # ---- InferenceEngine protocol ---------------------------------------------------------

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        if self._interrupted:
            return ModelResponse(list(req.input_ids), [], [], [], StopReason.ABORT, rid=req.rid)
        loop = asyncio.get_running_loop()
        waiter = _Waiter(loop, future=loop.create_future())
        async with self._request(req, waiter):
            return await waiter.future

    async def agenerate_stream(
        self, req: ModelRequest, interval: int = 1
    ) -> AsyncIterator[TokenDelta | ModelResponse]:
        """Yield a `TokenDelta` once `interval` new tokens were sampled, then the final response.

        The response holds the whole output; tokens not yet sent in a delta (those of the step
        that finished the request among them) arrive only there. Each delta wakes the caller's
        event loop, so a server streaming many calls on one core sends fewer, larger ones.
        """
        waiter = _Waiter(asyncio.get_running_loop(), queue=asyncio.Queue(), interval=interval)
        async with self._request(req, waiter):
            while True:
                item = await waiter.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if isinstance(item, ModelResponse):
                    return

    def get_version(self) -> int:
        return self.engine.version

    def validate(self, req: ModelRequest) -> None:
        """Raise ValueError for a request the engine cannot serve (before a stream starts)."""
        self.engine.validate(req)

    def pause(self) -> None:
        """Stop scheduling and abort every unfinished request (they return partial output).

        Requests submitted while paused wait for `resume`. Blocks until the engine thread applied
        it, at most one step.
        """

        def pause_and_abort() -> None:
            self.engine.pause()
            self._deliver(self.engine.abort())

        self._wait(self._submit(pause_and_abort), "pause")

    def interrupt(self) -> None:
        """`pause`, and until `resume` new requests return at once with no tokens (ABORT):
        every caller gets back what it has, for a checkpoint of the episodes in flight."""
        self._interrupted = True
        self.pause()

    def resume(self) -> None:
        self._interrupted = False
        self._wait(self._submit(self.engine.resume), "resume")

    async def check_servers(self, model_dir: str | None = None) -> None:
        """No servers: this engine is checked by the canary alone."""

    async def generate_on_each(self, req: ModelRequest) -> list[tuple[str, ModelResponse]]:
        """The one engine there is, named for the canary's messages."""
        return [("the in-process engine", await self.agenerate(req))]

    def abort(self, rid: str | None = None) -> int:
        """Finish `rid` (all requests when None) now with partial output; returns how many."""

        def run() -> int:
            out = self.engine.abort(rid)
            self._deliver(out)
            return len(out)

        return self._wait(self._submit(run), "abort")

    async def update_weights(
        self, meta: WeightUpdateMeta, weights: Mapping[str, torch.Tensor] | None = None
    ) -> None:
        """Load new weights and set the version to `meta.version` between two steps.

        DISK reads `meta.path` on a worker thread (the engine keeps generating meanwhile);
        TENSORS takes `weights` in memory (HF parameter names). With `meta.lora` the path or
        the tensors are a PEFT adapter, merged into the base model's weights on a worker thread
        (models/lora.py); only the adapted weights are then swapped in.
        """
        if meta.lora:  # only the adapted weights change
            weights = await asyncio.to_thread(self._merge_adapter, meta, weights)
        elif meta.kind == WeightUpdateKind.DISK:
            weights = await asyncio.to_thread(lambda: list(iter_safetensors(meta.path)))
        elif meta.kind != WeightUpdateKind.TENSORS:
            raise ValueError(f"kind={meta.kind.value!r} is not supported by the in-process engine; "
                             "allowed: disk, tensors")
        elif weights is None:
            raise ValueError("update_weights(kind=tensors) needs the `weights` argument")
        update = self.engine.update_weights_from_state_dict
        await asyncio.wrap_future(self._submit(
            lambda: update(weights, meta.version, strict=not meta.lora)))

    def _merge_adapter(self, meta: WeightUpdateMeta, adapter: Mapping[str, torch.Tensor] | None
                       ) -> dict[str, torch.Tensor]:
        """The adapted weights of the engine's base model (the one it was started from)."""
        from asyncrl.models.lora import AdapterMerger, read_adapter_dir

        if meta.kind == WeightUpdateKind.DISK:
            adapter, scale = read_adapter_dir(meta.path)
        elif meta.kind == WeightUpdateKind.TENSORS and adapter is not None:
            scale = meta.lora_scale
        else:
            raise ValueError(f"update_weights(lora=True, kind={meta.kind.value!r}) needs a disk "
                             "path or the adapter tensors; allowed kinds: disk, tensors")
        if self._merger is None:
            self._merger = AdapterMerger(self.engine.config.model_path)
        return self._merger.merge(adapter, scale)

    def stats(self) -> dict[str, float]:
        return self.engine.stats()  # plain counters: a racy read is fine for monitoring

    @property
    def idle_seconds(self) -> float:
        """Seconds the engine has had nothing to generate (no sequence, or paused), since it
        started: a rollout waiting on a tool keeps the executor busy but leaves this idle."""
        since = self._idle_since
        return self._idle_total + (time.monotonic() - since if since is not None else 0.0)

    # ---- lifecycle ------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Abort what is in flight (callers get partial output) and stop the engine thread."""
        if self._closed:
            return
        self._closed = True
        self._wake.set()
        self._thread.join()

    def __enter__(self) -> AsyncLLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- caller side ----------------------------------------------------------------------

    def _request(self, req: ModelRequest, waiter: _Waiter) -> _RequestScope:
        self.engine.validate(req)  # fast ValueError in the caller; re-checked on the engine thread
        return _RequestScope(self, req, waiter)

    def _wait(self, fut: concurrent.futures.Future, what: str) -> Any:
        """A control command's result; bounded, so a stuck engine thread is an error, not a
        hang (one engine step is milliseconds to seconds)."""
        try:
            return fut.result(timeout=CONTROL_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"the engine thread did not {what} within {CONTROL_TIMEOUT_S:g}s; "
                               f"engine stats: {self.stats()}") from None

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        if self._error is not None:
            raise EngineDeadError("the engine thread stopped on an error") from self._error
        if self._closed:
            raise RuntimeError("AsyncLLMEngine is shut down")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, fut))
        self._wake.set()
        return fut

    # ---- engine thread --------------------------------------------------------------------

    def _add(self, req: ModelRequest) -> None:
        if self._interrupted:  # queued behind `interrupt`'s pause: answer it like one after
            self._notify(req.rid, ModelResponse(list(req.input_ids), [], [], [],
                                                StopReason.ABORT, rid=req.rid), None)
            return
        try:
            self.engine.add_request(req)
        except Exception as err:  # e.g. the same rid raced in from another loop: tell the caller
            self._notify(req.rid, None, err)

    def _run(self) -> None:
        failed_steps = 0
        try:
            while not self._closed:
                self._drain_commands()
                # finished by the step in flight before a pause / update (overlapped steps)
                self._deliver(self.engine.take_finished())
                if self.engine.has_unfinished() and not self.engine.paused:
                    try:
                        finished = self.engine.step()
                    except Exception as err:
                        failed_steps += 1
                        if failed_steps >= MAX_FAILED_STEPS:
                            raise
                        self._fail_unfinished(err)
                        continue
                    failed_steps = 0
                    self._stream_progress()
                    self._deliver(finished)
                else:
                    self._idle_since = time.monotonic()
                    self._wake.wait()
                    self._wake.clear()
                    self._idle_total += time.monotonic() - self._idle_since
                    self._idle_since = None
            self._drain_commands()
            self._deliver(self.engine.abort())
        except BaseException as err:  # boundary: fail every caller loudly instead of hanging them
            self._error = err
            with self._lock:
                rids = list(self._waiters)
            for rid in rids:
                self._notify(rid, None, EngineDeadError(f"engine thread died: {err!r}"))
            while True:  # and every command queued for it
                try:
                    _, fut = self._commands.get_nowait()
                except queue.Empty:
                    break
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(EngineDeadError(f"engine thread died: {err!r}"))
            raise

    def _fail_unfinished(self, err: Exception) -> None:
        """A step raised: its requests may be what broke it, so every unfinished one ends with
        EngineStepError (a server answers 500; the remote client retries elsewhere from the
        tokens it streamed) and the engine goes on with the next requests."""
        log.warning("engine step failed (%r); its %d unfinished requests end with an error",
                    err, len(self.engine.scheduler.find(None)))
        for resp in self.engine.abort():
            self._notify(resp.rid, None, EngineStepError(
                f"request {resp.rid}: an engine step failed with {err!r}"))

    def _drain_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except Exception as err:  # the command's caller receives it
                fut.set_exception(err)

    def _stream_progress(self) -> None:
        with self._lock:
            streams = [(rid, w) for rid, w in self._waiters.items() if w.queue is not None]
        for rid, w in streams:
            seq = self.engine.get_sequence(rid)
            if seq is None or seq.num_outputs - w.sent < w.interval:
                continue
            s = w.sent
            delta = TokenDelta(
                seq.output_tokens[s:], seq.output_logprobs[s:], seq.output_versions[s:]
            )
            w.sent = seq.num_outputs
            self._post(w, delta)

    def _deliver(self, responses: list[ModelResponse]) -> None:
        for resp in responses:
            self._notify(resp.rid, resp, None)

    def _notify(self, rid: str, resp: ModelResponse | None, error: BaseException | None) -> None:
        with self._lock:
            waiter = self._waiters.get(rid)
        if waiter is not None and not waiter.done:
            waiter.done = True
            self._post(waiter, resp, error)

    @staticmethod
    def _post(waiter: _Waiter, item: Any, error: BaseException | None = None) -> None:
        try:
            if waiter.queue is not None:
                waiter.loop.call_soon_threadsafe(waiter.queue.put_nowait, error or item)
            else:
                waiter.loop.call_soon_threadsafe(_resolve, waiter.future, item, error)
        except RuntimeError:  # that caller's event loop is closed: nobody is waiting any more
            pass


class _RequestScope:
    """Registers a waiter and submits the request; on exit unregisters it, aborts if unfinished."""

    def __init__(self, engine: AsyncLLMEngine, req: ModelRequest, waiter: _Waiter) -> None:
        self.engine, self.req, self.waiter = engine, req, waiter

    async def __aenter__(self) -> None:
        eng, rid = self.engine, self.req.rid
        with eng._lock:
            if rid in eng._waiters:
                raise ValueError(f"request id {rid!r} is already in flight")
            eng._waiters[rid] = self.waiter
        try:
            eng._submit(lambda: eng._add(self.req))
        except BaseException:
            with eng._lock:
                eng._waiters.pop(rid, None)
            raise

    async def __aexit__(self, *exc: object) -> None:
        eng, rid = self.engine, self.req.rid
        with eng._lock:
            eng._waiters.pop(rid, None)
        if not self.waiter.done and not eng._closed and eng._error is None:
            # The caller gave up (cancelled, or closed the stream): free the slot now.
            eng._submit(lambda: eng._deliver(eng.engine.abort(rid)))
