"""The one line of glue every example agent has: an `AsyncOpenAI` client for the endpoint asyncrl
injects (inline mode: `base_url`, `api_key`, a shared `http_client`) or sets in the environment
(subproc mode: OPENAI_BASE_URL / OPENAI_API_KEY). Outside asyncrl it is just the usual client."""

from __future__ import annotations

import os
from typing import Any

from openai import AsyncOpenAI


def openai_client(extra_kwargs: dict[str, Any]) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=extra_kwargs.get("base_url") or os.environ["OPENAI_BASE_URL"],
        api_key=extra_kwargs.get("api_key") or os.environ["OPENAI_API_KEY"],
        http_client=extra_kwargs.get("http_client"),
        max_retries=0,  # a retried request would be recorded as a second completion
    )
