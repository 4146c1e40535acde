"""The train engine: a HF model, its optimizer, and packed micro-batched steps.

`HFTrainEngine` implements the `TrainEngine` protocol. It is composed rather than subclassed:
with a `Parallelism` (train/parallel.py: one process, or FSDP2 shards under torchrun) and an
`OutputHead` (train/heads.py: per-token logprobs for a policy, values for the critic), so the
policy, the reference, the critic and the SFT model are the same class built differently.

One step (`train_batch`) = pack the samples into micro-batches under a token budget, compute the
GLOBAL loss-token count once (all micro-batches, all ranks), run forward + backward per
micro-batch with that count as the loss normaliser, then clip, step the optimizer and the LR
schedule. Because every micro-batch divides by the same global count, the accumulated gradient is
exactly the gradient of one big batch, whatever the budget or the number of ranks.

`state_dict` / `load_state_dict` are what a checkpoint saves (train/checkpoint.py): the weights
and Adam state as this rank's shards (torch.distributed.checkpoint re-shards them on load), the
LR schedule, the step, the policy version and every rank's RNG states.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import pickle
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor

from asyncrl.api.trajectory import Sample
from asyncrl.api.version import PolicyVersion
from asyncrl.models.device import resolve_device
from asyncrl.models.kv_cache_arg import cache_kwargs
from asyncrl.train.aggregation import normalizer_count
from asyncrl.train.config import LoraConfig, TrainEngineConfig, lora_enabled
from asyncrl.train.heads import ChunkedLogprobHead, LogprobHead, OutputHead, split_output_head
from asyncrl.train.losses import sft_loss
from asyncrl.train.lora import adapter_state_dict, apply_lora, merged_state_dict
from asyncrl.train.optim import build_optimizer
from asyncrl.train.packing import (
    PackedMicroBatch,
    SharedPrefixLayout,
    TokenData,
    next_token_logprobs_aligned,
    pack_samples,
    padded_layout,
    plan_micro_batches,
    shared_prefix_layout,
    unpack,
)
from asyncrl.train.parallel import Parallelism, SingleProcess
from asyncrl.train.route_replay import (Mode, RouteReplay, fresh_rows, padded_routes,
                                        sparse_routers)
from asyncrl.train.varlen_attention import packed_kwargs, packed_rows, use_packed_attention

log = logging.getLogger(__name__)

# A micro-batch whose fp32 logits would exceed this gets the chunked logprob head (a 152k
# vocabulary: above ~440 positions); below, one matmul costs less than the chunks' recompute.
CHUNK_ABOVE_BYTES = 256 * 2**20


# Every RNG a training process draws from, as one saveable state: a checkpoint keeps each
# rank's; a rank it has none for (a resume on more ranks) is re-seeded from a hash of rank 0's
# saved state and its rank, so the same resume always re-seeds it the same way.
# `attention_layout: auto` on a CPU pads a micro-batch while that computes at most this many
# positions per real token: there a packed row costs one SDPA call per sample and padded rows
# one call for all, so little padding is cheaper than many calls (benchmarks/bench_train.py:
# the main job's batch, 1.09, is faster padded; samples of 16-512 tokens, 1.77, packed).
PAD_AT_MOST = 1.25


def sample_lengths(mb: PackedMicroBatch) -> list[int]:
    bounds = mb.cu_seqlens.tolist()
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def padded_positions(mb: PackedMicroBatch) -> int:
    """Positions its padded rows compute: samples x the longest."""
    lengths = sample_lengths(mb)
    return len(lengths) * max(lengths)


def auto_pads(lengths: Sequence[int]) -> bool:
    """`attention_layout: auto`'s choice on a CPU for a micro-batch of a text model's samples of
    these lengths: padded rows while that pads little (PAD_AT_MOST). On CUDA, where varlen
    kernels attend a packed row, auto packs; a vision-language model's rows are always padded."""
    return len(lengths) * max(lengths) <= PAD_AT_MOST * sum(lengths)


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def derived_seed(rank0_state: dict[str, Any], rank: int) -> int:
    """The seed of a rank the checkpoint has no RNG state for."""
    data = rank0_state["torch"].numpy().tobytes() + rank.to_bytes(8, "little")
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "little")


def reseed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # every CUDA device too

# loss_fn(per-token outputs [N] with grad, the packed micro-batch, normalizer) -> (loss, stats);
# the PPO actor adapts a `PolicyLoss` to it (ppo_actor.py), SFT and the critic use it directly
MicroBatchLossFn = Callable[
    [torch.Tensor, PackedMicroBatch, torch.Tensor], "tuple[torch.Tensor, dict[str, float]]"
]


