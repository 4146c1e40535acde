"""The `data:` payloads of a server-sent-events response, split the way the SSE format says.

httpx's `aiter_lines` splits like `str.splitlines`: also at U+0085 (NEL), U+2028, U+2029 and the
ASCII separators 0x1c-0x1e. A server that writes JSON with ensure_ascii off (vLLM does) leaves
such characters raw inside a string whenever the model generates them, and the event would be
cut in two mid-JSON. SSE lines end at "\\n" ("\\r\\n" too; JSON escapes any "\\r" in a string).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx


async def sse_data(resp: httpx.Response) -> AsyncIterator[str]:
    """Each `data:` field's value of `resp`'s event stream, stripped, in order."""
    pending = ""
    async for chunk in resp.aiter_text():
        pending += chunk
        *lines, pending = pending.split("\n")
        for line in lines:
            if line.startswith("data:"):
                yield line[5:].strip()
    if pending.startswith("data:"):
        yield pending[5:].strip()
