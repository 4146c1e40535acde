"""Signals between an episode and the executor that runs it.

`EpisodeSuspended` is raised out of `engine.agenerate` inside an episode when the executor
suspends every episode to checkpoint them (generation is interrupted; what was generated so far
is kept in the episode's journal and continued on resume). It derives from BaseException, like
`asyncio.CancelledError`, so an `except Exception` boundary in a workflow does not swallow it:
let it propagate.

`EpisodeRejected` is what a workflow may raise to reject an episode *with a reason*: the executor
counts it as rejected (not failed) and shows the reason when a run makes no progress.
"""

from __future__ import annotations


class EpisodeSuspended(BaseException):
    """The executor suspended this episode for a checkpoint; do not catch it."""


class EpisodeRejected(Exception):
    """Reject this episode (like returning None) and say why."""
