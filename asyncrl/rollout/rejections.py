"""Episodes that end without a trajectory: counted, explained, and logged without flooding.

A run whose every episode is rejected (an agent that always raises, a filter that drops every
group) must not write a warning per episode: it once wrote 1.3 million in 94 s. `RejectionLog`
logs the first episode of each kind of reason in full (with its traceback), then at most one
summary per `interval_s` with the counts since the previous one. It also counts the episodes
rejected in a row since the last accepted one and keeps the latest reason, which is what a
"no progress" stop shows (launch/watchdog.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable


class RejectionLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.interval_s, self.clock = logger, interval_s, clock
        self._lock = threading.Lock()
        self.consecutive = 0  # rejected or failed in a row since the last accepted episode
        self.last_reason: str | None = None
        self._seen: set[str] = set()  # reason kinds logged in full once
        self._since_summary: Counter[str] = Counter()
        self._last_summary = clock()

    def accepted(self) -> None:
        with self._lock:
            self.consecutive = 0

    def rejected(self, kind: str, reason: str, exc_info: BaseException | None = None) -> None:
        """`kind`: a short, stable label (e.g. the exception type); `reason`: the whole story."""
        with self._lock:
            self.consecutive += 1
            self.last_reason = reason
            first = kind not in self._seen
            self._seen.add(kind)
            if not first:
                self._since_summary[kind] += 1
            now = self.clock()
            summary = None
            if self._since_summary and now - self._last_summary >= self.interval_s:
                summary = ", ".join(f"{n} x {k}" for k, n in self._since_summary.most_common())
                self._since_summary.clear()
                self._last_summary = now
        if first:
            self.logger.warning("%s (later episodes rejected for %s are summarised every %gs)",
                                reason, kind, self.interval_s, exc_info=exc_info)
        if summary is not None:
            self.logger.warning("episodes rejected since the previous summary: %s; latest: %s",
                                summary, reason)
