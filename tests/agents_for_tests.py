"""Agent programs used by the agent-workflow tests (importable by spawned subprocesses)."""

from __future__ import annotations

import asyncio
import os
import time

from openai import AsyncOpenAI, OpenAI


class OneShotAgent:
    """One chat call with the injected client; reward 1.0 when the reply is non-empty."""

    async def run(self, data, **kw):
        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"],
                             http_client=kw["http_client"], max_retries=0)
        r = await client.chat.completions.create(model="default", messages=data["messages"],
                                                 max_tokens=4)
        return 1.0 if r.choices[0].message.content is not None else 0.0


class ThreeTurnAgent:
    """Three turns, each continuing the conversation; dict reward on the first and last."""

    def __init__(self, first: float = 0.5, last: float = 1.0) -> None:
        self.first, self.last = first, last

    async def run(self, data, **kw):
        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"],
                             http_client=kw["http_client"], max_retries=0)
        messages, ids = list(data["messages"]), []
        for _ in range(3):
            r = await client.chat.completions.create(model="default", messages=messages,
                                                     max_tokens=3)
            ids.append(r.id)
            messages += [r.choices[0].message.model_dump(exclude_none=True),
                         {"role": "user", "content": "Try again."}]
        return {ids[0]: self.first, ids[-1]: self.last}


class SyncEnvAgent:
    """Subprocess mode: a synchronous client configured only from the environment."""

    async def run(self, data, **kw):
        client = OpenAI(base_url=os.environ["OPENAI_BASE_URL"],
                        api_key=os.environ["OPENAI_API_KEY"], max_retries=0)
        r = client.chat.completions.create(model="default", messages=data["messages"],
                                           max_tokens=3)
        return 0.25 if r.choices else 0.0


class RaisingAgent:
    async def run(self, data, **kw):
        raise RuntimeError("tool server unreachable")


class HangingAgent:
    async def run(self, data, **kw):
        await asyncio.sleep(3600)


class BlockingAgent:
    """Hangs in synchronous code: only a subprocess timeout can stop it."""

    async def run(self, data, **kw):
        time.sleep(3600)


class WrongTypeAgent:
    async def run(self, data, **kw):
        return "great"


class NotAnAgent:
    def run(self, data):
        return 1.0


class DigitAgent:
    """Reward 1.0 when the reply holds a digit: varies on an untrained tiny model."""

    def __init__(self, fail_every: int = 0) -> None:
        self.fail_every, self.calls = fail_every, 0

    async def run(self, data, **kw):
        self.calls += 1
        if self.fail_every and self.calls % self.fail_every == 0:
            raise RuntimeError(f"flaky agent failure #{self.calls}")
        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"],
                             http_client=kw["http_client"], max_retries=0)
        r = await client.chat.completions.create(model="default", messages=data["messages"],
                                                 max_tokens=6)
        return 1.0 if any(c.isdigit() for c in r.choices[0].message.content or "") else 0.0


class ImageAgent:
    """Shows the model the row's scene as a data URL image part; reward: the count, exactly."""

    async def run(self, data, **kw):
        import base64
        import io

        buf = io.BytesIO()
        data["images"][0].save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        client = AsyncOpenAI(base_url=kw["base_url"], api_key=kw["api_key"],
                             http_client=kw["http_client"], max_retries=0)
        r = await client.chat.completions.create(model="default", max_tokens=3, messages=[
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": data["question"]}]}])
        return float((r.choices[0].message.content or "").strip() == data["answer"])
