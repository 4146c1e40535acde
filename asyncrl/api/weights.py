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
    # The DISK `path` (or the TENSORS payload) is a PEFT LoRA adapter, not full weights:
    # adapter_config.json + adapter_model.safetensors as `PeftModel.save_pretrained` writes them
    # (TENSORS: those tensors, named as `get_peft_model_state_dict` names them). The engine
    # applies it to the base model it was started from (models/lora.py).
    lora: bool = False
    lora_scale: float | None = None  # TENSORS + lora: alpha / r (a DISK adapter's config has it)
    # lora: how many adapter versions a server keeps loaded for the requests in flight
    # (max_head_offpolicyness + 1); a server that merges the adapter into its weights ignores it
    keep_versions: int = 1

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
        check_range("keep_versions", self.keep_versions, lo=1)
        if self.lora and self.kind == WeightUpdateKind.DISTRIBUTED:
            raise ValueError("WeightUpdateMeta(lora=True) kind=distributed is not supported; "
                             "allowed kinds for an adapter: disk, tensors")
        if self.lora and self.kind == WeightUpdateKind.TENSORS and not self.lora_scale:
            raise ValueError(f"WeightUpdateMeta(lora=True, kind=tensors) lora_scale="
                             f"{self.lora_scale}; the adapter's alpha / r (> 0) is needed")

    @classmethod
    def from_disk(cls, path: str, version: int) -> WeightUpdateMeta:
        return cls(kind=WeightUpdateKind.DISK, version=version, path=path)

    @classmethod
    def from_tensors(cls, version: int, bucket_bytes: int = 64 << 20) -> WeightUpdateMeta:
        return cls(kind=WeightUpdateKind.TENSORS, version=version, bucket_bytes=bucket_bytes)

    @classmethod
    def lora_from_disk(cls, path: str, version: int, keep_versions: int = 1) -> WeightUpdateMeta:
        return cls(kind=WeightUpdateKind.DISK, version=version, path=path, lora=True,
                   keep_versions=keep_versions)

    @classmethod
    def lora_from_tensors(cls, version: int, scale: float, bucket_bytes: int = 64 << 20,
                          keep_versions: int = 1) -> WeightUpdateMeta:
        return cls(kind=WeightUpdateKind.TENSORS, version=version, bucket_bytes=bucket_bytes,
                   lora=True, lora_scale=scale, keep_versions=keep_versions)
