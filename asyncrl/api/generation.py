"""Generation requests and responses: what a workflow asks an inference engine for and gets back.

Everything here is plain data (stdlib only) so rollout code, servers and clients share one shape.
Every output token carries the logprob the engine sampled it with and the policy version that
produced it; a response interrupted by a weight update therefore holds tokens of several versions.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from asyncrl.api.images import ImageInputs
from asyncrl.api.validation import check_range

# Seeds a per-request torch.Generator takes; outside them seeding fails inside the engine's step.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class StopReason(str, Enum):
    """Why generation of one sequence ended."""

    STOP = "stop"  # an EOS / stop token id / stop string was produced
    LENGTH = "length"  # max_new_tokens or the context window was reached
    ABORT = "abort"  # interrupted (weight update, client abort); partial output is valid
    TOOL_CALLS = "tool_calls"  # the model emitted a complete tool call


@dataclass
class GenerationConfig:
    """Sampling parameters of one request (per sample when n_samples > 1)."""

    n_samples: int = 1  # samples per prompt (a GRPO group)
    max_new_tokens: int = 256  # generation limit in tokens
    min_new_tokens: int = 0  # stop tokens are masked until this many were generated
    temperature: float = 1.0  # sampling temperature (0: greedy)
    top_p: float = 1.0  # nucleus sampling mass; 1 keeps every token
    top_k: int = 0  # 0 disables top-k
    greedy: bool = False  # argmax decoding
    # generation ends at any of these (EOS is added by the workflows)
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings
    seed: int | None = None  # per-request sampling seed; None: the engine's generator

    # Lets pydantic-based component configs embed this dataclass with unknown keys rejected.
    __pydantic_config__ = {"extra": "forbid"}

    def __post_init__(self) -> None:
        check_range("n_samples", self.n_samples, lo=1)
        check_range("max_new_tokens", self.max_new_tokens, lo=1)
        check_range("min_new_tokens", self.min_new_tokens, lo=0, hi=self.max_new_tokens)
        check_range("temperature", self.temperature, lo=0.0)
        check_range("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        check_range("top_k", self.top_k, lo=0)
        if self.temperature == 0.0 and not self.greedy:
            # temperature 0 is the conventional spelling of greedy decoding (OpenAI API).
            self.greedy = True
        for tid in self.stop_token_ids:
            check_range("stop_token_ids[]", tid, lo=0)
        if self.seed is not None:
            check_range("seed", self.seed, lo=SEED_MIN, hi=SEED_MAX)

    def replace(self, **changes: Any) -> GenerationConfig:
        """Returns a copy with `changes` applied; this config is left as it is.

        Args:
            **changes: new values by field name, e.g. `replace(n_samples=1, seed=7)`.

        Raises:
            ValueError: a new value is out of range (the message names the field).
            TypeError: a name is not a field of GenerationConfig.
        """
        return dataclasses.replace(self, **changes)


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass
class ModelRequest:
    """One generation request: token ids in, one sequence out (n_samples is expanded by callers)."""

    input_ids: list[int]
    gconfig: GenerationConfig = field(default_factory=GenerationConfig)
    rid: str = field(default_factory=new_request_id)
    metadata: dict[str, Any] = field(default_factory=dict)
    images: ImageInputs | None = None  # the prompt's images (their pads are in input_ids)

    def __post_init__(self) -> None:
        if not self.input_ids:
            raise ValueError("ModelRequest.input_ids is empty: a prompt needs at least one token")


@dataclass
class ModelResponse:
    """The engine's answer to a ModelRequest, with exact per-token training data."""

    input_tokens: list[int]
    output_tokens: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    stop_reason: StopReason
    latency: float = 0.0  # seconds from submission to the last token
    ttft: float = 0.0  # seconds from submission to the first token
    rid: str = ""
    # a mixture-of-experts engine recording routes (models/routes.py): int16 array
    # [input_len + output_len, sparse layers, top_k], the experts each token was routed to
    routes: Any = None

    def __post_init__(self) -> None:
        n = len(self.output_tokens)
        if len(self.output_logprobs) != n or len(self.output_versions) != n:
            raise ValueError(
                "ModelResponse lengths differ: "
                f"output_tokens={n}, output_logprobs={len(self.output_logprobs)}, "
                f"output_versions={len(self.output_versions)}"
            )
        if self.routes is not None and len(self.routes) != len(self.input_tokens) + n:
            raise ValueError(f"ModelResponse routes cover {len(self.routes)} tokens; expected "
                             f"input + output = {len(self.input_tokens) + n}")

    @property
    def input_len(self) -> int:
        """Returns the number of prompt tokens (`len(input_tokens)`)."""
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        """Returns the number of generated tokens (`len(output_tokens)`)."""
        return len(self.output_tokens)
