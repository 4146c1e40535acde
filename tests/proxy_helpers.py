"""Shared pieces of the proxy tests: a proxy served from a background event loop, and a scripted
engine for replies an untrained tiny model cannot produce (well-formed tool calls); tests of
sampling and recording use the real built-in engine instead."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator

from asyncrl.api import ModelRequest, ModelResponse, StopReason
from asyncrl.proxy.config import ProxyConfig
from asyncrl.proxy.server import ProxyServer


class LoopThread:
    """An event loop on a daemon thread; `run(coro)` from any other thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@contextlib.contextmanager
def serving(engine, tokenizer, cfg: ProxyConfig | None = None, **kwargs) -> Iterator[
        tuple[ProxyServer, LoopThread]]:
    lt = LoopThread()
    proxy = ProxyServer(engine, tokenizer, cfg or ProxyConfig(admin_key="admin-secret"), **kwargs)
    lt.run(proxy.start())
    try:
        yield proxy, lt
    finally:
        lt.run(proxy.stop())
        lt.close()


class ScriptedEngine:
    """InferenceEngine double whose replies are given text (+ EOS), with known logprobs."""

    def __init__(self, tokenizer, replies: Callable[[ModelRequest], str] | list[str]) -> None:
        self.tokenizer, self.replies, self.version = tokenizer, replies, 0
        self.requests: list[ModelRequest] = []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(req)
        text = self.replies(req) if callable(self.replies) else self.replies.pop(0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        ids = ids[:req.gconfig.max_new_tokens - 1] + [self.tokenizer.eos_token_id]
        n = len(ids)
        return ModelResponse(req.input_ids, ids, [-0.25 - 0.01 * i for i in range(n)],
                             [self.version] * n, StopReason.STOP)

    def get_version(self) -> int:
        return self.version

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    async def update_weights(self, meta) -> None:
        self.version = meta.version


@contextlib.contextmanager
def real_engine_proxy(model_dir, tokenizer) -> Iterator[tuple[ProxyServer, dict]]:
    """The built-in engine on the tiny model behind a proxy, and one open session
    ({"session_id", "api_key", "base_url"}); both are stopped afterwards."""
    import httpx

    from asyncrl.inference.async_engine import AsyncLLMEngine
    from asyncrl.inference.engine import EngineConfig

    engine = AsyncLLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=256))
    try:
        cfg = ProxyConfig(admin_key="admin-secret", max_tokens_cap=32)
        with serving(engine, tokenizer, cfg, context_length=256) as (proxy, _):
            s = httpx.post(f"{proxy.url}/sessions",
                           headers={"Authorization": "Bearer admin-secret"}).json()
            yield proxy, s
    finally:
        engine.shutdown()
