"""Streaming weights over HTTP in buckets of bounded size.

The trainer packs named tensors into buckets of about `bucket_bytes` each (a tensor larger than a
bucket travels alone) and sends each as a safetensors blob; the server stages them and applies the
whole set with the new version in one engine command, so no token is ever sampled from a half-new
model. Staging costs one copy of the weights in host memory; that is the price of atomicity.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from asyncrl.models.export import without_tied_aliases


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in without_tied_aliases(named_tensors):
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
    if bucket:
        yield bucket


def encode_bucket(bucket: dict[str, torch.Tensor]) -> bytes:
    return st_save(bucket)


def decode_bucket(blob: bytes) -> dict[str, torch.Tensor]:
    try:
        return st_load(blob)
    except Exception as err:  # safetensors raises its own error types; report them as bad input
        raise ValueError(f"weight bucket is not a valid safetensors blob: {err}") from None


class WeightStaging:
    """Collects the buckets of one version; `take()` hands over the full set exactly once."""

    def __init__(self) -> None:
        self.version: int | None = None
        self.next_index = 0
        self.tensors: dict[str, torch.Tensor] = {}

    def add(self, version: int, index: int, blob: bytes) -> int:
        """Stage bucket `index` of `version`; bucket 0 starts a new set. Returns tensors staged."""
        if index == 0:
            self.version, self.next_index, self.tensors = version, 0, {}
        if version != self.version:
            raise ValueError(f"bucket for version={version} while staging version={self.version}; "
                             "start a new transfer with bucket=0")
        if index != self.next_index:
            raise ValueError(f"bucket={index} out of order; expected bucket={self.next_index}")
        self.tensors.update(decode_bucket(blob))
        self.next_index += 1
        return len(self.tensors)

    def take(self) -> tuple[int, dict[str, torch.Tensor]]:
        if self.version is None or not self.tensors:
            raise ValueError("no staged weights to apply; send buckets starting at bucket=0")
        version, tensors = self.version, self.tensors
        self.version, self.next_index, self.tensors = None, 0, {}
        return version, tensors


def push_weights_over_http(
    base_url: str, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
    bucket_bytes: int = 64 << 20, api_key: str | None = None, timeout: float = 300.0,
    lora_scale: float | None = None,
) -> dict:
    """Send weights to one server's `/update_weights/tensors` in buckets; applied on the last.
    `lora_scale`: the tensors are a PEFT adapter with this alpha / r, merged by the server."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    buckets = list(iter_buckets(named_tensors, bucket_bytes))
    reply: dict = {}
    with httpx.Client(base_url=base_url, headers=headers, timeout=timeout) as client:
        for i, bucket in enumerate(buckets):
            params = {"version": version, "bucket": i, "last": str(i == len(buckets) - 1).lower()}
            if lora_scale is not None:
                params["lora_scale"] = lora_scale
            resp = client.post("/update_weights/tensors", params=params,
                               content=encode_bucket(bucket),
                               headers={"Content-Type": "application/octet-stream"})
            if resp.status_code != 200:
                raise RuntimeError(f"weight push to {base_url} failed at bucket {i}: "
                                   f"HTTP {resp.status_code} {resp.text[:500]}")
            reply = resp.json()
    return reply
