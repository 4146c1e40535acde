"""Trajectories: the unit of training data a rollout workflow hands to the trainer.

A `Sample` is one training sequence (prompt + generated tokens, possibly several turns). Token-level
lists are aligned with `input_ids`: `loss_mask` is 1 on tokens the policy generated and is trained
on, `logprobs` holds the behaviour policy's logprob of each generated token (0.0 elsewhere), and
`versions` the policy version that produced it (-1 for prompt/environment tokens). A `Trajectory`
is what one episode returns: one sample, a group of samples for the same prompt, or the turns of a
conversation exported individually.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from asyncrl.api.generation import StopReason
from asyncrl.api.images import ImageInputs

PROMPT_VERSION = -1


class RolloutStatus(str, Enum):
    """Outcome of one submitted episode in the rollout executor."""

    ACCEPTED = "accepted"
    REJECTED = "rejected"  # workflow returned None or the accept filter said no
    FAILED = "failed"  # workflow raised; traceback is logged


@dataclass
class Sample:
    """One training sequence: prompt and generated tokens, with per-token training data.

    `loss_mask`, `logprobs`, `versions` (and `token_rewards`, `routes` when set) are aligned with
    `input_ids`; a token trained on (`loss_mask` 1) carries the policy version that sampled it.
    `from_prompt_and_completion` builds one from a single generation.

    Raises:
        ValueError: a per-token list's length differs from `len(input_ids)`, or a token trained
            on has a version below 0.
    """

    input_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    versions: list[int]
    reward: float = 0.0
    token_rewards: list[float] | None = None
    stop_reason: StopReason = StopReason.STOP
    metadata: dict[str, Any] = field(default_factory=dict)
    images: ImageInputs | None = None  # the prompt's images (their pads are in input_ids)
    # a mixture-of-experts policy's routes (models/routes.py): int16 array [len(input_ids),
    # sparse layers, top_k], the experts the engine routed each token to (-1: not recorded);
    # the trainer replays them under actor.moe.routing_replay
    routes: Any = None

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        lens = {
            "loss_mask": len(self.loss_mask),
            "logprobs": len(self.logprobs),
            "versions": len(self.versions),
        }
        if self.token_rewards is not None:
            lens["token_rewards"] = len(self.token_rewards)
        if self.routes is not None:
            lens["routes"] = len(self.routes)
        bad = {k: v for k, v in lens.items() if v != n}
        if bad:
            raise ValueError(f"Sample fields must match len(input_ids)={n}; got {bad}")
        for i, (m, v) in enumerate(zip(self.loss_mask, self.versions)):
            if m and v < 0:
                raise ValueError(
                    f"Sample token {i} is trained on (loss_mask=1) but has version {v}; "
                    "generated tokens need the policy version that produced them (>= 0)"
                )

    @classmethod
    def from_prompt_and_completion(
        cls,
        prompt_ids: list[int],
        output_ids: list[int],
        output_logprobs: list[float],
        output_versions: list[int],
        reward: float = 0.0,
        stop_reason: StopReason = StopReason.STOP,
        metadata: dict[str, Any] | None = None,
        routes: Any = None,
    ) -> Sample:
        """`routes`: the response's (ModelResponse.routes), covering prompt and output."""
        p = len(prompt_ids)
        return cls(
            input_ids=list(prompt_ids) + list(output_ids),
            loss_mask=[0] * p + [1] * len(output_ids),
            logprobs=[0.0] * p + list(output_logprobs),
            versions=[PROMPT_VERSION] * p + list(output_versions),
            reward=reward,
            stop_reason=stop_reason,
            metadata=dict(metadata or {}),
            routes=routes,
        )

    @property
    def num_generated(self) -> int:
        """Returns the number of generated tokens: those with `loss_mask` 1 (trained on)."""
        return sum(self.loss_mask)

    @property
    def head_version(self) -> int:
        """Oldest policy version among generated tokens (-1 when nothing was generated)."""
        gen = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(gen) if gen else PROMPT_VERSION

    @property
    def tail_version(self) -> int:
        """Newest policy version among generated tokens (-1 when nothing was generated)."""
        gen = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return max(gen) if gen else PROMPT_VERSION

    @property
    def truncated(self) -> bool:
        """Returns True when generation stopped at a length limit (`StopReason.LENGTH`)."""
        return self.stop_reason == StopReason.LENGTH


@dataclass
class Trajectory:
    """Samples produced by one episode; samples sharing `group_id` form a GRPO group."""

    samples: list[Sample]
    group_id: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("Trajectory.samples is empty; return None from the workflow to reject")

    @property
    def rewards(self) -> list[float]:
        """Returns each sample's reward, in the order of `samples`."""
        return [s.reward for s in self.samples]

    @property
    def head_version(self) -> int:
        """Oldest policy version among the generated tokens of every sample (-1 when no sample
        has a generated token)."""
        versions = [s.head_version for s in self.samples if s.num_generated]
        return min(versions) if versions else PROMPT_VERSION

    def __len__(self) -> int:
        return len(self.samples)
