"""HTTP server of the built-in engine: token-level `/generate`, the OpenAI API, control, weights.

Generation endpoints are open; control and weight endpoints need `Authorization: Bearer <key>`
when `api_key` is configured (compared in constant time). Every bad input becomes a 4xx JSON body
in OpenAI's error shape and the server keeps serving everyone else.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from typing import Any

import pydantic
from fastapi import Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncrl.api import ModelRequest, WeightUpdateKind, WeightUpdateMeta
from asyncrl.config import Config
from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig
from asyncrl.inference.http_schema import AbortBody, DiskWeightsBody, GenerateBody
from asyncrl.inference.metrics import EngineMetrics
from asyncrl.inference.openai_routes import add_openai_routes
from asyncrl.inference.weight_buckets import WeightStaging

WEIGHTS_PATH = "/update_weights/tensors"


class ServerConfig(Config):
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = pydantic.Field(8000, ge=0, le=65535)  # 0: pick a free port and print it
    api_key: str | None = None  # bearer token required by control and weight endpoints
    model_name: str = "default"
    max_body_bytes: int = pydantic.Field(1 << 20, ge=1024)  # JSON bodies
    max_weight_bucket_bytes: int = pydantic.Field(2 << 30, ge=1024)  # one streamed bucket
    max_tokens_cap: int | None = pydantic.Field(None, ge=1)  # upper bound on max_tokens


def error_body(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    err = {"message": message, "type": kind, "param": param, "code": status}
    return JSONResponse({"error": err}, status_code=status)


async def invalid_request(_: Request, err: RequestValidationError) -> JSONResponse:
    """A body that fails validation: 400 naming the first bad field (FastAPI's default is 422)."""
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"] if p != "body")
    msg = first["msg"].removeprefix("Value error, ")
    return error_body(400, f"{loc}: {msg}" if loc else msg, loc or None)


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
        except BodyTooLarge as err:
            await error_body(413, str(err))(scope, receive, send)


class BodyTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"request body is over the limit of {limit} bytes")


def create_app(engine: AsyncLLMEngine, tokenizer: Any, cfg: ServerConfig) -> FastAPI:
    app = FastAPI(title="asyncrl inference server")
    metrics = EngineMetrics(engine)

    def require_key(authorization: str | None = Header(None)) -> None:
        if cfg.api_key is None:
            return
        given = (authorization or "").removeprefix("Bearer ").encode()
        if not hmac.compare_digest(given, cfg.api_key.encode()):
            raise PermissionError("missing or wrong bearer token")

    app.add_exception_handler(RequestValidationError, invalid_request)

    @app.exception_handler(ValueError)
    async def _bad_value(_: Request, err: ValueError) -> JSONResponse:
        return error_body(400, str(err))

    @app.exception_handler(PermissionError)
    async def _forbidden(_: Request, err: PermissionError) -> JSONResponse:
        return error_body(401, str(err))

    @app.post("/generate")
    async def generate(body: GenerateBody) -> dict:
        req = ModelRequest(input_ids=body.input_ids, gconfig=body.gconfig(), **rid_kwargs(body.rid))
        t0 = time.perf_counter()
        resp = await engine.agenerate(req)
        metrics.observe(resp, time.perf_counter() - t0)
        return {
            "rid": resp.rid, "input_len": resp.input_len, "output_tokens": resp.output_tokens,
            "output_logprobs": resp.output_logprobs, "output_versions": resp.output_versions,
            "stop_reason": resp.stop_reason.value, "latency": resp.latency, "ttft": resp.ttft,
        }

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "version": engine.get_version()}

    @app.get("/version")
    async def version() -> dict:
        return {"version": engine.get_version()}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=metrics.content_type)

    add_control_routes(app, engine, Depends(require_key))
    add_openai_routes(app, engine, tokenizer, cfg, metrics)
    app.add_middleware(BodyLimit, limit=cfg.max_body_bytes,
                       weights_limit=cfg.max_weight_bucket_bytes)
    return app


def add_control_routes(app: FastAPI, engine: AsyncLLMEngine, auth: Any) -> None:
    """Pause/resume/abort and weight updates: the endpoints that change the server's state."""
    staging = WeightStaging()

    @app.post("/pause", dependencies=[auth])
    async def pause() -> dict:
        await asyncio.to_thread(engine.pause)
        return {"paused": True, "version": engine.get_version()}

    @app.post("/resume", dependencies=[auth])
    async def resume() -> dict:
        await asyncio.to_thread(engine.resume)
        return {"paused": False, "version": engine.get_version()}

    @app.post("/abort", dependencies=[auth])
    async def abort(body: AbortBody | None = None) -> dict:
        n = await asyncio.to_thread(engine.abort, body.rid if body else None)
        return {"aborted": n}

    @app.post("/update_weights", dependencies=[auth])
    async def update_from_disk(body: DiskWeightsBody) -> dict:
        await engine.update_weights(WeightUpdateMeta.from_disk(body.path, body.version))
        return {"version": engine.get_version()}

    @app.post(WEIGHTS_PATH, dependencies=[auth])
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


def rid_kwargs(rid: str | None) -> dict[str, str]:
    return {"rid": rid} if rid else {}
