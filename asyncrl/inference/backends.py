"""Wire formats of the servers the remote client drives: this project's server, vLLM and SGLang.

A `Backend` only translates: one generation segment -> one HTTP call, the reply -> a `Segment`
(tokens, logprobs, per-token versions, stop reason); plus the paths of its health, pause, resume,
abort and weight-update endpoints. Routing, retries and the continuation of interrupted requests
live in `remote.py` and are shared by every backend.

What each adapter assumes about its server is written next to it, with the source it was checked
against. Only the asyncrl backend is exercised against a live server in the tests; the other two
are tested on recorded reply shapes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Protocol

from asyncrl.api import GenerationConfig, StopReason


class BackendReplyError(RuntimeError):
    """A server replied 200 with a body that does not have the shape its backend expects."""


@dataclass(frozen=True)
class HttpCall:
    method: str  # "GET" or "POST"
    path: str
    json: dict[str, Any] | None = None
    params: dict[str, Any] | None = None


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


class Backend(Protocol):
    name: str
    supports_tensor_push: bool  # /update_weights/tensors buckets (weight_buckets.py)

    def generate_call(self, input_ids: list[int], gconfig: GenerationConfig, rid: str) -> HttpCall: ...

    def parse_generate(self, body: Any) -> Segment: ...

    def health_call(self) -> HttpCall: ...

    def parse_health(self, body: Any) -> int | None:
        """The server's weight version if its health reply reports one."""

    def pause_call(self) -> HttpCall: ...

    def resume_call(self) -> HttpCall: ...

    def abort_call(self, rid: str) -> HttpCall | None: ...

    def disk_update_call(self, path: str, version: int) -> HttpCall | None:
        """None when the server has no HTTP endpoint that loads weights from a directory."""


def _field(body: Any, *keys: str | int) -> Any:
    """body[k0][k1]... with an error naming the missing path instead of a bare KeyError."""
    node = body
    for i, key in enumerate(keys):
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            path = "".join(f"[{k!r}]" for k in keys[: i + 1])
            raise BackendReplyError(f"reply has no {path}: {str(body)[:300]}") from None
    return node


class AsyncrlBackend:
    """This project's server (`asyncrl serve`, inference/server.py): exact ids, logprobs, versions."""

    name = "asyncrl"
    supports_tensor_push = True

    def __init__(self, model: str | None = None) -> None:
        self.model = model  # unused: the server serves one model

    def generate_call(self, input_ids: list[int], gconfig: GenerationConfig, rid: str) -> HttpCall:
        g = gconfig
        body = {
            "input_ids": input_ids, "rid": rid, "max_new_tokens": g.max_new_tokens,
            "min_new_tokens": g.min_new_tokens, "temperature": g.temperature, "top_p": g.top_p,
            "top_k": g.top_k, "greedy": g.greedy, "stop_token_ids": list(g.stop_token_ids),
            "stop": list(g.stop), "seed": g.seed,
        }
        return HttpCall("POST", "/generate", json=body)

    def parse_generate(self, body: Any) -> Segment:
        try:
            stop = StopReason(_field(body, "stop_reason"))
        except ValueError:
            raise BackendReplyError(f"unknown stop_reason {body['stop_reason']!r}") from None
        return Segment(
            tokens=list(_field(body, "output_tokens")),
            logprobs=[float(x) for x in _field(body, "output_logprobs")],
            versions=list(_field(body, "output_versions")),
            stop_reason=stop,
            ttft=body.get("ttft"),
        )

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

    def disk_update_call(self, path: str, version: int) -> HttpCall | None:
        return HttpCall("POST", "/update_weights", json={"path": path, "version": version})


_VLLM_FINISH = {"stop": StopReason.STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORT,
                "tool_calls": StopReason.TOOL_CALLS}
_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")


