"""`asyncrl serve`: the built-in engine behind its HTTP server, in this process.

With port 0 the OS picks a free port; the first stdout line then tells it
("asyncrl serve: listening on http://HOST:PORT"), which is how launchers and tests find the server.
"""

from __future__ import annotations

import os
import sys

import torch
import uvicorn

from asyncrl.inference.async_engine import AsyncLLMEngine
from asyncrl.inference.engine import EngineConfig
from asyncrl.inference.server import ServerConfig, create_app
from asyncrl.inference.backend_protocol import READY_PREFIX
from asyncrl.listening import listening_socket
from asyncrl.models.loading import check_model_dir, load_tokenizer, resolve_model_path


def build_server_app(cfg: ServerConfig):
    # a hub id (`--model org/name`) is resolved once to its cached snapshot, which the engine
    # then loads like any local directory
    model_dir = check_model_dir(resolve_model_path(cfg.engine.model_path, setting="--model"))
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(
        update={"model_path": str(model_dir)})})
    tokenizer = load_tokenizer(model_dir, cfg.engine.trust_remote_code)

    def detokenize(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    engine = AsyncLLMEngine(cfg.engine, detokenize=detokenize)
    return create_app(engine, tokenizer, cfg), engine


def serve(cfg: ServerConfig) -> None:
    if cfg.engine.num_threads:  # this process is the engine's alone
        torch.set_num_threads(cfg.engine.num_threads)
    app, engine = build_server_app(cfg)
    print(f"asyncrl serve: {torch.get_num_threads()} torch threads on CPUs "
          f"{sorted(os.sched_getaffinity(0))}", file=sys.stderr, flush=True)
    # Listening before announcing READY: a client connecting while uvicorn still starts waits
    # in the backlog instead of being refused (seen under load as ConnectError on a fresh server).
    sock = listening_socket(cfg.host, cfg.port, 2048)
    host, port = sock.getsockname()[:2]
    # keep-alive above httpx's 5 s pool expiry: clients never reuse a connection being closed
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5,
                                           timeout_keep_alive=120))
    print(f"{READY_PREFIX}http://{host}:{port}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        engine.shutdown()
        sys.stdout.flush()


def server_config_from_args(model: str, port: int, host: str, api_key: str | None,
                            overrides: list[str], trust_remote_code: bool = False
                            ) -> ServerConfig:
    base = [f"engine.model_path={model}", f"port={port}", f"host={host}"]
    if api_key:
        base.append(f"api_key={api_key}")
    if trust_remote_code:
        base.append("engine.trust_remote_code=true")
    return ServerConfig.load(None, base + overrides)


__all__ = ["EngineConfig", "READY_PREFIX", "ServerConfig", "serve", "server_config_from_args"]
