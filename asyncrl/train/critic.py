"""The critic for PPO with GAE: a causal LM's backbone plus a scalar value head, trained packed.

`ValueModel` keeps the transformer body of a HF causal LM (`lm.model`, Llama/Qwen2 layout) and
replaces the vocabulary head with a linear map hidden -> 1. The critic is an `HFTrainEngine` on
that model with a `heads.ValueHead` (`load_critic`): the same packing, micro-batching, global
loss-token normaliser, autocast, checkpointing and sharding as the policy, because the only thing
that differs is the per-token output of one packed micro-batch: a value instead of a logprob.

Values use the input-aligned convention of `Sample` and `gae_advantages`: index t holds
V(state before token t), i.e. the head applied to the hidden state at t - 1, and 0 at each
sample's first token (no state precedes it). That is exactly the shift of
`next_token_logprobs_aligned`, so values line up with the advantages and returns of token t and
nothing leaks across a packing boundary.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from asyncrl.api.trajectory import Sample
from asyncrl.train.engine import HFTrainEngine, MicroBatchLossFn
from asyncrl.models.kv_cache_arg import cache_kwargs
from asyncrl.train.heads import ValueHead
from asyncrl.train.config import CriticConfig
from asyncrl.train.losses import critic_value_loss
from asyncrl.train.packing import PackedMicroBatch
from asyncrl.train.parallel import Parallelism


class ValueModel(torch.nn.Module):
    """Backbone of a causal LM + linear value head: values [B, T] (head(h_t) at position t)."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        backbone = getattr(lm, "model", None)
        if backbone is None or not hasattr(backbone, "layers"):
            raise ValueError(f"{type(lm).__name__} has no model.layers; ValueModel needs a "
                             "Llama/Qwen2-style causal LM whose body is `lm.model`")
        # Named `model` so `fsdp.decoder_layers` finds `self.model.layers` as on the LM.
        self.model = backbone
        self.config = lm.config
        hidden = int(lm.config.hidden_size)
        self.value_head = torch.nn.Linear(hidden, 1, bias=True)
        # Small init keeps the first values near 0, far below typical returns in [-1, 1], so the
        # first PPO steps are not dominated by a random critic (the OpenRLHF/TRL choice).
        torch.nn.init.normal_(self.value_head.weight, std=1.0 / math.sqrt(hidden + 1))
        torch.nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(backbone.parameters()).dtype)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, use_cache: bool = False,
        cache: Any = None, **attention_kwargs: Any,
    ) -> torch.Tensor:
        """`attention_kwargs`: a packed row's boundaries (varlen_attention.packed_kwargs)."""
        out = self.model(input_ids=input_ids, position_ids=position_ids,
                         attention_mask=attention_mask, use_cache=use_cache,
                         **cache_kwargs(self.model, cache), **attention_kwargs)
        hidden = out.last_hidden_state
        # The head runs in its own (fp32 master) dtype; under autocast Linear casts anyway.
        return self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)


def critic_token_loss(value_eps_clip: float | None = 0.2) -> MicroBatchLossFn:
    """`critic_value_loss` in the micro-batch loss_fn signature.

    Reads token_data "returns" (required) and "old_values" (the critic at rollout time; without
    it the clip is centred on the current values, i.e. no clipping effect on this step).
    """

    def loss_fn(
        values: torch.Tensor, mb: PackedMicroBatch, normalizer: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        tensors = mb.tensors
        if "returns" not in tensors:
            raise ValueError("critic loss needs token_data['returns'] (GAE targets per token); "
                             f"got fields {sorted(tensors)}")
        old = tensors.get("old_values", values.detach())
        mask = mb.loss_mask
        if "adv_loss_mask" in tensors:  # tokens the advantage estimator dropped (truncation)
            mask = mask & tensors["adv_loss_mask"].bool()
        return critic_value_loss(values, old, tensors["returns"], mask,
                                 normalizer, value_eps_clip=value_eps_clip)

    return loss_fn


def values_and_end_values(critic: HFTrainEngine, samples: Sequence[Sample]
                          ) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The critic's input-aligned values of each sample and [N] V(state after its last token).

    One forward over each sample with a token appended: the value at the appended position is
    the head on the last real token's hidden state, whatever the token (attention is causal),
    and the values before it are the sample's own."""
    longer = [dataclasses.replace(s, input_ids=[*s.input_ids, s.input_ids[-1]],
                                  loss_mask=[*s.loss_mask, 0], logprobs=[*s.logprobs, 0.0],
                                  versions=[*s.versions, s.versions[-1]],
                                  token_rewards=None) for s in samples]
    values = critic.forward(longer)
    return [v[:-1] for v in values], torch.stack([v[-1] for v in values])


def load_critic(path: str | Path, cfg: CriticConfig, dtype: str, total_steps: int,
                parallel: Parallelism | None = None, trust_remote_code: bool = False
                ) -> HFTrainEngine:
    """A fresh value head on the body of `path`'s causal LM, trained by an engine like the
    policy's (spread over the ranks as `parallel` says)."""
    from asyncrl.models.loading import load_causal_lm

    return HFTrainEngine(ValueModel(load_causal_lm(path, dtype, trust_remote_code)), cfg,
                         total_steps=total_steps, head=ValueHead(), parallel=parallel)
