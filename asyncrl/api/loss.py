"""The loss seam: what a policy loss receives per micro-batch, and the protocol it implements.

The trainer computes everything step-specific once per batch (advantages, proximal and reference
logprobs), packs it with the samples into micro-batches, and calls the configured `PolicyLoss` on
each micro-batch with the logprobs under the parameters being trained. A user's loss implements
the same protocol as the built-in decoupled PPO loss (`asyncrl.train.losses.PPOLoss`) and is
chosen by `actor.loss` (a dotted path) or passed as an object to `Trainer.train(loss=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # keep `import asyncrl.api` free of torch
    import torch


@dataclass
class LossInputs:
    """Per-token tensors of one packed micro-batch, all [N] and input-aligned (index t describes
    token t; a sample's first token and its prompt are never trained on)."""

    loss_mask: torch.Tensor  # bool: train on this token (generated, and kept by the estimator)
    behaviour_logprobs: torch.Tensor  # the sampler's logprob of the token (0 off the mask)
    proximal_logprobs: torch.Tensor  # the proximal policy's (decoupled PPO); = behaviour if off
    advantages: torch.Tensor  # per-token advantage, computed once for the whole batch
    versions: torch.Tensor  # long: policy version that sampled the token (-1: prompt)
    seq_id: torch.Tensor  # long: which sample of the micro-batch (0..k-1) the token belongs to
    ref_logprobs: torch.Tensor | None = None  # the reference policy's, when a KL term needs it
    entropy: torch.Tensor | None = None  # per-token entropy with grad, when the loss asks for it
    policy_version: int = 0  # the version of the weights this batch's update started from


@runtime_checkable
class PolicyLoss(Protocol):
    """`loss(logprobs [N] with grad, inputs, normalizer) -> (loss, stats)`.

    Divide by `normalizer` (the global count of trained tokens over every micro-batch and rank)
    rather than by this micro-batch's count, so gradient accumulation equals one big batch.
    `stats` are floats for logging, averaged over micro-batches weighted by their tokens.
    `normalize_by`: what that count counts, "tokens" or "sequences" (those with a trained token).
    `needs_entropy`: True fills `inputs.entropy` (a softmax over the vocabulary per token).
    """

    normalize_by: str
    needs_entropy: bool

    def __call__(self, logprobs: torch.Tensor, inputs: LossInputs, normalizer: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, float]]: ...
