"""The run's timeline: RUN/events.jsonl, one JSON object per line, appended and flushed.

Each event: `time` (unix seconds), `step` (the training step it happened at), `kind` (an
`EventKind`), `message` (one line a person reads) and fields of its kind (an evaluation's score,
a checkpoint's path, what a resume restored). The loop emits starts, resumes, evaluations,
checkpoints and the stop; `RunEvents.capture()` turns the package's log warnings into events too
(a server that failed or moved, a weight push that failed on a server, a watchdog warning), so
code below the launch layer needs no handle on this file. A resumed run appends: the timeline
keeps what happened before the restart, and the resume event says from where it went on.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

EVENTS_FILE = "events.jsonl"


class EventKind(str, enum.Enum):
    START = "start"
    RESUME = "resume"
    EVAL = "eval"
    CHECKPOINT = "checkpoint"
    WATCHDOG = "watchdog"  # a watchdog warning: the run is heading for one of its limits
    SERVER = "server"  # an inference server failed a request, moved, or failed an update
    WARNING = "warning"  # any other warning the package logged
    STOP = "stop"
    ERROR = "error"


def kind_of_record(record: logging.LogRecord) -> EventKind:
    """Which kind of event a log record of the package is, by the module that logged it."""
    if record.name.startswith("asyncrl.inference"):
        return EventKind.SERVER
    if record.name.startswith("asyncrl.launch.watchdog"):
        return EventKind.WATCHDOG
    return EventKind.WARNING


class _Capture(logging.Handler):
    def __init__(self, events: RunEvents) -> None:
        super().__init__(logging.WARNING)
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.events.emit(kind_of_record(record), record.getMessage(), logger=record.name)
        except Exception:  # a timeline entry must never break the run that logged it
            self.handleError(record)


class RunEvents:
    """Owns RUN/events.jsonl. Thread-safe: warnings arrive from the rollout thread too."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / EVENTS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.step = 0  # the loop sets it as steps finish; events carry it
        self._lock = threading.Lock()
        self._file: IO[str] | None = open(self.path, "a")

    def emit(self, kind: EventKind, message: str, **fields: Any) -> None:
        event = {"time": time.time(), "step": self.step, "kind": EventKind(kind).value,
                 "message": message, **fields}
        line = json.dumps(event, default=str) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self._file.flush()

    @contextlib.contextmanager
    def capture(self, logger: str = "asyncrl") -> Iterator[None]:
        """While open, warnings logged under `logger` become events."""
        target = logging.getLogger(logger)
        handlers: list[logging.Handler] = [_Capture(self)]
        if not logging.getLogger().handlers and logging.lastResort is not None:
            # nothing configured logging: keep printing warnings to stderr, as Python's last
            # resort did before this handler made the hierarchy non-empty
            handlers.append(logging.lastResort)
        for h in handlers:
            target.addHandler(h)
        try:
            yield
        finally:
            for h in handlers:
                target.removeHandler(h)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def __enter__(self) -> RunEvents:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
