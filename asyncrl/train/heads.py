"""What a train engine computes per token from its model's output: the output head it is composed
with. `LogprobHead` (policy, reference, SFT): the logprob of each next token at the sampler's
temperature, and its entropy on request; `ChunkedLogprobHead` computes the same from the trunk's
last hidden states and the output matrix a chunk of tokens at a time (`split_output_head` says
whether a model allows it). `ValueHead` (the critic, on a `critic.ValueModel`): the
value of the state before each token. The engine aligns either to the input tokens
(`packing.next_token_logprobs_aligned`), so index t describes token t.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from asyncrl.train.chunked_logprobs import chunked_logprobs
from asyncrl.train.logprobs import gather_logprobs
from asyncrl.train.regularizers import entropy_from_logits


class OutputHead(Protocol):
    # extra arguments of the forward over a shared prompt, whose outputs are never used
    prefix_kwargs: dict[str, Any]

    def raw(self, out: Any) -> torch.Tensor:
        """The model output's per-position tensor [B, T, ...]."""

    def per_token(self, raw: torch.Tensor, next_ids: torch.Tensor, with_entropy: bool
                  ) -> list[torch.Tensor]:
        """[N] values per position (the first about `next_ids`), then the entropy [N] when
        `with_entropy`; with grad."""


class LogprobHead:
    prefix_kwargs = {"logits_to_keep": 1}  # a prefix's logits are never used

    def __init__(self, temperature: float = 1.0) -> None:
        # the sampler's: an unchanged policy then has importance ratio 1
        self.temperature = temperature

    def raw(self, out: Any) -> torch.Tensor:
        return out.logits

    def per_token(self, raw: torch.Tensor, next_ids: torch.Tensor, with_entropy: bool
                  ) -> list[torch.Tensor]:
        outs = [gather_logprobs(raw, next_ids, self.temperature)]
        if with_entropy:
            outs.append(entropy_from_logits(raw, self.temperature))
        return outs


class ChunkedLogprobHead:
    """`LogprobHead`'s values from the trunk's hidden states [N, D] and the output matrix, never
    holding the [N, vocab] logits (train/chunked_logprobs.py)."""

    prefix_kwargs: dict[str, Any] = {}  # the trunk computes no logits

    def __init__(self, lm_head: torch.nn.Linear, temperature: float, chunk: int) -> None:
        self.lm_head, self.temperature, self.chunk = lm_head, temperature, chunk

    def raw(self, out: Any) -> torch.Tensor:
        return out.last_hidden_state

    def per_token(self, raw: torch.Tensor, next_ids: torch.Tensor, with_entropy: bool
                  ) -> list[torch.Tensor]:
        lp, ent = chunked_logprobs(raw, self.lm_head.weight, next_ids, self.temperature,
                                   self.chunk, with_entropy)
        return [lp] if ent is None else [lp, ent]


# config fields that make a model's logits more than lm_head(hidden)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                     "output_multiplier_scale")


def split_output_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | str:
    """(trunk, output layer) of a causal LM whose logits are `lm_head(trunk(...).last_hidden_
    state)` exactly, or the reason it is not (the head then computes full logits). A PEFT model
    is split inside its wrapper (its LoRA layers sit in the trunk)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    trunk = getattr(inner, "model", None)
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if not isinstance(trunk, torch.nn.Module) or head is None:
        return f"{type(inner).__name__} has no trunk (.model) and output layer"
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return f"its output layer is a {type(head).__name__}, not a plain bias-free Linear"
    cfg = getattr(inner, "config", None)
    for name in _LOGIT_TRANSFORMS:
        for c in (cfg, getattr(cfg, "text_config", None)):
            value = getattr(c, name, None) if c is not None else None
            if value not in (None, 1, 1.0):
                return f"its config sets {name}={value}"
    return trunk, head


class ValueHead:
    prefix_kwargs: dict[str, Any] = {}

    def raw(self, out: torch.Tensor) -> torch.Tensor:
        return out  # ValueModel returns the values [B, T]

    def per_token(self, raw: torch.Tensor, next_ids: torch.Tensor, with_entropy: bool
                  ) -> list[torch.Tensor]:
        if with_entropy:
            raise ValueError("a critic has no token distribution; with_entropy is for policies")
        return [raw.float()]
