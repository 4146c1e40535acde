"""The inference package's settings: the built-in engine's (`EngineSettings`, also the servers a
job starts) and the remote client's (`RemoteEngineConfig`: which servers, how patiently). Plain
pydantic, no torch: a run config loads without importing the engines."""

from __future__ import annotations

from typing import Literal

import pydantic

from asyncrl.config import Config
from asyncrl.models.device import check_device_spec


class EngineSettings(Config):
    """How the built-in engine runs, whatever model it serves: `asyncrl serve`'s `engine.*`,
    a training job's `inference.engine` (in process, and for the servers it starts)."""

    max_num_seqs: int = pydantic.Field(64, ge=1)  # KV cache slots = concurrently running sequences
    max_seq_len: int | None = pydantic.Field(None, ge=2)  # context length; None: the model's
    # Memory cap for the KV cache; the slot count is min(max_num_seqs, budget // bytes per slot).
    kv_cache_bytes: int | None = pydantic.Field(None, ge=1)
    max_prefill_tokens: int = pydantic.Field(8192, ge=1)  # padded tokens in one prefill step
    # auto: cuda when torch sees a GPU, else cpu; "cuda" without one fails at engine construction
    device: str = "auto"
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"  # auto: float32 on CPU, bf16 on CUDA
    # CUDA with kv_cache_bytes unset: the engine may take this fraction of the GPU memory free
    # at its construction for its weights plus KV cache (slots = min(max_num_seqs, what fits)).
    # Below vLLM's usual 0.9 because an in-process engine shares the GPU with the trainer, whose
    # optimizer state and activations grow after the engine is built.
    gpu_memory_fraction: float = pydantic.Field(0.4, gt=0, le=1)
    backend: Literal["auto", "native", "hf"] = "auto"  # auto: native if the arch is supported
    # the model's own code (HF auto_map) may run: the hf backend of a custom architecture,
    # and vLLM/SGLang servers get --trust-remote-code (a job sets it from model.trust_remote_code)
    trust_remote_code: bool = False
    fast_matmuls: bool = True  # native on CPU: prepacked weights with fused epilogues
    # native on CPU: C++ attention, RMSNorm and (fp32, with fast_matmuls) matmuls, compiled on
    # first use; the torch / oneDNN path when they cannot be built
    cpu_kernels: bool = True
    # native on CUDA: decode steps have bucketed shapes and replay one CUDA graph per (batch,
    # length) bucket, captured on first use (prefill and sampling run eagerly); off: eager steps
    cuda_graphs: bool = True
    # native text models: launch the next decode step before the last one's tokens reach the
    # host (its inputs are those tokens, still on the device); versions are stamped at launch
    # and a weight update waits for the step in flight. None: on CUDA, where launches are
    # asynchronous (on a CPU a step's work is done when it returns: nothing to overlap).
    overlap_steps: bool | None = None
    seed: int = 0  # sampling noise of requests without their own seed
    # a mixture-of-experts model served natively: every response carries the experts each
    # sparse layer chose for each of its tokens (ModelResponse.routes), for rollout routing
    # replay and the route monitor (a job sets it for a mixture-of-experts policy in process);
    # refused for a dense model. Decode steps are not overlapped while it is on.
    record_routes: bool = False
    ignore_eos: bool = False  # benchmarks: generate exactly max_new_tokens
    # Threads of the C++ kernels, set for the engine thread only (a trainer in the same process
    # keeps its own count); torch ops use the process-wide count, which `asyncrl serve` sets to
    # this. None: torch's count.
    num_threads: int | None = pydantic.Field(None, ge=1)

    _known_device = pydantic.field_validator("device")(check_device_spec)



class RemoteEngineConfig(Config):
    addresses: list[str] = pydantic.Field(min_length=1)  # base URLs, e.g. http://10.0.0.5:8000
    model: str | None = None  # vLLM: the served model name, when the server needs one
    # how requests are spread over the servers
    routing: Literal["round_robin", "least_loaded"] = "round_robin"
    request_timeout_s: float = pydantic.Field(600.0, gt=0)  # one generation call
    connect_timeout_s: float = pydantic.Field(5.0, gt=0)  # TCP connect timeout of one call
    control_timeout_s: float = pydantic.Field(300.0, gt=0)  # pause/resume/weight updates
    max_retries: int = pydantic.Field(5, ge=0)  # retries after consecutive failed calls
    # first retry delay of a failed call, doubled per retry
    backoff_base_s: float = pydantic.Field(0.2, ge=0)
    backoff_max_s: float = pydantic.Field(5.0, ge=0)  # longest retry delay
    health_check_interval_s: float = pydantic.Field(2.0, gt=0)  # between probes of a bad server
    # when no server is healthy (one briefly unreachable, a restart), how long a call to every
    # server (the weight canary) probes for one before it fails
    unavailable_wait_s: float = pydantic.Field(60.0, ge=0)
    max_interruptions: int = pydantic.Field(64, ge=0)  # then return the partial output (ABORT)
    # weight_sync nccl/gloo: ranks each server takes in the weight group (asyncrl serve: 1;
    # SGLang: its tensor-parallel size; vLLM servers report theirs)
    ranks_per_server: int = pydantic.Field(1, ge=1)
    api_key: str | None = None  # bearer token sent on every call (the servers' --api-key)
    # Servers outside the backend's tested version range are refused at startup unless this is set.
    allow_untested_server: bool = False
    max_connections: int = pydantic.Field(1024, ge=1)  # per event loop
    sticky_capacity: int = pydantic.Field(100_000, ge=0)  # request ids remembered for stickiness

    @pydantic.field_validator("addresses")
    @classmethod
    def _urls(cls, addresses: list[str]) -> list[str]:
        for a in addresses:
            if not a.startswith(("http://", "https://")):
                raise ValueError(f"addresses entry {a!r} must start with http:// or https://")
        return addresses

    @pydantic.model_validator(mode="after")
    def _backoff_order(self) -> RemoteEngineConfig:
        if self.backoff_max_s < self.backoff_base_s:
            raise ValueError(f"backoff_max_s={self.backoff_max_s} is out of range; allowed "
                             f">= backoff_base_s={self.backoff_base_s}")
        return self
