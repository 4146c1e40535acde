"""What a checkpoint keeps of the rollouts in flight (`WorkflowExecutor.suspend` makes it).

- `pending`: rows drawn from the data stream whose episodes had not started;
- `ready`: accepted trajectories the trainer had not consumed yet, with their start version;
- `suspended`: episodes interrupted mid-generation, each with its journal (rollout/journal.py:
  finished calls and the partial ones: token ids, logprobs, per-token versions).

Every episode keeps its `episode_id` across a restart, so a resumed run can account for each one:
consumed once, continued, or dropped for staleness (counted). A checkpoint pickles it with the
run's other plain state (only load checkpoints you wrote).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncrl.api import Trajectory
from asyncrl.rollout.journal import EpisodeJournal


@dataclass
class ReadyEpisode:
    episode_id: str
    data: dict[str, Any]
    start_version: int
    trajectory: Trajectory


@dataclass
class SuspendedEpisode:
    episode_id: str
    data: dict[str, Any]
    start_version: int
    journal: EpisodeJournal


@dataclass
class RolloutSnapshot:
    pending: list[tuple[str, dict[str, Any]]] = field(default_factory=list)  # (id, row)
    ready: list[ReadyEpisode] = field(default_factory=list)
    suspended: list[SuspendedEpisode] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        partial = sum(len(s.journal.partial) for s in self.suspended)
        return {"pending": len(self.pending), "ready": len(self.ready),
                "suspended": len(self.suspended), "partial_calls": partial,
                "suspended_tokens": sum(s.journal.tokens for s in self.suspended)}

    def __repr__(self) -> str:  # what a checkpoint's state.json says of it
        return f"RolloutSnapshot({self.counts()})"
