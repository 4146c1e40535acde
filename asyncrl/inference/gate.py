"""A pause gate shared by every event loop that uses one remote client.

`pause()` / `resume()` are synchronous and may run on the trainer's thread while requests wait on
the rollout executor's loop (or several loops), so an `asyncio.Event`, bound to one loop, does not
fit: waiters register their own loop's future and are woken with `call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import threading


class ResumeGate:
    """Open unless paused. Awaitable from any event loop, opened from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = True
        self._shut = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self.epoch = 0  # bumped by each close: a call that saw it change was (maybe) interrupted

    @property
    def is_open(self) -> bool:
        return self._open

    def close(self) -> None:
        with self._lock:
            self._open = False
            self.epoch += 1

    def open(self) -> None:
        with self._lock:
            self._open = True
            waiters, self._waiters = self._waiters, []
        _wake(waiters)

    def shutdown(self) -> None:
        with self._lock:
            self._shut = True
            waiters, self._waiters = self._waiters, []
        _wake(waiters)

    async def wait(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                if self._shut:
                    raise RuntimeError("RemoteInferenceEngine is closed")
                if self._open:
                    return
                fut = loop.create_future()
                self._waiters.append((loop, fut))
            await fut


def _wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]) -> None:
    for loop, fut in waiters:
        try:
            loop.call_soon_threadsafe(_set_done, fut)
        except RuntimeError:  # that loop is closed: nobody waits there any more
            pass


def _set_done(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
