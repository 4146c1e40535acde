"""How many new episodes may start now without training data getting older than `eta` versions.

The trainer consumes `batch_size` accepted trajectories per policy version. At version v at most
(eta + v + 1) * batch_size trajectories may have been accepted or be running, so a trajectory that
starts now is consumed by version v + eta at the latest, if trajectories finish in start order.
They do not always (a long generation is overtaken by short ones), so the consumer also takes the
oldest-started first and drops any that have become staler than eta (`is_too_stale`), which makes
the bound hold unconditionally; the capacity rule keeps such drops rare. eta = 0 is synchronous RL.

A checkpoint keeps `state_dict()`: the trajectories consumed so far stay counted against the
budget on resume, so a resumed run admits exactly what an uninterrupted one would with nothing in
flight (without it the budget restarts at 0 while the version jumps, the capacity rule stays
inactive and only the drop at consume time keeps the bound, wasting generations).

Plain Python, no asyncio or torch: unit- and property-tested on its own.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StalenessStats:
    submitted: int = 0
    accepted: int = 0
    rejected: int = 0
    failed: int = 0
    stale_dropped: int = 0
    consumed: int = 0
    running: int = 0
    staleness_histogram: dict[int, int] = field(default_factory=dict)  # consumed: v - start_v


class StalenessManager:
    def __init__(self, max_concurrent: int, batch_size: int, eta: int) -> None:
        for name, value, lo in (("max_concurrent", max_concurrent, 1),
                                ("batch_size", batch_size, 1), ("eta", eta, 0)):
            if value < lo:
                raise ValueError(f"{name}={value} is out of range; allowed [{lo}, inf)")
        self.max_concurrent, self.batch_size, self.eta = max_concurrent, batch_size, eta
        self.stats = StalenessStats()
        # Accepted-not-yet-dropped plus running episodes: what counts against the staleness budget.
        self._budget_used = 0

    def capacity(self, version: int) -> int:
        """Episodes that may be started now at policy `version` (never negative)."""
        by_concurrency = self.max_concurrent - self.stats.running
        by_staleness = (self.eta + version + 1) * self.batch_size - self._budget_used
        return max(0, min(by_concurrency, by_staleness))

    def on_submit(self, admitted: bool = False) -> None:
        """`admitted`: a suspended episode continuing (already submitted and in the budget)."""
        self.stats.running += 1
        if not admitted:
            self.stats.submitted += 1
            self._budget_used += 1

    def on_accept(self) -> None:
        self.stats.running -= 1
        self.stats.accepted += 1

    def on_reject(self, failed: bool = False) -> None:
        self.stats.running -= 1
        self._budget_used -= 1
        if failed:
            self.stats.failed += 1
        else:
            self.stats.rejected += 1

    def is_too_stale(self, start_version: int, version: int) -> bool:
        return version - start_version > self.eta

    def on_stale_drop(self) -> None:
        """A ready trajectory will not be trained on (it is re-run): its budget is freed."""
        self.stats.stale_dropped += 1
        self._budget_used -= 1

    def on_suspend(self) -> None:
        """A running episode was suspended (or cancelled to run again): it leaves the budget
        until `restore` brings it back."""
        self.stats.running -= 1
        self._budget_used -= 1

    def take_out(self, n: int) -> None:
        """`n` ready or suspended episodes leave the executor for a checkpoint."""
        self._budget_used -= n

    def restore(self, n: int) -> None:
        """`n` ready or suspended episodes come back from a checkpoint: they count again."""
        self._budget_used += n

    def state_dict(self) -> dict[str, Any]:
        """The counters a resumed run continues from. Episodes running or ready now are not in
        it (they are in the executor's snapshot, put back with `restore`): the budget it restores
        is the consumed count."""
        stats = asdict(self.stats)
        stats.pop("running")
        stats["staleness_histogram"] = {str(k): v for k, v in stats["staleness_histogram"].items()}
        return stats

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.stats.running:
            raise RuntimeError(f"load_state_dict with {self.stats.running} episodes running; "
                               "restore before the first rollout starts")
        hist = {int(k): int(v) for k, v in state.get("staleness_histogram", {}).items()}
        fields = {k: int(v) for k, v in state.items() if k != "staleness_histogram"}
        self.stats = StalenessStats(**fields, staleness_histogram=hist)
        self._budget_used = self.stats.consumed

    def on_consume(self, start_version: int, version: int) -> None:
        self.stats.consumed += 1
        lag = version - start_version
        hist = self.stats.staleness_histogram
        hist[lag] = hist.get(lag, 0) + 1
