"""The proxy's typed errors, each answered with its own HTTP status in OpenAI's error shape.

Only these (and ValueError for bad input) map to a 4xx: a KeyError or any other exception raised
inside a handler is a bug and answers 500, so a client never mistakes a bug for "not found".
"""

from __future__ import annotations


class AuthError(Exception):
    """Missing, wrong or expired key (HTTP 401)."""


class SessionEndedError(Exception):
    """The key is valid but its session has ended: no more requests with it (HTTP 403; not 409,
    which OpenAI's SDK retries, while an ended session never takes a request again)."""

    def __init__(self, sid: str) -> None:
        super().__init__(f"session {sid} has ended; its key accepts no more requests (the agent's "
                         "run is over; its reward may still be set)")


class NotFoundError(LookupError):
    """An unknown session or completion id (HTTP 404)."""


class CapacityError(Exception):
    """No room for another session now (HTTP 429)."""
