"""Weights by collective broadcast (NCCL on GPUs, gloo on CPU): the trainer's rank 0 and every
engine process form a process group of their own and the weights travel as flat buckets.

Not yet called by a training job: `inference.weight_sync` offers HTTP buckets and disk today, and
wiring this path to `asyncrl serve`, SGLang and vLLM is issue 17's work. It is kept (and tested
between two real processes with gloo) because that wiring builds on it.

The group: rank 0 is the trainer, ranks 1..world_size-1 are engine processes, rendezvousing
through a TCP store at master_addr:master_port. It is built directly on the store (not
`init_process_group`), so it is independent of the trainer's own FSDP/torchrun world and of
whatever the engine runs.

Protocol: on joining, rank 0 publishes the tensor spec (names, shapes, dtypes, in a fixed sorted
order) in the store; every rank derives the same bucket plan from it (consecutive tensors of one
dtype, flattened into buffers of about `bucket_bytes`). One sync = a header [version, number of
tensors] then each bucket. A receiver stages every bucket before touching its engine, then applies
all weights together with the version in one engine call, so no token is sampled from a half-new
model.
"""

from __future__ import annotations

import asyncio
import datetime
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.api.weights import WeightUpdateKind, WeightUpdateMeta

SPEC_KEY = "weight_spec"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def spec_of(state_dict: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The fixed order both sides use: sorted by name, so it never depends on dict order."""
    return [TensorSpec(n, tuple(state_dict[n].shape), state_dict[n].dtype)
            for n in sorted(state_dict)]


def encode_spec(spec: Sequence[TensorSpec]) -> bytes:
    return json.dumps([[s.name, list(s.shape), str(s.dtype).removeprefix("torch.")]
                       for s in spec]).encode()


def decode_spec(blob: bytes) -> list[TensorSpec]:
    return [TensorSpec(n, tuple(shape), getattr(torch, dt)) for n, shape, dt in json.loads(blob)]


def plan_buckets(spec: Sequence[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive same-dtype tensors up to ~bucket_bytes each (a larger tensor goes alone)."""
    buckets: list[list[TensorSpec]] = []
    size = 0
    for s in spec:
        if not buckets or buckets[-1][-1].dtype != s.dtype or size + s.nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(s)
        size += s.nbytes
    return buckets


def _device_for(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
        else torch.device("cpu")


class _SyncGroup:
    """A standalone process group over a TCP store (no global `init_process_group`)."""

    def __init__(self, meta: WeightUpdateMeta, rank: int, timeout_s: float) -> None:
        if meta.kind != WeightUpdateKind.DISTRIBUTED:
            raise ValueError(f"kind={meta.kind.value!r}; the broadcast path needs "
                             f"kind={WeightUpdateKind.DISTRIBUTED.value!r}")
        if not 0 <= rank < meta.world_size:
            raise ValueError(f"rank={rank} is out of range; allowed [0, {meta.world_size - 1}]")
        if not 1 <= meta.master_port <= 65535:
            raise ValueError(f"master_port={meta.master_port} is out of range; allowed [1, 65535]")
        makers = {"gloo": dist.ProcessGroupGloo, "nccl": getattr(dist, "ProcessGroupNCCL", None)}
        if makers.get(meta.backend) is None:
            raise ValueError(f"backend={meta.backend!r} is not available; allowed "
                             f"{[k for k, v in makers.items() if v is not None]}")
        self.meta, self.rank = meta, rank
        self.device = _device_for(meta.backend)
        timeout = datetime.timedelta(seconds=timeout_s)
        tcp = dist.TCPStore(meta.master_addr, meta.master_port, meta.world_size,
                            is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        # The prefix lets several groups (e.g. one per policy) share a rendezvous port.
        self.store = dist.PrefixStore(meta.group_name, tcp)
        self._tcp = tcp  # the prefix store does not keep its backing store alive on every build
        if meta.backend == "gloo":
            self.pg = dist.ProcessGroupGloo(self.store, rank, meta.world_size, timeout)
        else:
            self.pg = dist.ProcessGroupNCCL(self.store, rank, meta.world_size)

    def broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()


class DistributedWeightSender:
    """Trainer side (rank 0). Construct once per group; `broadcast` once per new version.

    `spec_from` (a state dict, e.g. `engine.model_state_dict()`) fixes the names, shapes and
    dtypes for the group's lifetime. Blocks until every engine rank has joined.
    """

    def __init__(
        self, meta: WeightUpdateMeta, spec_from: Mapping[str, torch.Tensor],
        timeout_s: float = 300.0,
    ) -> None:
        self.spec = spec_of(spec_from)
        self.buckets = plan_buckets(self.spec, meta.bucket_bytes)
        self.group = _SyncGroup(meta, 0, timeout_s)
        self.group.store.set(SPEC_KEY, encode_spec(self.spec))

    def broadcast(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Send every tensor of `state_dict` (must match the spec) as `version`."""
        if version < 0:
            raise ValueError(f"version={version} is out of range; allowed [0, inf)")
        if spec_of(state_dict) != self.spec:
            raise ValueError("state_dict names/shapes/dtypes differ from the group's spec; a "
                             "changed model needs a new group")
        g = self.group
        g.broadcast(torch.tensor([version, len(self.spec)], dtype=torch.long, device=g.device))
        for bucket in self.buckets:
            flat = torch.cat([state_dict[s.name].detach().reshape(-1).to(g.device, s.dtype)
                              for s in bucket])
            g.broadcast(flat)


class DistributedWeightReceiver:
    """Engine side (ranks 1..world_size-1): what an inference server calls to join and receive.

    Reads the spec rank 0 published; `receive()` blocks until the trainer's next `broadcast`.
    """

    def __init__(self, meta: WeightUpdateMeta, rank: int, timeout_s: float = 300.0) -> None:
        if rank == 0:
            raise ValueError("rank=0 is the trainer's; allowed engine ranks [1, world_size - 1]")
        self.group = _SyncGroup(meta, rank, timeout_s)
        self.spec = decode_spec(self.group.store.get(SPEC_KEY))  # waits for rank 0 to publish
        self.buckets = plan_buckets(self.spec, meta.bucket_bytes)

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, every tensor by name), all staged before anything is applied."""
        g = self.group
        header = torch.zeros(2, dtype=torch.long, device=g.device)
        g.broadcast(header)
        version, count = (int(x) for x in header.tolist())
        if count != len(self.spec):
            raise RuntimeError(f"trainer sent {count} tensors, the group spec has "
                               f"{len(self.spec)}; sender and receiver are out of step")
        out: dict[str, torch.Tensor] = {}
        for bucket in self.buckets:
            flat = torch.empty(sum(s.numel for s in bucket), dtype=bucket[0].dtype,
                               device=g.device)
            g.broadcast(flat)
            for s, part in zip(bucket, torch.split(flat, [s.numel for s in bucket])):
                out[s.name] = part.view(s.shape)
        return version, out

    def receive_and_apply(self, engine: Any) -> int:
        """Receive one sync and apply it to an `LLMEngine` on this thread; returns the version."""
        version, weights = self.receive()
        engine.update_weights_from_state_dict(weights, version)
        return version

    async def areceive_and_apply(self, engine: Any) -> int:
        """The same for an `AsyncLLMEngine`: the blocking receive runs on a worker thread, the
        swap is one engine command between two steps (generation continues while receiving)."""
        version, weights = await asyncio.to_thread(self.receive)
        await engine.update_weights(WeightUpdateMeta.from_tensors(version), weights)
        return version
