"""How new policy weights travel from the trainer to inference engines."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from asyncrl.api.validation import check_range


class WeightUpdateKind(str, Enum):
    DISK = "disk"  # safetensors / HF directory written by the trainer, read by the engine
    TENSORS = "tensors"  # in-process state dict, or tensors streamed over HTTP in buckets
    DISTRIBUTED = "distributed"  # collective broadcast (NCCL on GPUs, gloo on CPU)


@dataclass
class WeightUpdateMeta:
    kind: WeightUpdateKind
    version: int
    path: str | None = None  # DISK: directory holding the weights
    bucket_bytes: int = 64 << 20  # TENSORS over HTTP: size of one streamed bucket
    master_addr: str = "127.0.0.1"  # DISTRIBUTED: rendezvous of the trainer + engine group
    master_port: int = 0
    group_name: str = "asyncrl_weight_sync"
    world_size: int = 0
    backend: str = "nccl"

    def __post_init__(self) -> None:
        check_range("version", self.version, lo=0)
        check_range("bucket_bytes", self.bucket_bytes, lo=1)
        if self.kind == WeightUpdateKind.DISK and not self.path:
            raise ValueError("WeightUpdateMeta(kind=disk) needs `path`, the weights directory")
        if self.kind == WeightUpdateKind.DISTRIBUTED and self.world_size < 2:
            raise ValueError(
                f"WeightUpdateMeta(kind=distributed) world_size={self.world_size}; "
                "allowed >= 2 (trainer rank + at least one engine rank)"
            )

    @classmethod
    def from_disk(cls, path: str, version: int) -> WeightUpdateMeta:
        return cls(kind=WeightUpdateKind.DISK, version=version, path=path)

    @classmethod
    def from_tensors(cls, version: int, bucket_bytes: int = 64 << 20) -> WeightUpdateMeta:
        return cls(kind=WeightUpdateKind.TENSORS, version=version, bucket_bytes=bucket_bytes)
