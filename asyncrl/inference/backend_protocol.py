"""What every backend adapter is: the `Backend` protocol and the values it trades in.

A `Backend` only translates: one generation segment -> one HTTP call, the reply -> a `Segment`
(tokens, logprobs, per-token versions, stop reason), a streamed event -> a `Delta`; plus the
calls of its health, pause, resume, abort and weight-update routes, and the startup checks
(`ServerCheck`) a server must pass. Adapters: backends.py (asyncrl, and the registry),
vllm_backend.py, sglang_backend.py. A backend's plugin config (`BackendKind`) also writes the
command that starts one of its servers (`ServerCommand`) from what the job asks of it
(`ServerLaunch`); vLLM and SGLang need a port chosen up front and are ready when `/health`
answers 200, `asyncrl serve --port 0` picks its own and prints it after `READY_PREFIX`.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from asyncrl.api import GenerationConfig, ImageInputs, StopReason
from asyncrl.config import Config
from asyncrl.inference.config import EngineSettings


class BackendReplyError(RuntimeError):
    """A server replied 200 with a body that does not have the shape its backend expects."""


@dataclass(frozen=True)
class HttpCall:
    method: str  # "GET" or "POST"
    path: str
    json: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    # a 404 answer means what the call removes is already gone (e.g. an adapter unload on a
    # restarted server): the call succeeded
    missing_ok: bool = False


@dataclass
class Segment:
    """The output of one HTTP generation call; a response may be stitched from several."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int] | None  # None: the server cannot tell; the client stamps its known version
    stop_reason: StopReason
    ttft: float | None = None  # server-measured seconds to the first token, when reported

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.logprobs) != n or (self.versions is not None and len(self.versions) != n):
            raise BackendReplyError(
                f"reply lengths differ: tokens={n}, logprobs={len(self.logprobs)}, "
                f"versions={None if self.versions is None else len(self.versions)}"
            )


@dataclass(frozen=True)
class LoraServing:
    """What servers of a `train.lora` job must allow: adapters of rank `rank` loaded at run
    time, `keep_versions` of them (eta + 1) held for requests in flight."""

    rank: int
    keep_versions: int = 1


@dataclass(frozen=True)
class ServerCheck:
    """One startup check: `call`, then `verdict(status, body)` -> None if fine, else the problem
    and its fix."""

    call: HttpCall
    verdict: Callable[[int, Any], str | None]
    waivable: bool = False  # a version-range check: allow_untested_server turns it into a warning


@dataclass(frozen=True)
class ModelQuery:
    """Which model a server serves: `call`, then `path(body)` -> the model directory or name it
    was started with (None when the reply does not say)."""

    call: HttpCall
    path: Callable[[Any], str | None]


def openai_model_root(body: Any) -> str | None:
    """The base model's `root` (the path it was loaded from) in an OpenAI-style GET /v1/models
    reply (vLLM, `asyncrl serve`); adapters, listed with a `parent`, are skipped."""
    for card in (body.get("data") or []) if isinstance(body, dict) else []:
        if isinstance(card, dict) and not card.get("parent") and card.get("root"):
            return str(card["root"])
    return None


def version_tuple(text: str) -> tuple[int, ...]:
    """'0.32.0' -> (0, 32, 0); a suffix (rc1, .post2, +cpu) ends the numeric part."""
    parts = []
    for piece in re.split(r"[.+]", str(text)):
        m = re.match(r"\d+", piece)
        if m is None:
            break
        parts.append(int(m.group()))
        if m.end() < len(piece):
            break
    return tuple(parts)


def version_verdict(server: str, tested: tuple[tuple[int, ...], tuple[int, ...]],
                     field: str) -> Callable[[int, Any], str | None]:
    low, high = tested

    def verdict(status: int, body: Any) -> str | None:
        version = body.get(field) if isinstance(body, dict) else None
        if status != 200 or version is None:
            return f"does not report its {server} version (HTTP {status}): is it a {server} server?"
        if not low <= version_tuple(version) < high:
            span = f"[{'.'.join(map(str, low))}, {'.'.join(map(str, high))})"
            return (f"runs {server} {version}, outside the tested range {span}; use a tested "
                    "release, or set inference.remote.allow_untested_server=true to try it")
        return None

    return verdict


@dataclass(frozen=True)
class GroupJoin:
    """Where a server joins the trainer's weight-broadcast group (rank 0 is the trainer)."""

    master_addr: str
    master_port: int
    world_size: int  # 1 (trainer) + every engine rank of every server
    rank_offset: int  # this server's first rank in the group
    group_name: str
    backend: str  # "nccl" or "gloo"


def join_body(join: GroupJoin) -> dict[str, Any]:
    """The join body SGLang's /init_weights_update_group takes; `asyncrl serve` takes the same."""
    return {"master_address": join.master_addr, "master_port": join.master_port,
            "rank_offset": join.rank_offset, "world_size": join.world_size,
            "group_name": join.group_name, "backend": join.backend}


