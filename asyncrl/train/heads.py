"""What a train engine computes per token from its model's output: the output head it is composed
with. `LogprobHead` (policy, reference, SFT): the logprob of each next token at the sampler's
temperature, and its entropy on request. `ValueHead` (the critic, on a `critic.ValueModel`): the
value of the state before each token. The engine aligns either to the input tokens
(`packing.next_token_logprobs_aligned`), so index t describes token t.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

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


class ValueHead:
    prefix_kwargs: dict[str, Any] = {}

    def raw(self, out: torch.Tensor) -> torch.Tensor:
        return out  # ValueModel returns the values [B, T]

    def per_token(self, raw: torch.Tensor, next_ids: torch.Tensor, with_entropy: bool
                  ) -> list[torch.Tensor]:
        if with_entropy:
            raise ValueError("a critic has no token distribution; with_entropy is for policies")
        return [raw.float()]
