"""The train engine: a HF causal LM, its optimizer, and packed micro-batched steps.

`HFTrainEngine` implements the `TrainEngine` protocol on one process; `fsdp.FSDPTrainEngine` is
the same class with the model sharded and a few collectives filled in (the `_dist_*` hooks).

One step (`train_batch`) = pack the samples into micro-batches under a token budget, compute the
GLOBAL loss-token count once (all micro-batches, all ranks), run forward + backward per
micro-batch with that count as the loss normaliser, then clip, step the optimizer and the LR
schedule. Because every micro-batch divides by the same global count, the accumulated gradient is
exactly the gradient of one big batch, whatever the budget or the number of ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic
import torch

from asyncrl.api.trajectory import Sample
from asyncrl.api.version import PolicyVersion
from asyncrl.config import Config
from asyncrl.train.aggregation import normalizer_count
from asyncrl.train.logprobs import gather_logprobs
from asyncrl.train.regularizers import entropy_from_logits
from asyncrl.train.losses import sft_loss
from asyncrl.train.lora import (LoraConfig, adapter_state_dict, apply_lora, lora_enabled,
                                merged_state_dict)
from asyncrl.train.optim import OptimizerConfig, build_optimizer
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

# loss_fn(logprobs [N] with grad, the packed micro-batch, normalizer) -> (loss, stats); the PPO
# actor adapts a `PolicyLoss` to it (ppo_actor.py), SFT and the critic use it directly
MicroBatchLossFn = Callable[
    [torch.Tensor, PackedMicroBatch, torch.Tensor], "tuple[torch.Tensor, dict[str, float]]"
]


class TrainEngineConfig(Config):
    # micro-batch size in tokens (sequences are packed)
    max_tokens_per_mb: int = pydantic.Field(1024, ge=1)
    # How a micro-batch's samples reach the model. "packed": one row with restarting
    # position_ids (no padding; flash-attention derives varlen offsets from them, but SDPA and
    # eager attend it through a dense N x N block-diagonal mask). "padded": k right-padded rows
    # with an attention mask (k * L^2 attention, some padding). "auto": packed when the model
    # runs a flash-attention kernel, else padded.
    attention_layout: Literal["auto", "packed", "padded"] = "auto"
    # Padded layout: samples of a micro-batch with the same prompt (a GRPO group) run it once;
    # their continuations attend to it through a KV cache, gradients flow into it from all of
    # them. Same logprobs and gradients, 2.3x the tokens/s of "padded" on the main job (bench_train
    # --task grpo). Not used with
    # gradient checkpointing (which drops the cache), the packed layout, or FSDP.
    share_prefixes: bool = True
    optimizer: OptimizerConfig = OptimizerConfig()
    total_steps: int = pydantic.Field(1000, ge=1, description="horizon of the LR schedule")
    # bf16 autocast keeps fp32 master weights and optimizer state; "none" runs in model dtype.
    # Under FSDP bf16 also gathers the weights in bf16 (fsdp.mixed_precision).
    autocast_dtype: Literal["none", "bfloat16"] = "none"
    gradient_checkpointing: bool = False  # recompute activations in backward (less memory)
    # Must equal the sampling temperature, or the importance ratio of an unchanged policy != 1.
    temperature: float = pydantic.Field(1.0, gt=0.0)
    # False: forward-only engine (reference model), no optimizer state is allocated.
    trainable: bool = True
    device: str | None = pydantic.Field(None, description="None = cuda if available, else cpu")
    # LoRA (train/lora.py): None trains every weight; set, only the adapter trains and only the
    # adapter is pushed to the engines
    lora: LoraConfig | None = None


def sft_token_loss(
    logprobs: torch.Tensor, mb: PackedMicroBatch, normalizer: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy on loss_mask tokens, in the micro-batch loss_fn signature."""
    return sft_loss(logprobs, mb.loss_mask, normalizer)