@dataclass(frozen=True)
class WireTensor:
    """One tensor of a broadcast update, as the receiving server is told about it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"


@dataclass
class Delta:
    """One event of a streamed generation call: new tokens, and the stop reason on the last."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason | None = None
    versions: list[int] | None = None  # per token, from servers that report them (asyncrl)
    # where `tokens` start in the call's output: None appends; an int replaces from there
    # (servers whose events repeat the output so far: SGLang without incremental streaming)
    offset: int | None = None


class Backend(Protocol):
    name: str
    supports_tensor_push: bool  # /update_weights/tensors buckets (weight_buckets.py)
    supports_stream: bool  # generate_call(stream=True) answers server-sent events
    supports_images: bool  # generate_call takes a prompt's images

    def generate_call(self, input_ids: list[int], gconfig: GenerationConfig, rid: str,
                      stream: bool = False, images: ImageInputs | None = None) -> HttpCall: ...

    def parse_generate(self, body: Any) -> Segment: ...

    def parse_stream_event(self, event: Any) -> Delta:
        """One `data:` event of a streamed call (backends with supports_stream)."""

    def health_call(self) -> HttpCall: ...

    def parse_health(self, body: Any) -> int | None:
        """The server's weight version if its health reply reports one."""

    def pause_call(self) -> HttpCall: ...

    def resume_call(self) -> HttpCall: ...

    def abort_call(self, rid: str) -> HttpCall | None: ...

    def disk_update_calls(self, path: str, version: int) -> list[HttpCall]:
        """The calls, in order, that make the server load `path` and report `version`; empty
        when it has no HTTP endpoint that loads weights from a directory."""

    def lora_update_calls(self, path: str, version: int, keep_versions: int) -> list[HttpCall]:
        """The calls, in order, that make the server apply the PEFT adapter directory `path`
        (adapter_config.json + adapter_model.safetensors) to its base model and serve it as
        `version`, keeping the adapters of the last `keep_versions` versions usable by requests
        still in flight; raises ValueError naming the backend when it cannot."""

    def server_checks(self) -> list[ServerCheck]:
        """What must hold before the server is used (version, routes, logprobs mode)."""

    def model_query(self) -> ModelQuery:
        """How to ask a server which model it serves (the startup model check)."""

    # Collective weight sync (`inference.weight_sync: nccl | gloo`); None when unsupported.
    # broadcast_layout: how the trainer sends one update: "buckets" (a [version, count] header,
    # then same-dtype tensors flattened into buckets; inference/weight_group.py) or "per_tensor"
    # (one broadcast per tensor, in the order of the update call's list).
    broadcast_layout: str | None

    def join_group_call(self, join: GroupJoin) -> HttpCall:
        """The call that makes the server join the group; it returns once the group has formed,
        so it is sent while the trainer builds its own end."""

    def distributed_update_calls(self, join: GroupJoin, tensors: list[WireTensor],
                                 version: int) -> list[HttpCall]:
        """The calls, in order, that make the server (joined as `join`) receive one broadcast
        update (sent while the trainer broadcasts) and then serve `version`."""

    def failed_update_recovery_calls(self) -> list[HttpCall]:
        """Calls that leave the server serving its old weights after a failed update."""

    def ranks_call(self) -> HttpCall | None:
        """The call that asks a server how many group ranks it takes (vLLM: TP*PP*DP), or None
        when the config says (`inference.remote.ranks_per_server`)."""

    def parse_ranks(self, body: Any) -> int: ...


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


class BackendKind(Config):
    """What a backend's plugin config (`inference.backend`) declares and makes: the base class
    of every kind `BACKENDS` registers, which must set each class attribute below."""

    weight_syncs: ClassVar[tuple[str, ...]]  # "tensors" (HTTP buckets), "disk", "nccl", "gloo"
    lora: ClassVar[bool]  # LoRA adapters loaded at run time
    untied_head: ClassVar[bool]  # the served model needs lm_head.weight of its own
    tested: ClassVar[str]  # the server versions it was tested against
    images: ClassVar[bool]  # prompts with images reach its servers

    def build(self, model: str | None = None, lora: LoraServing | None = None,
              images: bool = False) -> Backend:
        """The adapter of the remote client (`model`: the served model name, when needed;
        `images`: prompts will carry images, so its servers are checked for that)."""
        raise NotImplementedError

    def check_lora(self, lora: LoraServing) -> None:
        """ValueError naming the limit when its servers cannot take these adapters."""
        raise NotImplementedError

    def server_command(self, model_dir: str, launch: ServerLaunch) -> ServerCommand:
        """The command that starts one of its servers, as `launch` asks."""
        raise NotImplementedError


def reply_field(body: Any, *keys: str | int) -> Any:
    """body[k0][k1]... with an error naming the missing path instead of a bare KeyError."""
    node = body
    for i, key in enumerate(keys):
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            path = "".join(f"[{k!r}]" for k in keys[: i + 1])
            raise BackendReplyError(f"reply has no {path}: {str(body)[:300]}") from None
    return node


# Sampling fields a server would otherwise fill from the model's generation_config.json (vLLM's
# "server defaults", SGLang's chat defaults): pinned to the values the trainer's loss assumes.
NEUTRAL_SAMPLING = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "min_p": 0.0}


def is_int(value: Any) -> bool:
    if isinstance(value, int):
        return True
    return isinstance(value, str) and value.strip().lstrip("-").isdigit()
