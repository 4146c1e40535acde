"""Pushing new policy weights from the trainer to inference engines: one function per transport.

- `sync_in_process`: engines in this process (`AsyncLLMEngine` or anything with the
  `InferenceEngine.update_weights(meta, state_dict)` method) take the state dict directly.
- `sync_over_http`: each server gets the tensors in safetensors buckets (`/update_weights/tensors`);
  the server stages them and applies the whole set with the version in one engine command.
- `sync_via_disk`: the trainer writes a HF directory once, each server loads it (`/update_weights`);
  the only option when trainer and servers share a file system but not a fast network.
- `DistributedWeightSender` / `DistributedWeightReceiver`: a collective broadcast for GPU clusters.
  The trainer (rank 0) and every engine process (ranks 1..world_size-1) form their own process
  group, rendezvousing through a TCP store at master_addr:master_port; NCCL on GPUs, gloo on CPU.
  The group is built directly on the store (not `init_process_group`), so it is independent of the
  trainer's own FSDP/torchrun world and of whatever the engine runs.

Broadcast protocol: on joining, rank 0 publishes the tensor spec (names, shapes, dtypes, in a fixed
sorted order) in the store; every rank derives the same bucket plan from it (consecutive tensors of
one dtype, flattened into buffers of about `bucket_bytes`). One sync = a header [version, number of
tensors] then each bucket. A receiver stages every bucket before touching its engine, then applies
all weights together with the version in one engine call, so no token is sampled from a half-new
model. `DistributedWeightReceiver.receive_and_apply` is what an inference server would run when the
trainer announces a sync (that HTTP endpoint is not part of this module); the trainer calls
`DistributedWeightSender.broadcast` at the same time.
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import json
import shutil
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from asyncrl.api.weights import WeightUpdateKind, WeightUpdateMeta

SPEC_KEY = "weight_spec"


# ---- in-process, HTTP, disk --------------------------------------------------------------------

async def sync_in_process(
    engines: Sequence[Any], state_dict: Mapping[str, torch.Tensor], version: int
) -> None:
    """Every in-process engine loads `state_dict` and moves to `version` (concurrently)."""
    meta = WeightUpdateMeta.from_tensors(version)
    await asyncio.gather(*(e.update_weights(meta, state_dict=state_dict) for e in engines))


def sync_over_http(
    urls: Sequence[str], state_dict: Mapping[str, torch.Tensor], version: int,
    bucket_bytes: int = 64 << 20, api_key: str | None = None,
) -> list[dict]:
    """Stream the weights to each server in turn; returns each server's final reply."""
    from asyncrl.inference.weight_buckets import (
        push_weights_over_http,  # only this path needs it
    )

    meta = WeightUpdateMeta.from_tensors(version, bucket_bytes)  # validates version/bucket_bytes
    return [push_weights_over_http(url, named_tensors(state_dict), meta.version, meta.bucket_bytes,
                                   api_key=api_key) for url in urls]


def save_weights_dir(model: torch.nn.Module, out_dir: str | Path, tokenizer: Any = None) -> Path:
    """A HF directory the engines can load: with the tokenizer via `save_model_dir`."""
    if tokenizer is not None:
        from asyncrl.models.tiny import save_model_dir

        return save_model_dir(model, tokenizer, out_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


def save_state_dict_dir(state_dict: Mapping[str, torch.Tensor], hf_config: Any,
                        out_dir: str | Path, tokenizer: Any = None, untie: bool = False) -> Path:
    """A HF directory from full weights (e.g. gathered from FSDP shards): config.json,
    model.safetensors (tied tensors stored once), and the tokenizer when given.

    `untie`: a tied model is written with an output head of its own (a copy of the embeddings,
    config tie_word_embeddings=false), for servers that do not re-tie on a reload (vLLM)."""
    from safetensors.torch import save_file

    from asyncrl.inference.weight_buckets import without_tied_aliases

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().to("cpu").contiguous()
               for name, t in without_tied_aliases(state_dict.items())}
    if untie and getattr(hf_config, "tie_word_embeddings", False):
        hf_config = copy.deepcopy(hf_config)
        hf_config.tie_word_embeddings = False
        tensors["lm_head.weight"] = tensors[_embedding_name(tensors)].clone()
    hf_config.save_pretrained(out)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:  # loadable by transformers 4.x and 5.x alike, as the class it is
        from asyncrl.models.tokenizer import save_tokenizer

        save_tokenizer(tokenizer, out)
    return out


def _embedding_name(tensors: Mapping[str, torch.Tensor]) -> str:
    names = [n for n in tensors if n.endswith("embed_tokens.weight")]
    if len(names) != 1:
        raise ValueError(f"cannot untie the output head: expected one '*embed_tokens.weight' "
                         f"tensor, found {names}")
    return names[0]


def untied_copy(model_dir: str | Path, out_dir: str | Path) -> Path:
    """`model_dir` as it is when its config does not tie the output head to the embeddings;
    otherwise a copy under `out_dir` with an untied head (see `save_state_dict_dir`)."""
    import transformers
    from safetensors.torch import load_file

    src = Path(model_dir)
    config = transformers.AutoConfig.from_pretrained(src, local_files_only=True)
    if not getattr(config, "tie_word_embeddings", False):
        return src
    state: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    out = Path(out_dir)
    if out.exists():
        shutil.rmtree(out)
    for f in src.iterdir():  # tokenizer and generation config travel unchanged
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (
                "config.json", "model.safetensors.index.json"):
            out.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, out / f.name)
    return save_state_dict_dir(state, config, out, untie=True)


def sync_via_disk(
    urls: Sequence[str], model: torch.nn.Module, out_dir: str | Path, version: int,
    tokenizer: Any = None, api_key: str | None = None, timeout: float = 300.0,
) -> list[dict]:
    """Write the weights once under `out_dir`, then ask each server to load them."""
    import httpx

    path = save_weights_dir(model, out_dir, tokenizer)
    meta = WeightUpdateMeta.from_disk(str(path), version)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    replies = []
    for url in urls:
        resp = httpx.post(f"{url.rstrip('/')}/update_weights", headers=headers, timeout=timeout,
                          json={"path": meta.path, "version": meta.version})
        if resp.status_code != 200:
            raise RuntimeError(f"disk weight update of {url} to version {version} failed: "
                               f"HTTP {resp.status_code} {resp.text[:500]}")
        replies.append(resp.json())
    return replies


# ---- torch.distributed broadcast ---------------------------------------------------------------

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
        await engine.update_weights(WeightUpdateMeta.from_tensors(version), state_dict=weights)
        return version


def named_tensors(state_dict: Mapping[str, torch.Tensor]) -> Iterable[tuple[str, torch.Tensor]]:
    """The fixed (sorted) order as (name, tensor) pairs, for transports that stream."""
    return ((s.name, state_dict[s.name]) for s in spec_of(state_dict))
