"""The train engine under data parallelism with FSDP2 (`fully_shard`), launched by torchrun.

Each decoder layer and the root module are sharded, so a rank holds 1/world of the weights,
gradients and Adam state; gloo on CPU, NCCL on CUDA. With `autocast_dtype: bfloat16` the shards
stay fp32 and are gathered in bf16 (`mixed_precision`); `gradient_checkpointing` is HF's
non-reentrant checkpointing inside each sharded layer, which FSDP2 re-gathers for (its
pre-backward hook unshards before the recomputation). The batch is split across ranks balanced by
tokens, the loss normaliser is the all-reduced loss-token count, and gradients are SUMMED across
ranks (divide factor 1): with every micro-batch already divided by the global count, the sum is
the one-big-batch gradient, so one step on N ranks equals one step on one process.

FSDP runs collectives inside every forward and backward, so all ranks must run the same number of
micro-batches; the engine's plan agrees on the maximum (`all_max`) and a rank with less data runs
zero-loss dummy micro-batches. `FSDP2` is the engine's `Parallelism` (train/parallel.py).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from asyncrl.api.trajectory import Sample
from asyncrl.errors import UserError
from asyncrl.models.device import resolve_device
from asyncrl.train.config import TrainEngineConfig
from asyncrl.train.packing import balanced_partition


def init_distributed(device: str | None) -> str:
    """Join the torchrun process group (env:// rendezvous) unless already joined: NCCL with each
    local rank on its own GPU when the trainer's `device` (train.device; None: auto) is CUDA, else
    gloo. Returns the device type the group's collectives use."""
    on_cuda = resolve_device(device).type == "cuda"
    if not dist.is_initialized():
        local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if on_cuda and local >= count:
            raise UserError(f"trainer rank {local} of this node has no GPU of its own ({count} "
                            f"visible): start at most {count} per node (torchrun "
                            f"--nproc-per-node {count}), or train on the CPU over gloo with "
                            "train.device=cpu")
        if on_cuda:
            torch.cuda.set_device(local)
        dist.init_process_group("nccl" if on_cuda else "gloo")
    return "cuda" if on_cuda else "cpu"


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of a HF causal LM (Llama/Qwen2 layout: model.model.layers; a
    Qwen2-VL's language model: model.model.language_model.layers, the vision tower then goes
    with the root), also inside a PEFT wrapper."""
    if hasattr(model, "get_base_model"):  # PeftModel: its layers are the wrapped model's
        model = model.get_base_model()
    inner = getattr(model, "model", None)
    inner = getattr(inner, "language_model", inner)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers; FSDP wrapping needs the "
                         "decoder blocks of a Llama/Qwen2-style causal LM")
    return list(layers)


def mixed_precision(cfg: TrainEngineConfig, device: torch.device) -> MixedPrecisionPolicy:
    """bf16: all-gather and compute with bf16 weights, reduce-scatter gradients in fp32 into fp32
    shards, so master weights and Adam state stay fp32 as on one process (torchtitan's and verl's
    choice). The engine's autocast stays on as well (verl does the same): the ops autocast keeps
    in fp32 (softmax, norms, the loss) run in fp32 on both paths. The fp32 reduction is for
    precision, not for the backend: gloo reduce-scatters bf16 too (torch 2.13)."""
    if cfg.uses_bf16(device):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()  # everything in the model's own dtype


class FSDP2:
    """The `Parallelism` of torchrun ranks: FSDP2-sharded weights, gloo on CPU, NCCL on CUDA.
    Every rank calls every engine method, in the same order."""

    shares_prefixes = False  # a shared prompt's KV cache is invisible to FSDP2's backward hooks
    splits_head = False  # the root's hook gathers the embedding and the output matrix

    def __init__(self, device: str | None = None) -> None:
        """`device`: the trainer's (train.device; None: auto), which picks NCCL or gloo."""
        self.device_type = init_distributed(device)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()

    def prepare(self, model: torch.nn.Module, cfg: TrainEngineConfig,
                device: torch.device) -> torch.nn.Module:
        model = model.to(device)
        mesh = init_device_mesh(device.type, (self.world_size,))
        mp = mixed_precision(cfg, device)
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)  # root: embeddings, final norm, (tied) lm_head
        for module in model.modules():
            if isinstance(module, FSDPModule):
                # Sum, not average: losses are already divided by the global token count.
                module.set_gradient_divide_factor(1.0)
                # Plain SUM collectives: gloo has no PREMUL_SUM, and 1.0 needs no scaling anyway.
                module.set_force_sum_reduction_for_comms(True)
        return model

    def local_indices(self, samples: Sequence[Sample]) -> list[int]:
        parts = balanced_partition([len(s.input_ids) for s in samples], self.world_size)
        return parts[self.rank]

    def all_sum(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return x

    def all_max(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.long, device=self.device_type)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def gather_outputs(self, local: dict[int, torch.Tensor], n: int) -> list[torch.Tensor]:
        merged = {k: v for part in self.all_gather_object(local) for k, v in part.items()}
        return [merged[i] for i in range(n)]

    def reduce_stats(self, stats: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for part in self.all_gather_object(stats):
            for k, v in part.items():
                out[k] = out.get(k, 0.0) + v
        return out

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(model, options=opts)

    def all_gather_object(self, obj: Any) -> list[Any]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Tear the process group down: gloo's threads left running at interpreter exit abort
        the process ("terminate called without an active exception")."""
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