class VLLMBackend:
    """vLLM's OpenAI server, `POST /v1/completions` with a token-id prompt.

    Checked against vllm-project/vllm `vllm/entrypoints/openai/protocol.py` (CompletionRequest:
    prompt as list[int], logprobs, min_tokens, top_k, stop_token_ids, skip_special_tokens,
    include_stop_str_in_output, request_id, return_tokens_as_token_ids -> logprobs.tokens are
    "token_id:{id}", return_token_ids -> choices[].token_ids in newer releases) and
    `vllm/entrypoints/serve/rlhf/api_router.py` (/pause?mode=abort, /resume; served only with
    VLLM_SERVER_DEV_MODE=1 in recent releases). Assumptions:
    - logprobs=0 returns the sampled token's logprob only. vLLM V1 reports *raw* logprobs (before
      temperature) by default, which equals this project's convention only at temperature 1.
    - A pause with mode=abort ends in-flight requests. Some releases return the partial output with
      finish_reason "abort"; the non-streaming completion path of others answers with an error
      body instead. Both are handled by the client: the first as an interruption with tokens, the
      second (an error while a pause happened) as an interruption with none.
    - No per-token weight version: the client stamps the version it knows the server holds.
    - Weight updates go through vLLM's weight-transfer engine (NCCL), not a directory path, so DISK
      and TENSORS updates are not offered here.
    """

    name = "vllm"
    supports_tensor_push = False

    def __init__(self, model: str | None = None) -> None:
        self.model = model

    def generate_call(self, input_ids: list[int], gconfig: GenerationConfig, rid: str) -> HttpCall:
        g = gconfig
        body: dict[str, Any] = {
            "prompt": input_ids, "max_tokens": g.max_new_tokens, "min_tokens": g.min_new_tokens,
            "temperature": 0.0 if g.greedy else g.temperature, "top_p": g.top_p,
            # Sent explicitly: an omitted value falls back to the model's generation_config.json.
            "top_k": g.top_k if g.top_k > 0 else -1,
            "stop": list(g.stop), "stop_token_ids": list(g.stop_token_ids),
            "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True,
            "skip_special_tokens": False, "include_stop_str_in_output": True,
            "n": 1, "stream": False, "request_id": rid,
        }
        if g.seed is not None:
            body["seed"] = g.seed
        if self.model is not None:
            body["model"] = self.model
        return HttpCall("POST", "/v1/completions", json=body)

    def parse_generate(self, body: Any) -> Segment:
        choice = _field(body, "choices", 0)
        finish = choice.get("finish_reason")
        if finish not in _VLLM_FINISH:
            raise BackendReplyError(f"vLLM finish_reason {finish!r}; known {list(_VLLM_FINISH)}")
        logprobs = _field(choice, "logprobs")
        values = _field(logprobs, "token_logprobs")
        ids = choice.get("token_ids")
        if ids is None:  # releases without return_token_ids: ids are spelled in logprobs.tokens
            ids = [self._token_id(t) for t in _field(logprobs, "tokens")]
        if any(v is None for v in values):
            raise BackendReplyError("vLLM returned a null token logprob; logprobs=0 must be honoured")
        return Segment(tokens=list(ids), logprobs=[float(v) for v in values], versions=None,
                       stop_reason=_VLLM_FINISH[finish])

    @staticmethod
    def _token_id(token: str) -> int:
        m = _TOKEN_ID.match(token)
        if m is None:
            raise BackendReplyError(f"vLLM logprobs token {token!r} is not 'token_id:<id>'; "
                                    "is return_tokens_as_token_ids supported by this release?")
        return int(m.group(1))

    def health_call(self) -> HttpCall:
        return HttpCall("GET", "/health")

    def parse_health(self, body: Any) -> int | None:
        return None

    def pause_call(self) -> HttpCall:
        return HttpCall("POST", "/pause", params={"mode": "abort"})

    def resume_call(self) -> HttpCall:
        return HttpCall("POST", "/resume")

    def abort_call(self, rid: str) -> HttpCall | None:
        return HttpCall("POST", "/abort_requests", json={"request_ids": [rid]})

    def disk_update_call(self, path: str, version: int) -> HttpCall | None:
        return None


_SGLANG_FINISH = {"stop": StopReason.STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORT}


