"""Both HTTP servers in this process on 127.0.0.1 (ephemeral ports): the inference server's app
under uvicorn on a thread, and the agent proxy on a background event loop, with the tiny model and
small generation caps so a request costs milliseconds."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig
from asyncrl.inference.server import ServerConfig
from asyncrl.launch.serve import build_server_app
from asyncrl.models.loading import load_tokenizer
from asyncrl.proxy.config import ProxyConfig
from tests.proxy_helpers import serving

ADMIN_KEY = "admin-secret"
CTX = 128


@contextlib.contextmanager
def inference_server(model_dir, *overrides: str) -> Iterator[str]:
    """`asyncrl serve`'s app (the same builder) under uvicorn on a thread; yields its URL."""
    cfg = ServerConfig.load(None, [f"engine.model_path={model_dir}", f"engine.max_seq_len={CTX}",
                                   "engine.max_num_seqs=8", "max_tokens_cap=4", *overrides])
    app, engine = build_server_app(cfg)
    try:
        with serve_app(app) as url:
            yield url
    finally:
        engine.shutdown()


@contextlib.contextmanager
def serve_app(app) -> Iterator[str]:
    """An ASGI app under uvicorn on a thread, on an ephemeral port of 127.0.0.1; yields its URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="critical",
                                           timeout_keep_alive=120))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)


@contextlib.contextmanager
def proxy_server(model_dir, **cfg) -> Iterator:
    """The agent proxy on the real built-in engine; yields the ProxyServer."""
    tokenizer = load_tokenizer(model_dir)
    engine = AsyncLLMEngine(EngineConfig(model_path=str(model_dir), max_seq_len=CTX),
                            detokenize=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    config = ProxyConfig(admin_key=ADMIN_KEY, max_tokens_cap=4, max_n=4, **cfg)
    try:
        with serving(engine, tokenizer, config, context_length=CTX) as (proxy, _):
            yield proxy
    finally:
        engine.shutdown()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def start_session(proxy) -> dict:
    r = httpx.post(f"{proxy.url}/sessions", headers=auth(ADMIN_KEY))
    assert r.status_code == 200, r.text
    return r.json()
