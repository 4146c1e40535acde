"""The inference server's bearer key: every route but the read-only probes needs it.

With `api_key` set, generation (`/generate`, `/v1/*`), control and weight routes all need
`Authorization: Bearer <key>` or `x-api-key: <key>` (Anthropic clients' header) (vLLM's --api-key guards only `/v1`; here `/generate` generates too,
so it is guarded as well). Health, version, metrics and the API docs stay open so launchers and
monitoring need no secret. The key is checked before the body is read, in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from asyncrl.inference.http_errors import error_body

OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/openapi.json", "/docs",
                        "/docs/oauth2-redirect", "/redoc"})


class BearerKey:
    """`is_open(path)`: the paths that need no key (default: the probes above); `command`:
    the command whose --api-key the 401 names."""

    def __init__(self, app: ASGIApp, api_key: str | None,
                 is_open: Callable[[str], bool] = OPEN_PATHS.__contains__,
                 command: str = "asyncrl serve") -> None:
        self.app, self.is_open, self.command = app, is_open, command
        self.expected = api_key.encode() if api_key is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (self.expected is None or scope["type"] != "http"
                or self.is_open(scope["path"]) or self._authorized(scope)):
            return await self.app(scope, receive, send)
        resp = error_body(401, "missing or wrong API key: send Authorization: Bearer <api_key> "
                               f"or x-api-key: <api_key> (the key `{self.command} --api-key` "
                               "was started with)",
                          headers={"WWW-Authenticate": "Bearer"})
        await resp(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        headers = dict(scope["headers"])
        given = headers.get(b"x-api-key") or headers.get(b"authorization", b"").removeprefix(
            b"Bearer ")  # x-api-key: how Anthropic clients send it (/v1/messages)
        return hmac.compare_digest(given.strip(), self.expected)
