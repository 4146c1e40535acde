"""A run that cannot make progress stops, and says why; no wait of the loop is unbounded.

While the loop waits for a batch, `Watchdog.check` ends the run with `NoProgressError` when
- `max_rejected_in_a_row` episodes in a row were rejected, filtered or failed since the last
  accepted one (an agent that raises on every episode; groups whose rewards are all equal), or
- no training step happened for `step_deadline_s` (servers that never answer, a workflow that
  hangs).
The error names the rule, the numbers and the latest rejection's reason. The weight push
(pause, update, version check, resume, logprob check), each evaluation and the suspension of the
episodes for a checkpoint have their own time limits here; past one, the run ends with an error
naming the wait and the setting, never a silent hang.
"""

from __future__ import annotations

import logging
from typing import Any

import pydantic

from asyncrl.config import Config
from asyncrl.errors import UserError

log = logging.getLogger(__name__)


class WatchdogConfig(Config):
    # episodes rejected/filtered/failed since the last accepted one; 0: never stop for this
    max_rejected_in_a_row: int = pydantic.Field(1000, ge=0)
    # seconds without a training step while waiting for a batch; None: wait forever
    step_deadline_s: float | None = pydantic.Field(1800.0, gt=0)
    sync_timeout_s: float = pydantic.Field(600.0, gt=0)  # one weight push, checks included
    eval_timeout_s: float = pydantic.Field(3600.0, gt=0)  # one evaluation
    suspend_timeout_s: float = pydantic.Field(30.0, gt=0)  # episodes stopping for a checkpoint


class NoProgressError(UserError):
    """The run cannot form a batch (a user-facing condition: the CLI prints it as one line)."""


class WaitTimeoutError(UserError):
    """A wait of the loop ran past its limit."""


class Watchdog:
    def __init__(self, cfg: WatchdogConfig) -> None:
        self.cfg = cfg
        self._warned: set[tuple[int, str]] = set()  # (step, rule) already warned of

    def check(self, stats: dict[str, Any], waiting_s: float, step: int) -> None:
        """Raise NoProgressError if the executor's `stats` or the wait show no progress; log a
        warning (once per step and rule) when half of a limit is reached."""
        cfg, in_a_row = self.cfg, stats.get("rejected_in_a_row", 0)
        if cfg.max_rejected_in_a_row and in_a_row >= cfg.max_rejected_in_a_row / 2:
            self._warn(step, "max_rejected_in_a_row",
                       f"{in_a_row} episodes in a row rejected or failed after step {step}; the "
                       f"run stops at {cfg.max_rejected_in_a_row} (watchdog.max_rejected_in_a_row)"
                       f"; latest: {stats.get('last_rejection')}")
        if cfg.step_deadline_s is not None and waiting_s >= cfg.step_deadline_s / 2:
            self._warn(step, "step_deadline_s",
                       f"no training step for {waiting_s:.0f}s after step {step}; the run stops "
                       f"at {cfg.step_deadline_s:g}s (watchdog.step_deadline_s); rollouts: "
                       f"{_brief(stats)}")
        if cfg.max_rejected_in_a_row and in_a_row >= cfg.max_rejected_in_a_row:
            raise NoProgressError(
                f"no batch can be formed: {in_a_row} episodes in a row were rejected or failed "
                f"(watchdog.max_rejected_in_a_row={cfg.max_rejected_in_a_row}) after step {step}; "
                f"latest: {stats.get('last_rejection')}; rollouts: {_brief(stats)}")
        if cfg.step_deadline_s is not None and waiting_s >= cfg.step_deadline_s:
            raise NoProgressError(
                f"no training step for {waiting_s:.0f}s after step {step} "
                f"(watchdog.step_deadline_s={cfg.step_deadline_s:g}): the batch never filled; "
                f"latest rejection: {stats.get('last_rejection')}; rollouts: {_brief(stats)}")

    def _warn(self, step: int, rule: str, message: str) -> None:
        if (step, rule) not in self._warned:
            self._warned.add((step, rule))
            log.warning(message)

    @staticmethod
    def timed_out(what: str, setting: str, limit: float, detail: str = "") -> WaitTimeoutError:
        return WaitTimeoutError(f"{what} did not finish within {limit:g}s ({setting}); "
                                f"{detail}".rstrip("; "))


def _brief(stats: dict[str, Any]) -> str:
    keys = ("submitted", "accepted", "rejected", "failed", "running", "ready", "version")
    return ", ".join(f"{k} {stats[k]}" for k in keys if k in stats)
