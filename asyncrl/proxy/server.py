"""`ProxyServer`: the proxy's HTTP app and its uvicorn lifecycle on the caller's event loop.

Keys: completions, `/v1/models` and reading a stored completion need the session's key; session
start, end and export need the admin key; a reward may be set with either (a session only for
itself). Every endpoint but `/health` needs a key. Errors use OpenAI's JSON shape: 400 bad input,
401 key, 403 the session has ended (its key may still set its reward), 404 unknown route, session
or completion (`NotFoundError`; a KeyError is a bug, answered 500 like every unexpected error,
which leaves the connection open), 405, 413 body too large, 429 no capacity.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable
from typing import Any, Literal

import pydantic
import uvicorn
from fastapi import FastAPI, Header
from fastapi.responses import StreamingResponse

from asyncrl.api import InferenceEngine
from asyncrl.inference import messages_api, responses_api
from asyncrl.inference.http_errors import InternalErrors, install_error_handlers
from asyncrl.inference.messages_api import AnthropicErrors
from asyncrl.inference.http_schema import ChatCompletionBody, CompletionBody, StrictBody
from asyncrl.inference.server import BodyLimit
from asyncrl.models.chat_options import ChatOptions
from asyncrl.proxy.config import ProxyConfig
from asyncrl.proxy.errors import AuthError, CapacityError, NotFoundError, SessionEndedError
from asyncrl.proxy.routes import ProxyRoutes, stream_chat, stream_completion
from asyncrl.proxy.sessions import SessionStore


class RewardBody(StrictBody):
    reward: float | dict[str, float]


class ExportBody(StrictBody):
    style: Literal["individual", "concat"] = "individual"
    turn_discount: float = pydantic.Field(1.0, ge=0.0, le=1.0)


def bearer(authorization: str | None) -> str | None:
    return authorization.removeprefix("Bearer ").strip() if authorization else None


class ProxyServer:
    def __init__(self, engine: InferenceEngine, tokenizer: Any, cfg: ProxyConfig | None = None,
                 admission: Callable[[], int] | None = None,
                 context_length: int | None = None, chat: ChatOptions | None = None,
                 vision: Any = None) -> None:
        self.cfg = cfg or ProxyConfig()
        self.admin_key = self.cfg.admin_key or f"sk-admin-{secrets.token_hex(24)}"
        self.store = SessionStore(self.admin_key, self.cfg.session_timeout_s,
                                  self.cfg.max_sessions, admission)
        # chat: the model's template variables and reply parsers (ModelConfig is one); vision:
        # a vision-language policy's VisionPromptEncoder (image_url parts)
        self.routes = ProxyRoutes(engine, tokenizer, self.cfg, context_length, chat, vision)
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.base_url = ""  # http://host:port/v1 once started

    # ---- lifecycle (on the event loop that runs the engine clients) ---------------------------

    async def start(self) -> str:
        config = uvicorn.Config(self.app, host=self.cfg.host, port=self.cfg.port,
                                log_level="warning", lifespan="off", access_log=False,
                                timeout_keep_alive=self.cfg.keep_alive_s)
        self._server = uvicorn.Server(config)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the bind error
                raise RuntimeError("proxy server exited before it started")
            await asyncio.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://{self.cfg.host}:{port}/v1"
        return self.base_url

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = None

    @property
    def url(self) -> str:
        """The server root (admin endpoints); `base_url` is this + /v1 for OpenAI clients."""
        return self.base_url.removesuffix("/v1")

    # ---- app ----------------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="asyncrl agent proxy")
        install_error_handlers(app, {ValueError: 400, AuthError: 401, SessionEndedError: 403,
                                     NotFoundError: 404, CapacityError: 429})
        self._openai_routes(app)
        self._session_routes(app)
        app.add_middleware(BodyLimit, limit=self.cfg.max_body_bytes,
                           weights_limit=self.cfg.max_body_bytes)
        app.add_middleware(InternalErrors)  # catches what the others raise
        app.add_middleware(AnthropicErrors)  # outermost: /v1/messages errors in its shape
        return app

    def _openai_routes(self, app: FastAPI) -> None:
        """What agents call with their session key (OpenAI's shape)."""
        store, routes = self.store, self.routes

        @app.get("/health")
        async def health() -> dict:
            return {"status": "ok", "active_sessions": store.active}

        @app.get("/v1/models")
        async def models(authorization: str | None = Header(None)) -> dict:
            key = bearer(authorization)
            try:
                store.by_key(key)
            except AuthError:
                store.check_admin(key)
            card = {"id": self.cfg.model_name, "object": "model", "owned_by": "asyncrl"}
            return {"object": "list", "data": [card]}

        @app.post("/v1/chat/completions")
        async def chat(body: ChatCompletionBody, authorization: str | None = Header(None)):
            reply = await routes.chat(store.by_key(bearer(authorization)), body)
            if body.stream:
                usage = bool((body.stream_options or {}).get("include_usage"))
                return StreamingResponse(stream_chat(reply, usage), media_type="text/event-stream")
            return reply

        @app.post("/v1/completions")
        async def completions(body: CompletionBody, authorization: str | None = Header(None)):
            reply = await routes.completions(store.by_key(bearer(authorization)), body)
            if body.stream:
                return StreamingResponse(stream_completion(reply), media_type="text/event-stream")
            return reply

        @app.post(messages_api.PATH)
        async def messages(body: messages_api.MessagesBody,
                           x_api_key: str | None = Header(None),
                           authorization: str | None = Header(None)):
            session = store.by_key(messages_api.api_key(x_api_key, authorization))
            reply = await routes.messages(session, body)
            if body.stream:
                return StreamingResponse(messages_api.stream_events(reply),
                                         media_type="text/event-stream")
            return reply

        @app.post(responses_api.PATH)
        async def responses(body: responses_api.ResponsesBody,
                            authorization: str | None = Header(None)):
            reply = await routes.responses(store.by_key(bearer(authorization)), body)
            if body.stream:
                return StreamingResponse(responses_api.stream_events(reply),
                                         media_type="text/event-stream")
            return reply

        @app.get("/v1/chat/completions/{completion_id}")
        async def read_completion(completion_id: str,
                                  authorization: str | None = Header(None)) -> dict:
            session = store.by_key(bearer(authorization))
            return session.completion(completion_id).public()

    def _session_routes(self, app: FastAPI) -> None:
        """Session control with the admin key (a session key may reward its own session)."""
        store, routes = self.store, self.routes

        @app.post("/sessions")
        async def start(authorization: str | None = Header(None)) -> dict:
            store.check_admin(bearer(authorization))
            session = store.start()
            return {"session_id": session.id, "api_key": session.api_key,
                    "base_url": self.base_url}

        @app.post("/sessions/{sid}/reward")
        async def reward(sid: str, body: RewardBody,
                         authorization: str | None = Header(None)) -> dict:
            key = bearer(authorization)
            try:
                store.check_admin(key)
                session = store.get(sid)
            except AuthError:
                session = store.by_key(key, ended_ok=True)
                if session.id != sid:
                    raise AuthError("a session key may only reward its own session") from None
            session.set_reward(body.reward)
            return {"session_id": sid, "rewards": len(session.rewards)}

        @app.post("/sessions/{sid}/end")
        async def end(sid: str, authorization: str | None = Header(None)) -> dict:
            store.check_admin(bearer(authorization))
            session = store.end(sid)
            return {"session_id": sid, "completions": len(session.completions)}

        @app.post("/sessions/{sid}/export")
        async def export(sid: str, body: ExportBody,
                         authorization: str | None = Header(None)) -> dict:
            store.check_admin(bearer(authorization))
            samples = store.export(sid, body.style, body.turn_discount)
            return {"session_id": sid, "samples": [sample_json(s) for s in samples]}

        @app.get("/stats")
        async def stats(authorization: str | None = Header(None)) -> dict:
            store.check_admin(bearer(authorization))
            return {**routes.stats, "active_sessions": store.active,
                    "expired_sessions": store.expired}


def sample_json(s: Any) -> dict[str, Any]:
    return {"input_ids": s.input_ids, "loss_mask": s.loss_mask, "logprobs": s.logprobs,
            "versions": s.versions, "reward": s.reward, "token_rewards": s.token_rewards,
            "stop_reason": s.stop_reason.value, "metadata": s.metadata,
            "image_digest": s.images.digest if s.images is not None else None}
