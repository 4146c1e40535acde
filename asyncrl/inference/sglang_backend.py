"""The SGLang adapter: its native /generate and its weight, pause and abort routes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, Literal

from asyncrl.api import GenerationConfig, ImageInputs, StopReason
from asyncrl.inference.backend_protocol import (
    BackendKind,
    ModelQuery,
    NEUTRAL_SAMPLING,
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
    concrete_dtype,
    cuda_available,
    free_port,
    is_int,
    join_body,
    reply_field,
    version_verdict,
)

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
    `srt/managers/{io_struct,tokenizer_manager,scheduler}.py`, `srt/layers/sampler.py`) and run
    against live sglang 0.5.23 servers on the torch-native CPU path
    (tests/integration/test_sglang_server.py: logprobs, pause + disk and gloo updates, abort,
    a SIGKILLed server, `asyncrl train` and `asyncrl eval`). What it relies on:
    - Calls stream (`stream: true`): each event carries meta_info with the output so far
      (output_token_logprobs triples; only the new part with --incremental-streaming-output),
      placed by meta_info.completion_tokens, so a server that dies mid-call costs only the
      tokens it had not sent yet.
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
    - Weight updates from disk: /update_weights_from_disk (flush_cache defaults to true).
    - Weights by broadcast, read from the 0.5.23 wheel (`srt/entrypoints/http_server.py`,
      `srt/managers/{io_struct,tokenizer_control_mixin}.py`, `srt/managers/scheduler_components/
      weight_updater.py`, `srt/model_executor/model_runner_components/weight_updater.py`,
      `srt/utils/common.py` init_custom_process_group, `srt/weight_sync/tensor_bucket.py`):
      /init_weights_update_group makes each TP rank join as rank_offset + tp_rank (so a server
      takes tp_size ranks; dp_size must be 1, asserted; pipeline stages would reuse the same
      ranks) through torch's rendezvous at tcp://master:port (rank 0, the trainer, holds the
      TCPStore), a PrefixStore(group_name) over it, and torch's `_new_process_group_helper(...,
      group_name=group_name)`; backend "nccl" or "gloo". The trainer's end must be built the same
      way (the store keys carry both prefixes) or the rendezvous times out: tried once on CPU
      with gloo against that function taken from the wheel (not in the suite: no SGLang here);
      weight_group.DistributedWeightSender's store layout timed out, the same recipe formed the
      group and both layouts below arrived intact. In 0.5.23 an update must run inside
      /begin_weight_update ... /end_weight_update (without it: "must run between
      begin_weight_update() and end_weight_update()"); /update_weights_from_distributed then
      receives one broadcast per tensor in the order of `names` (`broadcast_layout`
      "per_tensor"; load_format "flattened_bucket" would instead take one uint8 broadcast of the
      tensors' bytes back to back), loads them, flushes the cache and sets `weight_version`
      (reported by /model_info). Replies are {"success", "message"}, HTTP 400 on failure. Older
      SGLang (sgl-project/sglang b2d53a07, scheduler_components/weight_updater.py) had no
      begin/end session and 404s /begin_weight_update.
    """

    name = "sglang"
    broadcast_layout = "per_tensor"
    supports_tensor_push = False
    supports_images = False
    supports_stream = True
    tested = ((0, 5, 23), (0, 6))

    def __init__(self, model: str | None = None) -> None:
        self.model = model  # unused: /generate serves the one loaded model

    def ranks_call(self) -> HttpCall | None:
        return None  # its tensor-parallel size comes from inference.remote.ranks_per_server

    def parse_ranks(self, body: Any) -> int:
        raise NotImplementedError("SGLang servers are not asked for their ranks")

    def generate_call(self, input_ids: list[int], gconfig: GenerationConfig, rid: str,
                      stream: bool = False, images: ImageInputs | None = None) -> HttpCall:
        if images is not None:
            raise ValueError(f"the {self.name} backend sends no images (supports_images=False)")
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
                "rid": _sglang_rid(rid), "stream": stream}
        return HttpCall("POST", "/generate", json=body)

    def parse_generate(self, body: Any) -> Segment:
        delta = self._reply(body, final=True)
        return Segment(tokens=delta.tokens, logprobs=delta.logprobs, versions=delta.versions,
                       stop_reason=delta.stop_reason)

    def parse_stream_event(self, event: Any) -> Delta:
        """One event of a streamed /generate: the output so far (or, on a server started with
        --incremental-streaming-output, the new part), placed by meta_info.completion_tokens."""
        if isinstance(event, dict) and "error" in event:
            raise BackendReplyError(f"SGLang stream error: {str(event['error'])[:300]}")
        return self._reply(event, final=False)

    @staticmethod
    def _reply(body: Any, final: bool) -> Delta:
        meta = reply_field(body, "meta_info")
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, dict) else None
        if kind not in _SGLANG_FINISH and (final or finish is not None):
            raise BackendReplyError(f"SGLang finish_reason {finish!r}; known types "
                                    f"{list(_SGLANG_FINISH)}")
        triples = reply_field(meta, "output_token_logprobs")
        ids = [int(t[1]) for t in triples]
        total = meta.get("completion_tokens", len(ids))
        if not is_int(total) or int(total) < len(ids):
            raise BackendReplyError(f"SGLang meta_info.completion_tokens={total!r} with "
                                    f"{len(ids)} output tokens")
        if final and "output_ids" in body and list(body["output_ids"]) != ids:
            raise BackendReplyError("SGLang output_ids differ from output_token_logprobs ids")
        version = meta.get("weight_version")
        stamped = [int(version)] * len(ids) if is_int(version) else None
        return Delta(ids, [float(t[0]) for t in triples], _SGLANG_FINISH.get(kind), stamped,
                     offset=int(total) - len(ids))

    def health_call(self) -> HttpCall:
        return HttpCall("GET", "/model_info")

    def parse_health(self, body: Any) -> int | None:
        version = body.get("weight_version") if isinstance(body, dict) else None
        if version in (None, "default"):
            return 0
        return int(version) if is_int(version) else None

    def pause_call(self) -> HttpCall:
        return HttpCall("POST", "/pause_generation", json={"mode": "abort"})

    def resume_call(self) -> HttpCall:
        return HttpCall("POST", "/continue_generation", json={})

    def abort_call(self, rid: str) -> HttpCall | None:
        return HttpCall("POST", "/abort_request", json={"rid": _sglang_rid(rid)})

    def disk_update_calls(self, path: str, version: int) -> list[HttpCall]:
        return [HttpCall("POST", "/update_weights_from_disk",
                         json={"model_path": path, "weight_version": str(version)})]

    def lora_update_calls(self, path: str, version: int, keep_versions: int) -> list[HttpCall]:
        # Not wired: SGLang's /load_lora_adapter serves an adapter only to requests that name it
        # (lora_path), which this backend's generate_call does not do, and it cannot be tested
        # on a CPU machine. Refused rather than guessed.
        raise ValueError("train.lora is not supported by backend='sglang' (its servers would "
                         "need per-request adapter names); allowed with LoRA: asyncrl, vllm")

    def join_group_call(self, join: GroupJoin) -> HttpCall:
        if join.backend not in ("nccl", "gloo"):
            raise ValueError(f"backend={join.backend!r} is not known; allowed 'nccl', 'gloo'")
        return HttpCall("POST", "/init_weights_update_group", json=join_body(join))

    def distributed_update_calls(self, join: GroupJoin, tensors: list[WireTensor],
                                 version: int) -> list[HttpCall]:
        """In order, each after the previous reply, while the trainer broadcasts every tensor
        of `tensors` in this order."""
        return [
            HttpCall("POST", "/begin_weight_update", json={}),
            HttpCall("POST", "/update_weights_from_distributed", json={
                "names": [t.name for t in tensors], "dtypes": [t.dtype for t in tensors],
                "shapes": [list(t.shape) for t in tensors], "group_name": join.group_name,
                "flush_cache": True, "weight_version": str(version)}),
            HttpCall("POST", "/end_weight_update", json={}),
        ]

    def failed_update_recovery_calls(self) -> list[HttpCall]:
        """A failed receive leaves the session open (the next /begin_weight_update would be
        refused) and the weights partly new: close it; only a full update restores them."""
        return [HttpCall("POST", "/end_weight_update", json={})]

    def server_checks(self) -> list[ServerCheck]:
        def route(path: str) -> ServerCheck:
            # a POST route asked with GET: 405 where it exists, 404 where it does not
            def verdict(status: int, body: Any) -> str | None:
                if status == 404:
                    return (f"has no {path} route, which RL with this backend needs; run a "
                            "tested SGLang release (0.5.23)")
                return None
            return ServerCheck(HttpCall("GET", path), verdict)

        return [ServerCheck(HttpCall("GET", "/server_info"),
                            version_verdict("SGLang", self.tested, "version"), waivable=True),
                *(route(path) for path in ("/pause_generation", "/continue_generation",
                                           "/abort_request", "/update_weights_from_disk"))]

    def model_query(self) -> ModelQuery:
        return ModelQuery(HttpCall("GET", "/get_model_info"), _model_path)


