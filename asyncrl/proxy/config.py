"""Typed configs of the proxy server and of the agent workflow that drives it."""

from __future__ import annotations

from typing import Literal

import pydantic

from asyncrl.config import Config


class ProxyConfig(Config):
    host: str = "127.0.0.1"  # the proxy's listen address
    port: int = pydantic.Field(0, ge=0, le=65535)  # 0: a free port
    admin_key: str | None = pydantic.Field(
        None, description="bearer key for session start/end/export; None: random per server")
    model_name: str = "default"  # the name /v1/models reports; any requested name is served
    session_timeout_s: float = pydantic.Field(
        600.0, gt=0, description="a session idle for longer expires; its data is dropped")
    max_sessions: int = pydantic.Field(1024, ge=1, description="active sessions; more get 429")
    max_body_bytes: int = pydantic.Field(4 << 20, ge=1024)  # larger request bodies get 413
    max_tokens_cap: int = pydantic.Field(
        1024, ge=1, description="upper bound on max_tokens; also the default when unset")
    max_n: int = pydantic.Field(16, ge=1, description="upper bound on `n` choices per request")
    # image_url parts (a vision-language policy): data URLs always; file:// URLs only of files
    # under this directory (None: none), never fetched from the network
    image_dir: str | None = None
    # Longer than any client's idle-connection expiry (httpx: 5 s), so a client never reuses a
    # pooled connection the server is closing at that instant (an APIConnectionError mid-run).
    keep_alive_s: float = pydantic.Field(120.0, gt=0)


class AgentConfig(Config):
    """How agent programs run (`rollout.agent` in AReaL's terms)."""

    path: str | None = pydantic.Field(
        None, description="the agent: package.module:Class, package.module.Class or an instance "
                          "path; Python callers may pass the object itself")
    init_kwargs: dict = pydantic.Field(default_factory=dict, description="when path is a class")
    # inline: the agent runs on the rollout event loop; subproc: in a process pool
    mode: Literal["inline", "subproc"] = "inline"
    subproc_max_workers: int = pydantic.Field(4, ge=1)  # processes of the subproc pool
    # an earlier completion's return is its reward plus this times the next one's return
    turn_discount: float = pydantic.Field(1.0, ge=0.0, le=1.0)
    # individual: one trajectory per completion; concat: one per episode
    export_style: Literal["individual", "concat"] = "individual"
    timeout_s: float = pydantic.Field(300.0, gt=0, description="one run() call; longer = rejected")
    proxy: ProxyConfig = ProxyConfig()
