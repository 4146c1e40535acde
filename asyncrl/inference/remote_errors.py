"""How the remote client classifies what went wrong: the server's fault (retry elsewhere), the
request's fault (a 4xx: retrying would not help), or every retry spent."""

from __future__ import annotations

from typing import Any

import httpx

from asyncrl.errors import UserError
from asyncrl.inference.backend_protocol import HttpCall, Segment
from asyncrl.inference.routing import ServerState


class RemoteEngineError(RuntimeError):
    """A request could not be served: every retry failed; the message names each server's state."""


class ServerCheckError(UserError):
    """A server failed a startup check (unreachable, wrong version, routes or logprobs mode); the
    message names each server and the fix. The CLI prints it as one line."""


class RemoteRequestError(ValueError):
    """A server rejected the request itself (4xx): retrying elsewhere would not help."""


class ServerFailure(Exception):
    """A call failed because of the server (connection, timeout, 5xx, 429): retry elsewhere."""

    def __init__(self, message: str, unhealthy: bool = True, timed_out: bool = False,
                 partial: Segment | None = None) -> None:
        super().__init__(message)
        self.unhealthy, self.timed_out = unhealthy, timed_out
        self.partial = partial  # tokens a stream delivered before it broke: they are kept


def reply_body(server: ServerState, call: HttpCall, resp: httpx.Response) -> Any:
    where = f"{server.address}{call.path}"
    if resp.status_code >= 500 or resp.status_code == 429:
        raise ServerFailure(f"{where} answered HTTP {resp.status_code}: {resp.text[:300]}",
                             unhealthy=resp.status_code != 429)
    if resp.status_code == 404 and call.missing_ok:
        return None
    if resp.status_code >= 400:
        raise RemoteRequestError(f"{where} rejected the request: HTTP {resp.status_code}: "
                                 f"{resp.text[:500]}")
    return json_or_text(resp) if resp.content else None


def json_or_text(resp: httpx.Response) -> Any:
    try:
        return resp.json()
    except ValueError:
        return resp.text