class HFTrainEngine:
    """Owns a causal LM (policy or reference) and, when trainable, its AdamW + LR schedule."""

    def __init__(self, model: torch.nn.Module, cfg: TrainEngineConfig | None = None) -> None:
        self.cfg = cfg or TrainEngineConfig()
        default = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(self.cfg.device or default)
        if self.cfg.gradient_checkpointing:
            # Non-reentrant checkpointing works with FSDP2 and with inputs that need no grad.
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.padded = self.cfg.attention_layout == "padded" or (
            self.cfg.attention_layout == "auto"
            and "flash" not in str(getattr(model.config, "_attn_implementation", "")))
        self.share_prefixes = (self.padded and self.cfg.share_prefixes
                               and not self.cfg.gradient_checkpointing)
        # a forward-only engine (the reference) is the base model: no adapter
        self.lora = self.cfg.lora if self.cfg.trainable and lora_enabled(self.cfg.lora) else None
        if self.lora is not None:
            model = apply_lora(model, self.lora)  # before sharding: FSDP shards A and B too
        self.model = self._prepare_model(model)
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
        if self.cfg.trainable:
            self.optimizer, self.scheduler = build_optimizer(
                self.model.parameters(), self.cfg.optimizer, self.cfg.total_steps
            )
        else:
            self.model.requires_grad_(False)
        self.step = 0  # optimizer steps taken; drives the LR schedule
        # the policy version of these weights: the owner of the run's version (api/version.py);
        # an optimizer step does not advance it, a policy update does (PPOActor.train_step)
        self.version = PolicyVersion()

    @classmethod
    def from_pretrained(
        cls, path: str | Path, cfg: TrainEngineConfig | None = None, dtype: str = "float32",
        trust_remote_code: bool = False,
    ) -> HFTrainEngine:
        from asyncrl.models.loading import load_causal_lm

        return cls(load_causal_lm(path, dtype, trust_remote_code), cfg)

    # --- hooks a distributed subclass overrides -------------------------------------------
    world_size = 1
    rank = 0

    def _prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)

    def _dist_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _dist_max(self, x: int) -> int:
        return x

    def _local_indices(self, samples: Sequence[Sample]) -> list[int]:
        """Which of `samples` this rank trains on (all of them on one process)."""
        return list(range(len(samples)))

    def _gather_outputs(self, local: dict[int, torch.Tensor], n: int) -> list[torch.Tensor]:
        return [local[i] for i in range(n)]

    def _reduce_stats(self, stats: dict[str, float]) -> dict[str, float]:
        """Sum each rank's token-weighted stat contributions."""
        return stats

    def _clip_grad_norm(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    # --- TrainEngine protocol ---------------------------------------------------------------
    def save(self, path: str | Path, extra_state: dict[str, Any] | None = None,
             full_weights: bool = True) -> None:
        """Sharded training state (train/checkpoint.py), resumable on any world size;
        `full_weights` also writes model.safetensors (a collective gather under FSDP)."""
        from asyncrl.train.checkpoint import save_checkpoint

        save_checkpoint(self, path, extra_state, full_weights)

    def load(self, path: str | Path) -> dict[str, Any]:
        """Restore a `save` directory; returns its extra_state."""
        from asyncrl.train.checkpoint import load_checkpoint

        return load_checkpoint(self, path)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights with HF names; on one process simply the model's state
        dict (with LoRA: the base merged with the adapter)."""
        state = {k: v.detach() for k, v in self.model.state_dict().items()}
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

    # --- compute ----------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager:
        if self.cfg.autocast_dtype == "none":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)

    def model_outputs(self, mb: PackedMicroBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The model's per-token output [N, ...] for a micro-batch, in `attention_layout`, and
        which positions were computed (None: all; a shared prefix's are not, and are 0)."""
        mb = mb.to(self.device)
        with self._autocast():
            if self.padded:
                shared = shared_prefix_layout(mb) if self.share_prefixes else None
                if shared is not None:
                    return self._shared_prefix_outputs(mb, shared)
                ids, mask, index = padded_layout(mb)
                out = self._head(self.model(input_ids=ids, attention_mask=mask, use_cache=False))
                return out.flatten(0, 1)[index], None
            # No attention_mask and no cache: transformers then reads sample boundaries off the
            # restarting position_ids and builds a block-diagonal causal mask.
            out = self.model(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False)
            return self._head(out)[0], None

    def _shared_prefix_outputs(self, mb: PackedMicroBatch, lay: SharedPrefixLayout
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        self.model(input_ids=lay.prefix_ids, attention_mask=lay.prefix_mask,
                   past_key_values=cache, use_cache=True, **self._prefix_kwargs)
        for layer in cache.layers:  # one cache row per continuation (autograd sums them back)
            layer.keys = layer.keys.index_select(0, lay.group)
            layer.values = layer.values.index_select(0, lay.group)
        out = self._head(self.model(input_ids=lay.cont_ids, attention_mask=lay.cont_mask,
                                    position_ids=lay.cont_pos, past_key_values=cache,
                                    use_cache=True))
        values = out.flatten(0, 1)[lay.index]
        full = values.new_zeros((mb.num_tokens, *values.shape[1:]))
        full = full.index_put((lay.token_pos,), values)
        computed = torch.zeros(mb.num_tokens, dtype=torch.bool, device=full.device)
        computed[lay.token_pos] = True
        return full, computed

    _prefix_kwargs: dict[str, Any] = {"logits_to_keep": 1}  # a prefix's logits are never used

    def _head(self, out: Any) -> torch.Tensor:
        return out.logits

    def packed_logprobs(self, mb: PackedMicroBatch) -> torch.Tensor:
        """Input-aligned logprobs [N] of one packed micro-batch (grad follows the caller's mode);
        0 at the first token of each sample and inside a shared prefix (never trained on)."""
        return self._token_outputs(mb, with_entropy=False)[0]

    def _token_outputs(self, mb: PackedMicroBatch, with_entropy: bool
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Input-aligned logprobs [N] and, when asked, the entropy [N] of the distribution each
        token was drawn from (same temperature), both with grad."""
        mb = mb.to(self.device)
        logits, computed = self.model_outputs(mb)
        labels = torch.roll(mb.input_ids[0], -1)
        outs = [gather_logprobs(logits, labels, self.cfg.temperature)]
        if with_entropy:
            outs.append(entropy_from_logits(logits, self.cfg.temperature))
        if computed is not None:
            outs = [x.masked_fill(~computed, 0.0) for x in outs]
        aligned = [next_token_logprobs_aligned(x, mb) for x in outs]
        return aligned[0], aligned[1] if with_entropy else None

    def _plan(
        self, samples: Sequence[Sample], token_data: TokenData | None
    ) -> tuple[list[PackedMicroBatch], int]:
        """This rank's micro-batches and the count every rank runs (for lock-step collectives)."""
        groups = plan_micro_batches(samples, self._local_indices(samples),
                                    self.cfg.max_tokens_per_mb, self.share_prefixes,
                                    agree=self._dist_max)
        return [pack_samples(samples, g, token_data) for g in groups if g], len(groups)

    def _dummy_micro_batch(self) -> PackedMicroBatch:
        """One token, zero loss: keeps a rank with less data in step with the others' collectives."""
        dummy = Sample(input_ids=[0], loss_mask=[0], logprobs=[0.0], versions=[-1])
        return pack_samples([dummy], [0])

    @torch.no_grad()
    def forward(
        self, samples: Sequence[Sample], token_data: TokenData | None = None
    ) -> list[torch.Tensor]:
        """Per-sample input-aligned logprobs (float32, cpu): index t = log p(input_ids[t] | prefix),
        0 at t = 0. For proximal and reference logprobs; no gradients."""
        self.model.eval()
        mbs, count = self._plan(samples, None)
        local: dict[int, torch.Tensor] = {}
        for k in range(count):
            mb = mbs[k] if k < len(mbs) else self._dummy_micro_batch()
            values = self.packed_logprobs(mb).float().cpu()
            if k < len(mbs):
                local.update(zip(mb.sample_index, unpack(values, mb)))
        return self._gather_outputs(local, len(samples))

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
        for k in range(count):
            if k >= len(mbs):
                self.packed_logprobs(self._dummy_micro_batch()).sum().mul(0.0).backward()
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
        return self._finish_step(total_loss, weighted, tokens, count)

    def _global_count(self, mbs: list[PackedMicroBatch], unit: str) -> torch.Tensor:
        """Trained tokens, or sequences with a trained token, over this step on every rank."""
        local = torch.zeros((), dtype=torch.float32)
        for mb in mbs:
            local += normalizer_count(mb.loss_mask, unit, mb.seq_id)
        return self._dist_sum(local.to(self.device)).clamp(min=1)

    def _finish_step(
        self, total_loss: torch.Tensor, stats: dict[str, float], normalizer: torch.Tensor, n_mb: int
    ) -> dict[str, float]:
        """Clip, step optimizer and schedule, count the step; token-weighted stats out."""
        stats = self._reduce_stats(stats)
        clip = self.cfg.optimizer.grad_clip
        if clip is not None:
            stats["train/grad_norm"] = self._clip_grad_norm(clip)
        stats["train/lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        stats["train/loss"] = float(self._dist_sum(total_loss))
        stats["train/loss_tokens"] = float(normalizer)
        stats["train/micro_batches"] = float(n_mb)
        return stats