def sft_token_loss(
    logprobs: torch.Tensor, mb: PackedMicroBatch, normalizer: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy on loss_mask tokens, in the micro-batch loss_fn signature."""
    return sft_loss(logprobs, mb.loss_mask, normalizer)


class HFTrainEngine:
    """Owns a model (policy, reference, critic) and, when trainable, its AdamW + LR schedule."""

    def __init__(self, model: torch.nn.Module, cfg: TrainEngineConfig | None = None, *,
                 total_steps: int = 1000, trainable: bool = True, lora: LoraConfig | None = None,
                 head: OutputHead | None = None, parallel: Parallelism | None = None,
                 routing: Mode | None = None) -> None:
        """`total_steps`: the LR schedule's horizon (optimizer steps). `trainable` False: a
        forward-only engine (the reference), no optimizer state. `lora`: only an adapter trains
        (train/lora.py). `head`: what a forward computes per token (default: logprobs at
        temperature 1). `parallel`: one process (default) or `fsdp.FSDP2`. `routing`: a
        mixture-of-experts policy replays (Mode.REPLAY) or only monitors (Mode.OBSERVE) the
        engine's routes its samples carry (route_replay.py); None: neither."""
        self.cfg = cfg or TrainEngineConfig()
        self.head = head or LogprobHead()
        self.parallel = parallel or SingleProcess()
        self.device = resolve_device(self.cfg.device)
        if self.cfg.gradient_checkpointing:
            # Non-reentrant checkpointing works with FSDP2 and with inputs that need no grad.
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.micro_batch_tokens = self.cfg.micro_batch_tokens(model.config, self.device)
        # always padded rows (else packed, or in auto chosen per micro-batch: `_pads`)
        self.padded = self.cfg.attention_layout == "padded" or (
            self.cfg.attention_layout == "auto"
            and getattr(model.config, "vision_config", None) is not None)
        if not self.padded:
            use_packed_attention(model)
        # auto also shares a micro-batch's prompts when that computes fewer positions than its
        # packed row (many samples of one prompt, short answers)
        self.share_prefixes = (self.cfg.attention_layout != "packed" and self.cfg.share_prefixes
                               and not self.cfg.gradient_checkpointing
                               and self.parallel.shares_prefixes)
        # a forward-only engine (the reference) is the base model: no adapter
        self.lora = lora if trainable and lora_enabled(lora) else None
        if self.lora is not None:
            model = apply_lora(model, self.lora)  # before sharding: FSDP shards A and B too
        self.model = self.parallel.prepare(model, self.cfg, self.device)
        # (only replay is refused for a model whose routers cannot be hooked; monitoring is off)
        self.routing = RouteReplay(self.model, routing) if routing == Mode.REPLAY or (
            routing is not None and sparse_routers(self.model)) else None
        # positions the model computed (padding included), against the real tokens of
        # `train_batch`'s micro-batches: its stat train/computed_per_real_token
        self.positions_computed = 0
        # the chunked logprob head and the trunk it runs, for micro-batches whose logits would
        # be large (`_head_for`); None: always the whole model and `head`
        self.trunk: torch.nn.Module | None = None
        self.chunked: ChunkedLogprobHead | None = None
        if (isinstance(self.head, LogprobHead) and self.cfg.logprob_chunk_tokens
                and self.parallel.splits_head):
            split = split_output_head(self.model)
            if isinstance(split, str):
                log.info("logprobs from full logits: %s", split)
            else:
                self.trunk = split[0]
                self.chunked = ChunkedLogprobHead(split[1], self.head.temperature,
                                                  self.cfg.logprob_chunk_tokens)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        if trainable:
            self.optimizer, self.scheduler = build_optimizer(
                self.model.parameters(), self.cfg.optimizer, total_steps)
        else:
            self.model.requires_grad_(False)
        self.step = 0  # optimizer steps taken; drives the LR schedule
        # the policy version of these weights: the owner of the run's version (api/version.py);
        # an optimizer step does not advance it, a policy update does (PPOActor.train_step)
        self.version = PolicyVersion()

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg: TrainEngineConfig | None = None,
                        dtype: str = "float32", trust_remote_code: bool = False,
                        **kwargs: Any) -> HFTrainEngine:
        from asyncrl.models.loading import load_causal_lm

        return cls(load_causal_lm(path, dtype, trust_remote_code), cfg, **kwargs)

    # --- weights ------------------------------------------------------------------------------
    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights with HF names, on rank 0 (with LoRA: the base merged with
        the adapter); collective under FSDP."""
        state = self.parallel.full_state_dict(self.model)
        return merged_state_dict(state, self.lora.scale) if self.lora is not None else state

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter (PEFT names), unsharded on every rank; collective under FSDP."""
        if self.lora is None:
            raise ValueError("adapter_state_dict on an engine without train.lora")
        return adapter_state_dict(self.model)

    def engine_weights(self) -> dict[str, torch.Tensor]:
        """What the inference engines are sent: the adapter with LoRA, else the full weights
        (collective under FSDP)."""
        return self.adapter_state_dict() if self.lora is not None else self.model_state_dict()

    # --- checkpoint ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's shards of the weights (and Adam state), and, pickled, the LR schedule,
        step, version and every rank's RNG states; every rank calls it (collective)."""
        if self.optimizer is None:
            state: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        else:
            # on a fresh optimizer this also materialises Adam's state, as a DCP load needs
            model, optim = get_state_dict(self.model, self.optimizer)
            state = {"model": model, "optim": optim}
        meta = {"scheduler": self.scheduler.state_dict() if self.scheduler else None,
                "step": self.step, "version": self.version.value,
                "rng": self.parallel.all_gather_object(rng_state())}
        state["meta"] = pickle.dumps(meta)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a `state_dict` (saved on any number of ranks). A rank the checkpoint has no
        RNG state for is re-seeded from rank 0's state and its rank (logged)."""
        if "optim" in state:
            set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])
        else:
            set_model_state_dict(self.model, state["model"])
        meta = pickle.loads(state["meta"])  # noqa: S301 (our own checkpoint)
        if meta["scheduler"] is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        self.step = meta["step"]
        self.version.set(meta["version"])
        rngs, rank, world = meta["rng"], self.parallel.rank, self.parallel.world_size
        if rank < len(rngs):
            set_rng_state(rngs[rank])
        else:
            reseed(derived_seed(rngs[0], rank))
        if len(rngs) != world and rank == 0:
            what = (f"ranks {len(rngs)}..{world - 1} re-seeded deterministically from rank 0's "
                    "saved state" if world > len(rngs)
                    else f"the states of ranks {world}..{len(rngs) - 1} are not used")
            log.warning("the checkpoint holds RNG states of %d ranks, this run has %d: %s",
                        len(rngs), world, what)

    # --- compute ----------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if not self.cfg.uses_bf16(self.device):
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def model_outputs(self, mb: PackedMicroBatch
                      ) -> tuple[torch.Tensor, torch.Tensor | None, OutputHead]:
        """The model's per-position output [N, ...] for a micro-batch, in `attention_layout`,
        which positions were computed (None: all; a shared prefix's are not, and are 0), and
        the head that reads them."""
        mb = mb.to(self.device)
        routes = mb.tensors.get("routes") if self.routing is not None else None
        fresh = (None if routes is None
                 else fresh_rows(mb.versions, mb.seq_id, self.version.value))
        if mb.has_images and not self.padded:
            raise ValueError("samples with images need train.attention_layout padded (or auto "
                             "on a vision-language model): a packed row has no per-sample "
                             "multimodal positions")
        with self._autocast():
            pads = self._pads(mb)
            # (replayed routes are per token: a shared prefix is computed once for many samples)
            shared = (shared_prefix_layout(mb) if self.share_prefixes and routes is None
                      else None)
            if shared is not None and (self.padded or shared.computed_tokens <= (
                    padded_positions(mb) if pads else mb.num_tokens)):
                return self._shared_prefix_outputs(mb, shared)
            if pads:
                ids, mask, index = padded_layout(mb)
                if self.routing is not None:
                    self.routing.use(*((None, None) if routes is None else (
                        padded_routes(routes, index, ids.numel()),
                        padded_routes(fresh, index, ids.numel()))))
                head = self._head_for(ids.numel())
                out = head.raw(self._run(head, attention_mask=mask, use_cache=False,
                                         **self._image_kwargs(mb, ids, index)))
                return out.flatten(0, 1)[index], None, head
            # One row; each sample attends to its own tokens (varlen_attention.py)
            if self.routing is not None:
                self.routing.use(routes, fresh)
            head = self._head_for(mb.num_tokens)
            with packed_rows():
                out = self._run(head, input_ids=mb.input_ids, position_ids=mb.position_ids,
                                use_cache=False, **packed_kwargs(mb.cu_seqlens))
            return head.raw(out)[0], None, head

    def _pads(self, mb: PackedMicroBatch) -> bool:
        """Whether this micro-batch runs as padded rows (`auto_pads` in auto on a CPU)."""
        if self.padded or self.cfg.attention_layout == "packed" or self.device.type == "cuda":
            return self.padded
        return auto_pads(sample_lengths(mb))

    def _head_for(self, positions: int) -> OutputHead:
        """The chunked head when this many positions' fp32 logits would exceed
        CHUNK_ABOVE_BYTES, else `head` (the full logits: below that, one matmul is cheaper than
        the chunks' recomputation); counts the positions."""
        self.positions_computed += positions
        if self.chunked is None:
            return self.head
        vocab = self.chunked.lm_head.weight.shape[0]
        return self.chunked if positions * vocab * 4 > CHUNK_ABOVE_BYTES else self.head

    def _run(self, head: OutputHead, **inputs: Any) -> Any:
        """The forward `head` reads: the trunk's (chunked logprobs) or the whole model's."""
        return (self.trunk if head is self.chunked else self.model)(**inputs)

    def _image_kwargs(self, mb: PackedMicroBatch, ids: torch.Tensor, index: torch.Tensor
                      ) -> dict[str, Any]:
        """A vision-language model's inputs for the padded rows `ids` of `mb` (`index`: each
        packed token's place in them): the images of its samples, in packing order, fill the
        image tokens that were not generated (versions < 0)."""
        if not mb.has_images:
            return {"input_ids": ids}
        from asyncrl.models.vision import vlm_forward_kwargs

        prompt = torch.zeros(ids.numel(), dtype=torch.bool, device=ids.device)
        prompt[index] = mb.versions < 0
        return vlm_forward_kwargs(self.model, ids, prompt.view_as(ids),
                                  [x for x in mb.images if x is not None])

    def _shared_prefix_outputs(self, mb: PackedMicroBatch, lay: SharedPrefixLayout
                               ) -> tuple[torch.Tensor, torch.Tensor, OutputHead]:
        from transformers import DynamicCache

        self.positions_computed += lay.prefix_ids.numel()
        head = self._head_for(lay.cont_ids.numel())
        cache = DynamicCache(config=self.model.config)
        self._run(head, input_ids=lay.prefix_ids, attention_mask=lay.prefix_mask,
                  use_cache=True, **cache_kwargs(self.model, cache), **head.prefix_kwargs)
        for layer in cache.layers:  # one cache row per continuation (autograd sums them back)
            layer.keys = layer.keys.index_select(0, lay.group)
            layer.values = layer.values.index_select(0, lay.group)
        out = head.raw(self._run(head, input_ids=lay.cont_ids, attention_mask=lay.cont_mask,
                                 position_ids=lay.cont_pos, use_cache=True,
                                 **cache_kwargs(self.model, cache)))
        values = out.flatten(0, 1)[lay.index]
        full = values.new_zeros((mb.num_tokens, *values.shape[1:]))
        full = full.index_put((lay.token_pos,), values)
        computed = torch.zeros(mb.num_tokens, dtype=torch.bool, device=full.device)
        computed[lay.token_pos] = True
        return full, computed, head

    def per_token(self, mb: PackedMicroBatch) -> torch.Tensor:
        """Input-aligned outputs [N] of one packed micro-batch (logprobs, or the critic's
        values; grad follows the caller's mode); 0 at the first token of each sample and inside
        a shared prefix (never trained on)."""
        return self._token_outputs(mb, with_entropy=False)[0]

    def _token_outputs(self, mb: PackedMicroBatch, with_entropy: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Input-aligned outputs [N] and, when asked, the entropy [N] of the distribution each
        token was drawn from (same temperature), both with grad."""
        mb = mb.to(self.device)
        raw, computed, head = self.model_outputs(mb)
        outs = head.per_token(raw, torch.roll(mb.input_ids[0], -1), with_entropy)
        if computed is not None:
            outs = [x.masked_fill(~computed, 0.0) for x in outs]
        aligned = [next_token_logprobs_aligned(x, mb) for x in outs]
        return aligned[0], aligned[1] if with_entropy else None

    def _plan(
        self, samples: Sequence[Sample], token_data: TokenData | None
    ) -> tuple[list[PackedMicroBatch], int]:
        """This rank's micro-batches and the count every rank runs (for lock-step collectives)."""
        groups = plan_micro_batches(samples, self.parallel.local_indices(samples),
                                    self.micro_batch_tokens, self.share_prefixes,
                                    agree=self.parallel.all_max)
        return [pack_samples(samples, g, token_data) for g in groups if g], len(groups)

    def _dummy_micro_batch(self) -> PackedMicroBatch:
        """One token, zero loss: keeps a rank with less data in step with the others' collectives."""
        dummy = Sample(input_ids=[0], loss_mask=[0], logprobs=[0.0], versions=[-1])
        return pack_samples([dummy], [0])

    @torch.no_grad()
    def forward(self, samples: Sequence[Sample]) -> list[torch.Tensor]:
        """Per-sample input-aligned outputs (float32, cpu), no gradients: logprobs (index t =
        log p(input_ids[t] | prefix), 0 at t = 0) for proximal and reference policies, or the
        critic's values."""
        self.model.eval()
        mbs, count = self._plan(samples, None)
        local: dict[int, torch.Tensor] = {}
        for k in range(count):
            mb = mbs[k] if k < len(mbs) else self._dummy_micro_batch()
            values = self.per_token(mb).float().cpu()
            if k < len(mbs):
                local.update(zip(mb.sample_index, unpack(values, mb)))
        return self.parallel.gather_outputs(local, len(samples))

    def train_batch(
        self,
        samples: Sequence[Sample],
        loss_fn: MicroBatchLossFn,
        token_data: TokenData | None = None,
        normalize_by: str = "tokens",
        with_entropy: bool = False,
    ) -> dict[str, float]:
        """One optimizer step over `samples`; `token_data` adds input-aligned per-token fields
        (advantages, proximal_logprobs, ...) to the tensors `loss_fn` receives.

        `normalize_by`: the step's normaliser counts trained "tokens" or "sequences" (those
        with >= 1 trained token), over every micro-batch and rank. `with_entropy`: the
        micro-batch also carries `tensors["entropy"]` [N] with grad."""
        if self.optimizer is None:
            raise ValueError("train_batch on a forward-only engine (trainable=False); "
                             "set trainable=True to train this model")
        if not samples:
            raise ValueError("train_batch needs at least one sample; got an empty batch")
        if normalize_by not in ("tokens", "sequences"):
            raise ValueError(f"normalize_by={normalize_by!r}; allowed: tokens, sequences")
        self.model.train()
        mbs, count = self._plan(samples, token_data)
        tokens = self._global_count(mbs, "tokens")
        normalizer = tokens if normalize_by == "tokens" else self._global_count(mbs, normalize_by)
        self.optimizer.zero_grad(set_to_none=True)
        total_loss = torch.zeros((), device=self.device)
        weighted: dict[str, float] = {}
        self.positions_computed = 0
        for k in range(count):
            if k >= len(mbs):
                self.per_token(self._dummy_micro_batch()).sum().mul(0.0).backward()
                continue
            mb = mbs[k].to(self.device)
            logprobs, entropy = self._token_outputs(mb, with_entropy)
            if entropy is not None:
                mb.tensors["entropy"] = entropy
            loss, stats = loss_fn(logprobs, mb, normalizer)
            loss.backward()
            total_loss += loss.detach()
            w = float(mb.loss_mask.sum()) / float(tokens)  # stats: token-weighted means
            for name, value in stats.items():
                weighted[name] = weighted.get(name, 0.0) + w * value
        stats = self._finish_step(total_loss, weighted, tokens, count)
        stats["train/computed_per_real_token"] = self.positions_computed / max(
            1, sum(mb.num_tokens for mb in mbs))
        return stats

    def _global_count(self, mbs: list[PackedMicroBatch], unit: str) -> torch.Tensor:
        """Trained tokens, or sequences with a trained token, over this step on every rank."""
        local = torch.zeros((), dtype=torch.float32)
        for mb in mbs:
            local += normalizer_count(mb.loss_mask, unit, mb.seq_id)
        return self.parallel.all_sum(local.to(self.device)).clamp(min=1)

    def _finish_step(
        self, total_loss: torch.Tensor, stats: dict[str, float], normalizer: torch.Tensor, n_mb: int
    ) -> dict[str, float]:
        """Clip, step optimizer and schedule, count the step; token-weighted stats out."""
        stats = self.parallel.reduce_stats(stats)
        clip = self.cfg.optimizer.grad_clip
        if clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
            stats["train/grad_norm"] = float(norm.full_tensor() if isinstance(norm, DTensor)
                                             else norm)
        stats["train/lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        stats["train/loss"] = float(self.parallel.all_sum(total_loss))
        stats["train/loss_tokens"] = float(normalizer)
        stats["train/micro_batches"] = float(n_mb)
        return stats