def _model_path(body: Any) -> str | None:
    return body.get("model_path") if isinstance(body, dict) else None


def _sglang_rid(rid: str) -> str:
    return f"{rid}~"


class SGLangBackendConfig(BackendKind):
    """`inference.backend: sglang`: a stock SGLang server (see SGLangBackend)."""

    kind: Literal["sglang"] = "sglang"  # the backend (BACKENDS: asyncrl | vllm | sglang | yours)
    weight_syncs: ClassVar[tuple[str, ...]] = ("disk", "nccl", "gloo")
    lora: ClassVar[bool] = False
    untied_head: ClassVar[bool] = False
    tested: ClassVar[str] = "SGLang 0.5.23 (CPU, torch-native; tests/integration)"
    images: ClassVar[bool] = False  # its servers take no images (yet)

    def build(self, model: str | None = None, lora: LoraServing | None = None,
              images: bool = False) -> SGLangBackend:
        return SGLangBackend(model=model)

    def check_lora(self, lora: LoraServing) -> None:
        raise ValueError("train.lora with backend 'sglang' is not supported")

    def server_command(self, model_dir: str, launch: ServerLaunch) -> ServerCommand:
        """`python -m sglang.launch_server` with the engine's batch size and dtype. On a machine
        without CUDA also what SGLang's torch-native CPU path needs: SGLANG_USE_CPU_ENGINE=1,
        OMP_NUM_THREADS (engine.num_threads, else 1: more threads slowed decoding to 6 tok/s
        here), a KV cache bounded by engine.kv_cache_bytes (default 1 GiB, as vLLM-CPU's;
        unbounded it took 12.9 GB) and --sleep-on-idle (else the idle scheduler spins a core)."""
        if launch.lora is not None:
            self.check_lora(launch.lora)
        engine, port = launch.engine, free_port(launch.host)
        argv = [launch.python, "-m", "sglang.launch_server", "--model-path", model_dir,
                "--host", launch.host, "--port", str(port), "--dtype",
                concrete_dtype(engine.dtype), "--max-running-requests", str(engine.max_num_seqs)]
        env: dict[str, str] = {}
        if launch.api_key:  # one token: a key that starts with "-" is not read as a flag
            argv.append(f"--api-key={launch.api_key}")
        if engine.trust_remote_code:
            argv.append("--trust-remote-code")
        if not cuda_available():
            env = {"SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": str(engine.num_threads or 1)}
            per_token = kv_bytes_per_token(model_dir, engine)
            if per_token:  # else not a local model directory: SGLang sizes the cache itself
                tokens = (engine.kv_cache_bytes or 1 << 30) // per_token
                argv += ["--max-total-tokens", str(max(tokens, 256))]
            argv.append("--sleep-on-idle")
        return ServerCommand(argv + list(launch.extra_args), env, port, host=launch.host)


def kv_bytes_per_token(model_dir: str, engine: Any) -> int | None:
    """K and V of one token over every layer, from the model's config.json (None without one)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    cfg = {**cfg, **(cfg.get("text_config") or {})}
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    itemsize = 2 if concrete_dtype(engine.dtype) == "bfloat16" else 4
    return 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * itemsize
