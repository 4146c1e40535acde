"""`RemoteEngineConfig`: which servers the remote client drives, and how patiently."""

from __future__ import annotations

from typing import Literal

import pydantic

from asyncrl.config import Config


class RemoteEngineConfig(Config):
    addresses: list[str] = pydantic.Field(min_length=1)  # base URLs, e.g. http://10.0.0.5:8000
    # the servers' kind (their routes and reply shapes)
    backend: Literal["asyncrl", "vllm", "sglang"] = "asyncrl"
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
