"""Server-sent events split only at line ends: a JSON payload that holds U+0085, U+2028 or an
ASCII separator raw (vLLM writes JSON with ensure_ascii off, and a model generates them) stays
one event, where httpx's `aiter_lines` (str.splitlines) cut it in two mid-JSON. A real server
on 127.0.0.1 streams the events in chunks that end mid-line."""

from __future__ import annotations

import asyncio
import json

import httpx
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from http_helpers import serve_app

from asyncrl.inference.sse import sse_data

TEXTS = ["plain", "nel\u0085inside", "line\u2028and\u2029para", "sep\x1c\x1d\x1e", "ünï ✓"]


def app() -> FastAPI:
    api = FastAPI()

    @api.get("/stream")
    async def stream():
        async def events():
            body = "".join(f"data: {json.dumps({'text': t}, ensure_ascii=False)}\r\n\r\n"
                           for t in TEXTS) + "data: [DONE]\n\n"
            raw = body.encode()
            for i in range(0, len(raw), 7):  # chunks end mid-line, mid-character too
                yield raw[i:i + 7]
                await asyncio.sleep(0)

        return StreamingResponse(events(), media_type="text/event-stream")

    return api


def test_events_with_unicode_line_separators_arrive_whole():
    async def read(url):
        async with httpx.AsyncClient() as client, client.stream("GET", url + "/stream") as resp:
            return [d async for d in sse_data(resp)]

    with serve_app(app()) as url:
        got = asyncio.run(read(url))
    assert got[-1] == "[DONE]"
    assert [json.loads(d)["text"] for d in got[:-1]] == TEXTS