class SGLangBackend:
    """SGLang's native `POST /generate` with input_ids.

    Checked against sgl-project/sglang `python/sglang/srt/sampling/sampling_params.py`
    (max_new_tokens, min_new_tokens, stop, stop_token_ids, temperature 0 = greedy, top_k -1 =
    off, skip_special_tokens, no_stop_trim, sampling_seed), `managers/io_struct.py`
    (PauseGenerationReqInput mode abort|retract|in_place; UpdateWeightFromDiskReqInput model_path,
    weight_version, abort_all_requests), `managers/schedule_batch.py` (finish_reason
    {"type": "stop"|"length"|"abort", ...}) and `managers/tokenizer_manager.py` (meta_info
    output_token_logprobs as [logprob, token_id, text|null] triples; meta_info.weight_version).
    Assumptions:
    - /pause_generation {"mode": "abort"} returns in-flight requests with finish_reason type
      "abort" and their partial output; /continue_generation resumes.
    - meta_info.weight_version is the string this client sent with the last disk update; when it
      parses as an int it stamps the tokens, otherwise the client's known version is used.
    - sampling_seed exists only in newer releases; it is sent only when a seed is set.
    """

    name = "sglang"
    supports_tensor_push = False

    def __init__(self, model: str | None = None) -> None:
        self.model = model  # unused: /generate serves the one loaded model

    def generate_call(self, input_ids: list[int], gconfig: GenerationConfig, rid: str) -> HttpCall:
        g = gconfig
        params: dict[str, Any] = {
            "max_new_tokens": g.max_new_tokens, "min_new_tokens": g.min_new_tokens,
            "temperature": 0.0 if g.greedy else g.temperature, "top_p": g.top_p,
            "top_k": g.top_k if g.top_k > 0 else -1, "stop": list(g.stop),
            "stop_token_ids": list(g.stop_token_ids), "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if g.seed is not None:
            params["sampling_seed"] = g.seed
        body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True,
                "rid": rid, "stream": False}
        return HttpCall("POST", "/generate", json=body)

    def parse_generate(self, body: Any) -> Segment:
        meta = _field(body, "meta_info")
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else None
        if kind not in _SGLANG_FINISH:
            raise BackendReplyError(f"SGLang finish_reason {finish!r}; known types "
                                    f"{list(_SGLANG_FINISH)}")
        triples = _field(meta, "output_token_logprobs")
        ids = [int(t[1]) for t in triples]
        if "output_ids" in body and list(body["output_ids"]) != ids:
            raise BackendReplyError("SGLang output_ids differ from output_token_logprobs ids")
        version = meta.get("weight_version")
        stamped = [int(version)] * len(ids) if _is_int(version) else None
        return Segment(tokens=ids, logprobs=[float(t[0]) for t in triples], versions=stamped,
                       stop_reason=_SGLANG_FINISH[kind])

    def health_call(self) -> HttpCall:
        return HttpCall("GET", "/health")

    def parse_health(self, body: Any) -> int | None:
        return None

    def pause_call(self) -> HttpCall:
        return HttpCall("POST", "/pause_generation", json={"mode": "abort"})

    def resume_call(self) -> HttpCall:
        return HttpCall("POST", "/continue_generation", json={})

    def abort_call(self, rid: str) -> HttpCall | None:
        return HttpCall("POST", "/abort_request", json={"rid": rid})

    def disk_update_call(self, path: str, version: int) -> HttpCall | None:
        return HttpCall("POST", "/update_weights_from_disk",
                        json={"model_path": path, "weight_version": str(version)})


def _is_int(value: Any) -> bool:
    if isinstance(value, int):
        return True
    return isinstance(value, str) and value.strip().lstrip("-").isdigit()


BACKENDS: dict[str, type] = {
    "asyncrl": AsyncrlBackend,
    "vllm": VLLMBackend,
    "sglang": SGLangBackend,
}


def make_backend(name: str, model: str | None = None) -> Backend:
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not known; choose one of {list(BACKENDS)}")
    return BACKENDS[name](model=model)
