"""OpenAI's error shape for every error both HTTP servers answer (the inference server, the proxy).

`{"error": {"message", "type", "param", "code"}}`: `type` is `invalid_request_error` for a 4xx and
`server_error` for a 5xx, `param` names the offending field (`messages[0].content`) when there is
one, `code` is the HTTP status. FastAPI's own answers (404 unknown route, 405, an unparsable body,
a failed validation) are rewritten into that shape, and an unexpected exception becomes a 500 that
still leaves the keep-alive connection usable: Starlette's outermost handler would answer it and
then re-raise, and uvicorn then closes the connection under the client's next request.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)


class ErrorResponse(JSONResponse):
    """JSON with non-ASCII escaped: an error may quote input that UTF-8 cannot encode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_body(status: int, message: str, param: str | None = None,
               headers: dict[str, str] | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    err = {"message": message, "type": kind, "param": param, "code": status}
    return ErrorResponse({"error": err}, status_code=status, headers=headers)


# Parts of a pydantic error location that name a union member ("str", "list[int]", "TextPart",
# "function-after[...]"), not a field: left out of the field path the client sees.
_TAG = re.compile(r"^(str|int|float|bool|list|dict|none|[A-Z]\w*)$|[\[\]-]")


def field_path(loc: tuple | list) -> str:
    """("body", "messages", 0, "content") -> "messages[0].content"."""
    out = ""
    if loc and loc[0] in ("body", "query", "path", "header", "cookie"):
        loc = loc[1:]
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TAG.search(str(part)):
            out += f".{part}" if out else str(part)
    return out


# pydantic error types of a body that is absent or not a JSON object
_NOT_AN_OBJECT = ("missing", "model_attributes_type", "model_type", "dict_type")


def _most_specific(errors: list[dict]) -> dict:
    # Of a union's alternatives, the one that got furthest into the input says what was wrong.
    return max(errors, key=lambda e: len(e["loc"]))


async def invalid_request(_: Request, err: RequestValidationError) -> JSONResponse:
    """A body that fails validation: 400 naming the bad field (FastAPI's default is 422)."""
    first = _most_specific(list(err.errors()))
    cause = (first.get("ctx") or {}).get("error")
    if first["type"] == "json_invalid":
        return error_body(400, f"the request body is not valid JSON: {cause} (at character "
                               f"{first['loc'][-1]})")
    if tuple(first["loc"]) == ("body",) and first["type"] in _NOT_AN_OBJECT:
        what = "is missing; send" if first["type"] == "missing" else "must be"
        return error_body(400, f"the request body {what} a JSON object with Content-Type: "
                               "application/json")
    loc = getattr(cause, "param", None) or field_path(first["loc"])
    msg = str(cause) if hasattr(cause, "param") else first["msg"].removeprefix("Value error, ")
    if loc and not msg.startswith(loc):
        msg = f"{loc}: {msg}"
    return error_body(400, msg, loc or None)


async def http_exception(request: Request, err: StarletteHTTPException) -> JSONResponse:
    """Starlette's and FastAPI's own errors (404, 405, an unparsable body) in OpenAI's shape."""
    cause = err.__cause__
    if isinstance(cause, RecursionError):
        message = "the request body is nested too deeply to parse"
    elif isinstance(cause, UnicodeDecodeError):
        message = "the request body is not valid UTF-8"
    elif err.status_code == 404:
        message = f"no route {request.url.path}"
    elif err.status_code == 405:
        allowed = (err.headers or {}).get("Allow") or (err.headers or {}).get("allow") or ""
        message = (f"method {request.method} is not allowed on {request.url.path}; "
                   f"allowed: {allowed}")
    else:
        message = str(err.detail)
    return error_body(err.status_code, message, headers=dict(err.headers or {}))


def status_handler(status: int, retry_after: bool = False) -> Callable[..., Any]:
    """An exception handler answering `status` with the exception's message."""
    async def handle(_: Request, err: Exception) -> JSONResponse:
        return error_body(status, str(err), getattr(err, "param", None),
                          {"Retry-After": "1"} if retry_after else None)
    return handle


class InternalErrors:
    """Any exception a handler did not expect: a 500 in OpenAI's shape, logged with its traceback,
    and the connection stays open. Once a (streamed) response has started, the exception is
    re-raised: the status line is already sent, so closing the connection is all that is left."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as err:  # boundary: logged here, answered as a 500 JSON body
            if started:
                raise
            log.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            resp = error_body(500, f"internal server error: {type(err).__name__}: {err}")
            await resp(scope, receive, send)


def install_error_handlers(app: FastAPI, statuses: dict[type[Exception], int]) -> None:
    """OpenAI-shaped errors on `app`: `statuses` maps the app's typed errors to their status;
    add `InternalErrors` as the outermost middleware after the app's other middleware."""
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_exception)
    for exc, status in statuses.items():
        app.add_exception_handler(exc, status_handler(status, retry_after=status == 429))
