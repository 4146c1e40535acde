"""Kinds of a user's own, registered from outside the package as a user would: a reward and an
inference backend. A run config names this module in `plugins:` and then the kinds by name
(tests/test_trainer_api.py trains with both)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, ClassVar, Literal

from asyncrl.config import Config
from asyncrl.inference.backend_protocol import BackendKind
from asyncrl.inference.backends import BACKENDS, AsyncrlBackend
from asyncrl.reward.config import REWARDS


@REWARDS.register
class DigitShareReward(Config):
    """The share of a completion's characters that are digits, times `weight`."""

    kind: Literal["digit_share"] = "digit_share"  # the reward
    weight: float = 1.0  # scales the share

    @contextlib.contextmanager
    def build(self, ctx: Any) -> Iterator[Any]:
        def reward(completion: str, row: dict) -> float:
            return self.weight * sum(c.isdigit() for c in completion) / max(1, len(completion))

        yield reward


class PollingBackend(AsyncrlBackend):
    """`asyncrl serve` asked without streaming: one reply per call (as SGLang is asked)."""

    name = "polling"
    supports_stream = False
    supports_tensor_push = False


@BACKENDS.register
class PollingBackendConfig(BackendKind):
    """`asyncrl serve` servers driven by PollingBackend; weights reach them as directories."""

    kind: Literal["polling"] = "polling"  # the backend
    weight_syncs: ClassVar[tuple[str, ...]] = ("disk",)
    lora: ClassVar[bool] = False
    untied_head: ClassVar[bool] = False
    tested: ClassVar[str] = "asyncrl serve of this release"
    images: ClassVar[bool] = False
    commands: ClassVar[list[list[str]]] = []  # what the job started (the test reads it)

    def build(self, model: str | None = None, lora: Any = None) -> PollingBackend:
        return PollingBackend(model)

    def check_lora(self, lora: Any) -> None:
        raise ValueError("the polling backend takes no LoRA adapters")

    def server_command(self, model_dir: str, launch: Any) -> Any:
        cmd = BACKENDS.parse("asyncrl").server_command(model_dir, launch)
        PollingBackendConfig.commands.append(cmd.argv)
        return cmd
