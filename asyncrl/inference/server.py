"""HTTP server of the built-in engine: token-level `/generate`, the OpenAI API, control, weights.

With `api_key` configured every route but health, version, metrics and the API docs needs
`Authorization: Bearer <key>` (`asyncrl/inference/http_auth.py`). Every bad input becomes a 4xx
JSON body in OpenAI's error shape, an unexpected error a 500 in the same shape
(`asyncrl/inference/http_errors.py`), and the server keeps serving everyone else on the same
connections.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import pydantic
from fastapi import FastAPI, Query, Request
from fastapi.responses import PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncrl.api import ModelRequest, ModelResponse, WeightUpdateKind, WeightUpdateMeta
from asyncrl.config import Config
from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig
from asyncrl.inference.http_auth import BearerKey
from asyncrl.inference.http_errors import InternalErrors, error_body, install_error_handlers
from asyncrl.inference.http_schema import AbortBody, DiskWeightsBody, GenerateBody
from asyncrl.inference.metrics import EngineMetrics
from asyncrl.inference.openai_routes import add_openai_routes
from asyncrl.inference.weight_buckets import WeightStaging

WEIGHTS_PATH = "/update_weights/tensors"


class ServerConfig(Config):
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = pydantic.Field(8000, ge=0, le=65535)  # 0: pick a free port and print it
    api_key: str | None = None  # bearer token every route but health/version/metrics needs
    model_name: str = "default"
    max_body_bytes: int = pydantic.Field(1 << 20, ge=1024)  # JSON bodies
    max_weight_bucket_bytes: int = pydantic.Field(2 << 30, ge=1024)  # one streamed bucket
    max_tokens_cap: int | None = pydantic.Field(None, ge=1)  # upper bound on max_tokens


class BodyLimit:
    """Reject bodies over the limit (413) before they are buffered, chunked uploads included."""

    def __init__(self, app: ASGIApp, limit: int, weights_limit: int) -> None:
        self.app, self.limit, self.weights_limit = app, limit, weights_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.weights_limit if scope["path"] == WEIGHTS_PATH else self.limit
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and int(declared) > limit:
            resp = error_body(413, f"request body of {int(declared)} bytes is over the "
                                   f"limit of {limit} bytes")
            return await resp(scope, receive, send)
        seen = 0

        async def counting_receive() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise BodyTooLarge(limit)
            return message

        try:
            await self.app(scope, counting_receive, send)
        except BodyTooLarge as err:  # raised where no exception handler saw it
            await error_body(413, err.detail)(scope, receive, send)


class BodyTooLarge(HTTPException):
    """An HTTPException so FastAPI's body parsing passes it on as a 413 (it turns any other
    exception while reading the body into a 400 "error parsing the body")."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body is over the limit of {limit} bytes")


def create_app(engine: AsyncLLMEngine, tokenizer: Any, cfg: ServerConfig) -> FastAPI:
    app = FastAPI(title="asyncrl inference server")
    metrics = EngineMetrics(engine)
    install_error_handlers(app, {ValueError: 400})

    @app.post("/generate")
    async def generate(body: GenerateBody) -> Any:
        req = ModelRequest(input_ids=body.input_ids, gconfig=body.gconfig(), **rid_kwargs(body.rid))
        if body.stream:
            engine.engine.validate(req)  # a bad request is a 400 before the stream starts
            return StreamingResponse(stream_generate(engine, req, metrics),
                                     media_type="text/event-stream")
        t0 = time.perf_counter()
        resp = await engine.agenerate(req)
        metrics.observe(resp, time.perf_counter() - t0)
        return generate_reply(resp)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "version": engine.get_version()}

    @app.get("/version")
    async def version() -> dict:
        return {"version": engine.get_version()}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=metrics.content_type)

    add_control_routes(app, engine)
    add_openai_routes(app, engine, tokenizer, cfg, metrics)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes,
                       weights_limit=cfg.max_weight_bucket_bytes)
    app.add_middleware(BearerKey, api_key=cfg.api_key)  # before the body is read
    app.add_middleware(InternalErrors)  # outermost: catches what the others raise
    return app


def add_control_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """Pause/resume/abort and weight updates: the endpoints that change the server's state (the
    API key, when configured, guards them with every other route)."""
    staging = WeightStaging()

    @app.post("/pause")
    async def pause() -> dict:
        await asyncio.to_thread(engine.pause)
        return {"paused": True, "version": engine.get_version()}

    @app.post("/resume")
    async def resume() -> dict:
        await asyncio.to_thread(engine.resume)
        return {"paused": False, "version": engine.get_version()}

    @app.post("/abort")
    async def abort(body: AbortBody | None = None) -> dict:
        n = await asyncio.to_thread(engine.abort, body.rid if body else None)
        return {"aborted": n}

    @app.post("/update_weights")
    async def update_from_disk(body: DiskWeightsBody) -> dict:
        await engine.update_weights(WeightUpdateMeta.from_disk(body.path, body.version))
        return {"version": engine.get_version()}

    @app.post(WEIGHTS_PATH)
    async def update_from_bucket(
        request: Request, version: int = Query(ge=0), bucket: int = Query(ge=0),
        last: bool = Query(False),
    ) -> dict:
        staged = staging.add(version, bucket, await request.body())
        if not last:
            return {"staged_tensors": staged, "version": engine.get_version()}
        new_version, tensors = staging.take()
        meta = WeightUpdateMeta(kind=WeightUpdateKind.TENSORS, version=new_version)
        await engine.update_weights(meta, tensors)
        return {"staged_tensors": staged, "version": engine.get_version()}


def generate_reply(resp: ModelResponse) -> dict[str, Any]:
    return {
        "rid": resp.rid, "input_len": resp.input_len, "output_tokens": resp.output_tokens,
        "output_logprobs": resp.output_logprobs, "output_versions": resp.output_versions,
        "stop_reason": resp.stop_reason.value, "latency": resp.latency, "ttft": resp.ttft,
    }


async def stream_generate(engine: AsyncLLMEngine, req: ModelRequest, metrics: EngineMetrics
                          ) -> AsyncIterator[str]:
    """`/generate` with stream: one event per engine step that sampled tokens, then the whole
    reply's fields (the final step's tokens as the last delta) with the stop reason."""
    sent = 0
    async for item in engine.agenerate_stream(req):
        if isinstance(item, ModelResponse):
            metrics.observe(item, item.latency)
            last = {**generate_reply(item), "output_tokens": item.output_tokens[sent:],
                    "output_logprobs": item.output_logprobs[sent:],
                    "output_versions": item.output_versions[sent:]}
            yield f"data: {json.dumps(last)}\n\n"
            break
        sent += len(item.output_tokens)
        delta = {"output_tokens": item.output_tokens, "output_logprobs": item.output_logprobs,
                 "output_versions": item.output_versions}
        yield f"data: {json.dumps(delta)}\n\n"
    yield "data: [DONE]\n\n"


def rid_kwargs(rid: str | None) -> dict[str, str]:
    return {"rid": rid} if rid else {}
