"""Weights by collective broadcast (NCCL on GPUs, gloo on CPU): the trainer's rank 0 and every
engine rank of every server form a process group of their own and the weights travel over it
(`inference.weight_sync: nccl | gloo`).

The group: rank 0 is the trainer, ranks 1..world_size-1 are engine ranks, rendezvousing through
a TCP store at master_addr:master_port. It is built directly on the store (not
`init_process_group`), so it is independent of the trainer's own FSDP/torchrun world and of
whatever the engine runs.

Two layouts of one update, since servers receive differently:
- "buckets" (`asyncrl serve`): on forming the group rank 0 publishes the tensor spec (names,
  shapes, dtypes in sorted order, and the bucket size) in the store; every rank derives the same
  bucket plan from it (consecutive tensors of one dtype flattened into buffers of about
  `bucket_bytes`). One update = a header [version, number of tensors], then each bucket. A
  receiver stages every bucket before touching its engine, then applies all weights together
  with the version in one engine call, so no token is sampled from a half-new model.
- "per_tensor" (SGLang): one broadcast per tensor, in the order of the update call's names.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from asyncrl.api.weights import WeightUpdateKind, WeightUpdateMeta

log = logging.getLogger(__name__)

SPEC_KEY = "weight_spec"
LAYOUTS = ("buckets", "per_tensor")


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_spec(spec: Sequence[TensorSpec], bucket_bytes: int) -> bytes:
    return json.dumps({"bucket_bytes": bucket_bytes,
                       "tensors": [[s.name, list(s.shape), dtype_name(s.dtype)] for s in spec]}
                      ).encode()


def decode_spec(blob: bytes) -> tuple[list[TensorSpec], int]:
    """(the spec, the bucket size) rank 0 published."""
    data = json.loads(blob)
    spec = [TensorSpec(n, tuple(shape), getattr(torch, dt)) for n, shape, dt in data["tensors"]]
    return spec, int(data["bucket_bytes"])


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


def bucket_buffers(buckets: list[list[TensorSpec]], device: torch.device) -> list[torch.Tensor]:
    """One flat buffer per bucket, allocated once per group: every update reuses them, so no
    update pays for allocating and first touching the model's size again."""
    return [torch.empty(sum(s.numel for s in b), dtype=b[0].dtype, device=device)
            for b in buckets]


def _device_for(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" \
        else torch.device("cpu")


def check_group_meta(meta: WeightUpdateMeta, rank: int, port_zero_ok: bool = False) -> None:
    if meta.kind != WeightUpdateKind.DISTRIBUTED:
        raise ValueError(f"kind={meta.kind.value!r}; the broadcast path needs "
                         f"kind={WeightUpdateKind.DISTRIBUTED.value!r}")
    if not 0 <= rank < meta.world_size:
        raise ValueError(f"rank={rank} is out of range; allowed [0, {meta.world_size - 1}]")
    low = 0 if port_zero_ok else 1
    if not low <= meta.master_port <= 65535:
        raise ValueError(f"master_port={meta.master_port} is out of range; allowed "
                         f"[{low}, 65535]")
    makers = {"gloo": dist.ProcessGroupGloo, "nccl": getattr(dist, "ProcessGroupNCCL", None)}
    if makers.get(meta.backend) is None:
        raise ValueError(f"backend={meta.backend!r} is not available; allowed "
                         f"{[k for k, v in makers.items() if v is not None]}")
    if meta.backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs a CUDA device in this process; allowed here: "
                         "'gloo' (the same path on CPU)")


class _SyncGroup:
    """A standalone process group over a TCP store (no global `init_process_group`)."""

    def __init__(self, meta: WeightUpdateMeta, rank: int, timeout_s: float,
                 store: Any = None, device: torch.device | None = None) -> None:
        check_group_meta(meta, rank)
        self.meta, self.rank = meta, rank
        # nccl: the engine's own GPU (a server may not run on the current device)
        self.device = device if meta.backend == "nccl" and device is not None \
            else _device_for(meta.backend)
        timeout = datetime.timedelta(seconds=timeout_s)
        tcp = store or dist.TCPStore(meta.master_addr, meta.master_port, meta.world_size,
                                     is_master=rank == 0, timeout=timeout,
                                     wait_for_workers=False)
        # Built the way SGLang's `init_custom_process_group` builds its end (a prefix store
        # named after the group, then torch's group helper), so an SGLang server can join the
        # same group as `asyncrl serve` does (checked against sglang 0.5.23,
        # srt/utils/common.py). The helper is private torch API; SGLang, verl and AReaL use it.
        self.store = dist.PrefixStore(meta.group_name, tcp)
        self._tcp = tcp  # the prefix store does not keep its backing store alive on every build
        self.pg, _ = c10d._new_process_group_helper(
            meta.world_size, rank, [], dist.Backend(meta.backend), self.store,
            group_name=meta.group_name, timeout=timeout)
        c10d._world.pg_group_ranks[self.pg] = {i: i for i in range(meta.world_size)}

    def broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        """Release the communicator and the group's name (a new group may reuse it)."""
        try:
            dist.destroy_process_group(self.pg)
        except (RuntimeError, ValueError, KeyError) as err:  # already gone: nothing to free
            log.debug("destroying weight group %s: %s", self.meta.group_name, err)


