"""The policy version: one owner moves it, everyone else reads it.

A run has two: the trainer's engine owns the version of the weights it trains (`advance` once per
policy update, `set` on resume); the rollout side owns the version every engine serves (`set` once
a push has reached all of them), which trails the trainer's while a push is in flight. The rollout
executor subscribes to the served one, so its staleness capacity re-opens when new weights are
being served. An inference engine reports the version of the weights it holds
(`InferenceEngine.get_version`), set only by `update_weights(meta)` with `meta.version`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class PolicyVersion:
    def __init__(self, value: int = 0) -> None:
        self._check(value)
        self._value = value
        self._lock = threading.Lock()
        self._listeners: list[Callable[[int], None]] = []

    @staticmethod
    def _check(value: int) -> None:
        if value < 0:
            raise ValueError(f"version={value} is out of range; allowed [0, inf)")

    @property
    def value(self) -> int:
        return self._value

    def set(self, value: int) -> None:
        """Jump to `value` (a resumed checkpoint's version) and tell the subscribers."""
        self._check(value)
        with self._lock:
            self._value = value
            listeners = list(self._listeners)
        for fn in listeners:
            fn(value)

    def advance(self) -> int:
        """One policy update happened: version + 1 (returned)."""
        self.set(self._value + 1)
        return self._value

    def subscribe(self, fn: Callable[[int], None]) -> None:
        """`fn(new_version)` after every change, on the thread that made it."""
        with self._lock:
            self._listeners.append(fn)

    def unsubscribe(self, fn: Callable[[int], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    def __repr__(self) -> str:
        return f"PolicyVersion({self._value})"
