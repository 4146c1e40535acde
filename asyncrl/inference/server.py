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
from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig
from asyncrl.inference.http_auth import BearerKey
from asyncrl.inference.http_errors import InternalErrors, error_body, install_error_handlers
from asyncrl.inference.http_schema import (
    AbortBody,
    DiskWeightsBody,
    DistributedUpdateBody,
    GenerateBody,
    JoinGroupBody,
)
from asyncrl.inference.metrics import EngineMetrics
from asyncrl.inference.messages_api import AnthropicErrors
from asyncrl.inference.openai_routes import ResponseNotFound, add_openai_routes
from asyncrl.inference.weight_buckets import WeightStaging
from asyncrl.inference.weight_group import DistributedWeightReceiver
from asyncrl.models.chat_options import ChatOptions

WEIGHTS_PATH = "/update_weights/tensors"
LORA_PATH = "/update_weights/lora"  # a PEFT adapter directory (backends.AsyncrlBackend)
JOIN_GROUP_PATH = "/weights/join_group"
GROUP_UPDATE_PATH = "/weights/update_distributed"


class ServerConfig(ChatOptions):
    """The built-in server; its chat options (chat_template_kwargs, reasoning_parser,
    tool_parser) shape /v1/chat/completions like vLLM's flags of the same names."""

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
    install_error_handlers(app, {ValueError: 400, ResponseNotFound: 404})

    @app.post("/generate")
    async def generate(body: GenerateBody) -> Any:
        req = ModelRequest(input_ids=body.input_ids, gconfig=body.gconfig(), **rid_kwargs(body.rid))
        if body.stream:
            engine.validate(req)  # a bad request is a 400 before the stream starts
            return StreamingResponse(stream_generate(engine, req, metrics, body.stream_interval),
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
    app.add_middleware(InternalErrors)  # catches what the others raise
    app.add_middleware(AnthropicErrors)  # outermost: /v1/messages errors in Anthropic's shape
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

    @app.post(LORA_PATH)
    async def update_lora_from_disk(body: DiskWeightsBody) -> dict:
        """A PEFT adapter directory, merged into the model this server was started with."""
        await engine.update_weights(WeightUpdateMeta.lora_from_disk(body.path, body.version))
        return {"version": engine.get_version()}

    @app.post(WEIGHTS_PATH)
    async def update_from_bucket(
        request: Request, version: int = Query(ge=0), bucket: int = Query(ge=0),
        last: bool = Query(False), lora_scale: float | None = Query(None, gt=0),
    ) -> dict:
        staged = staging.add(version, bucket, await request.body())
        if not last:
            return {"staged_tensors": staged, "version": engine.get_version()}
        new_version, tensors = staging.take()
        # lora_scale: the tensors are a PEFT adapter (alpha / r), merged into the base weights
        meta = WeightUpdateMeta(kind=WeightUpdateKind.TENSORS, version=new_version,
                                lora=lora_scale is not None, lora_scale=lora_scale)
        await engine.update_weights(meta, tensors)
        return {"staged_tensors": staged, "version": engine.get_version()}

    add_group_routes(app, engine)


def add_group_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """Weights by collective broadcast: join the trainer's group once, then receive each update
    (the trainer broadcasts while the update call waits here). A new join replaces the group."""
    state: dict[str, Any] = {"receiver": None}
    lock = asyncio.Lock()  # one join or update at a time: the group is one ordered stream

    @app.post(JOIN_GROUP_PATH)
    async def join_group(body: JoinGroupBody) -> dict:
        meta = WeightUpdateMeta(
            kind=WeightUpdateKind.DISTRIBUTED, version=engine.get_version(),
            master_addr=body.master_address, master_port=body.master_port,
            world_size=body.world_size, group_name=body.group_name, backend=body.backend)
        async with lock:
            old, state["receiver"] = state["receiver"], None
            if old is not None:
                old.close()
            try:
                receiver = await asyncio.to_thread(
                    DistributedWeightReceiver, meta, body.rank_offset, body.timeout_s,
                    engine.device)
            except ValueError:
                raise
            except Exception as err:  # the rendezvous failed: the trainer's end, not ours
                raise HTTPException(503, f"could not join the weight group at "
                                         f"{body.master_address}:{body.master_port} as rank "
                                         f"{body.rank_offset}: {err}") from err
            state["receiver"] = receiver
        return {"success": True, "rank": body.rank_offset, "tensors": len(receiver.spec)}

    @app.post(GROUP_UPDATE_PATH)
    async def update_distributed(body: DistributedUpdateBody) -> dict:
        async with lock:
            receiver = state["receiver"]
            if receiver is None:
                raise HTTPException(409, f"this server has joined no weight group; POST "
                                         f"{JOIN_GROUP_PATH} first")
            try:
                version, tensors = await asyncio.to_thread(receiver.receive)
            except Exception as err:  # a broken group cannot be reused: the trainer re-forms it
                state["receiver"] = None
                receiver.close()
                raise HTTPException(503, f"receiving the weight broadcast failed: {err}") from err
            if version != body.version:
                raise HTTPException(409, f"the trainer broadcast version {version}, the call "
                                         f"announced version {body.version}")
            await engine.update_weights(WeightUpdateMeta.from_tensors(version), tensors)
        return {"success": True, "version": engine.get_version()}


def generate_reply(resp: ModelResponse) -> dict[str, Any]:
    return {
        "rid": resp.rid, "input_len": resp.input_len, "output_tokens": resp.output_tokens,
        "output_logprobs": resp.output_logprobs, "output_versions": resp.output_versions,
        "stop_reason": resp.stop_reason.value, "latency": resp.latency, "ttft": resp.ttft,
    }


async def stream_generate(engine: AsyncLLMEngine, req: ModelRequest, metrics: EngineMetrics,
                          interval: int = 1) -> AsyncIterator[str]:
    """`/generate` with stream: an event once `interval` new tokens were sampled, then the
    whole reply's fields (the tokens not sent yet as the last delta) with the stop reason."""
    sent = 0
    async for item in engine.agenerate_stream(req, interval):
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
