"""How the job starts one inference server: what it asks of it (`ServerLaunch`) and the process the
server's backend answers with (`ServerCommand`: argv, environment, port, readiness). Each backend's
plugin config writes its own command (`server_command(model_dir, launch)`: backends.py,
vllm_backend.py, sglang_backend.py); the launch layer runs it (launch/local_servers.py, or a Ray
actor).

vLLM and SGLang need a port chosen up front (a free one is picked) and are ready when `/health`
answers 200; `asyncrl serve --port 0` picks its own and prints it after `READY_PREFIX`.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from asyncrl.inference.backend_protocol import LoraServing
from asyncrl.inference.config import EngineSettings

READY_PREFIX = "asyncrl serve: listening on "  # `asyncrl serve --port 0` prints it, then the URL


@dataclass
class ServerCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0  # 0: the server picks one and announces it on stdout (asyncrl)
    health_path: str = "/health"
    host: str = "127.0.0.1"  # where it listens (a node's address when others must reach it)


@dataclass(frozen=True)
class ServerLaunch:
    """What the job asks of every server it starts."""

    python: str  # the interpreter that has the server installed (vLLM brings its own torch)
    # max_num_seqs, dtype, threads, trust_remote_code
    engine: EngineSettings = field(default_factory=EngineSettings)
    api_key: str | None = None
    extra_args: tuple[str, ...] = ()  # inference.server_args
    weight_transfer: bool = False  # weights will come by NCCL broadcast
    host: str = "127.0.0.1"
    lora: LoraServing | None = None  # weights will come as LoRA adapters


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def concrete_dtype(dtype: str) -> str:
    """`EngineSettings.dtype` for a server that knows no "auto" of ours (vLLM and SGLang
    `--dtype`): float32 on a CPU machine, bfloat16 on CUDA."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if cuda_available() else "float32"