class DistributedWeightSender:
    """Trainer side (rank 0). Construct once per group; `broadcast` once per new version.

    `spec_from` (a state dict, e.g. `engine.model_state_dict()`) fixes the names, shapes and
    dtypes for the group's lifetime. The constructor opens the rendezvous store (with
    master_port 0 it picks a free port: `self.port`) and publishes the spec; `connect()` then
    blocks until every engine rank has joined (the engines are told `self.port` meanwhile).
    """

    def __init__(
        self, meta: WeightUpdateMeta, spec_from: Mapping[str, torch.Tensor],
        timeout_s: float = 300.0, connect: bool = True,
    ) -> None:
        check_group_meta(meta, 0, port_zero_ok=True)
        self.spec = spec_of(spec_from)
        self.buckets = plan_buckets(self.spec, meta.bucket_bytes)
        self.timeout_s = timeout_s
        self._tcp = dist.TCPStore(meta.master_addr, meta.master_port, meta.world_size,
                                  is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                                  wait_for_workers=False)
        self.port = self._tcp.port
        self.meta = dataclasses.replace(meta, master_port=self.port)
        dist.PrefixStore(meta.group_name, self._tcp).set(
            SPEC_KEY, encode_spec(self.spec, meta.bucket_bytes))
        self.group: _SyncGroup | None = None
        self._buffers: list[torch.Tensor] | None = None  # reused by every update
        if connect:
            self.connect()

    def connect(self) -> None:
        """Form the group: returns once every engine rank has joined."""
        self.group = _SyncGroup(self.meta, 0, self.timeout_s, store=self._tcp)

    def wire_tensors(self) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype name) of every tensor, in the order they are sent."""
        return [(s.name, s.shape, dtype_name(s.dtype)) for s in self.spec]

    def broadcast(self, state_dict: Mapping[str, torch.Tensor], version: int,
                  layout: str = "buckets") -> None:
        """Send every tensor of `state_dict` (must match the spec) as `version`."""
        if version < 0:
            raise ValueError(f"version={version} is out of range; allowed [0, inf)")
        if layout not in LAYOUTS:
            raise ValueError(f"layout={layout!r} is not known; allowed {list(LAYOUTS)}")
        if spec_of(state_dict) != self.spec:
            raise ValueError("state_dict names/shapes/dtypes differ from the group's spec; a "
                             "changed model needs a new group")
        g = self.group
        if g is None:
            raise RuntimeError("broadcast before connect(): the group has not formed")
        if layout == "per_tensor":
            for s in self.spec:
                g.broadcast(state_dict[s.name].detach().to(g.device, s.dtype).contiguous())
            return
        g.broadcast(torch.tensor([version, len(self.spec)], dtype=torch.long, device=g.device))
        self._buffers = self._buffers or bucket_buffers(self.buckets, g.device)
        for bucket, flat in zip(self.buckets, self._buffers):
            torch.cat([state_dict[s.name].detach().reshape(-1).to(g.device, s.dtype)
                       for s in bucket], out=flat)
            g.broadcast(flat)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()


class DistributedWeightReceiver:
    """Engine side (ranks 1..world_size-1): what `asyncrl serve` builds to join and receive.

    Reads the spec rank 0 published; `receive()` blocks until the trainer's next `broadcast`.
    """

    def __init__(self, meta: WeightUpdateMeta, rank: int, timeout_s: float = 300.0,
                 device: torch.device | None = None) -> None:
        """`device`: where received tensors land with nccl (the engine's GPU)."""
        if rank == 0:
            raise ValueError("rank=0 is the trainer's; allowed engine ranks [1, world_size - 1]")
        self.group = _SyncGroup(meta, rank, timeout_s, device=device)
        self.spec, bucket_bytes = decode_spec(self.group.store.get(SPEC_KEY))
        self.buckets = plan_buckets(self.spec, bucket_bytes)
        self._buffers = bucket_buffers(self.buckets, self.group.device)

    def receive(self) -> tuple[int, dict[str, torch.Tensor]]:
        """(version, every tensor by name), all staged before anything is applied. The tensors
        are views of buffers the next `receive` overwrites: apply (copy) them before that."""
        g = self.group
        header = torch.zeros(2, dtype=torch.long, device=g.device)
        g.broadcast(header)
        version, count = (int(x) for x in header.tolist())
        if count != len(self.spec):
            raise RuntimeError(f"trainer sent {count} tensors, the group spec has "
                               f"{len(self.spec)}; sender and receiver are out of step")
        out: dict[str, torch.Tensor] = {}
        for bucket, flat in zip(self.buckets, self._buffers):
            g.broadcast(flat)
            for s, part in zip(bucket, torch.split(flat, [s.numel for s in bucket])):
                out[s.name] = part.view(s.shape)
        return version, out

    def close(self) -> None:
        self.group.close()
