"""OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and `/v1/models` on the engine.

Each of the `n` choices of each prompt is one engine request (the engine returns one sequence per
request), run concurrently. Text is decoded from the exact sampled ids; a stop string ends the
text before it, as OpenAI does, while the ids keep every sampled token. Streaming holds back the
last few characters until it knows they do not start a stop string.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from asyncrl.api import GenerationConfig, ModelRequest, ModelResponse, StopReason
from asyncrl.inference.http_schema import ChatCompletionBody, CompletionBody
from asyncrl.models.chat import encode_chat_prompt

FINISH = {StopReason.STOP: "stop", StopReason.LENGTH: "length", StopReason.ABORT: "abort",
          StopReason.TOOL_CALLS: "tool_calls"}


class TextTracker:
    """Incremental detokenisation of one choice, with stop-string trimming and hold-back."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.sent = 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def text(self) -> str:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        return text[:cut] if cut >= 0 else text

    def delta(self, new_tokens: list[int], final: bool) -> str:
        self.tokens.extend(new_tokens)
        text = self.text()
        end = len(text) if final else max(self.sent, len(text) - self.hold)
        if not final and text.endswith("\ufffd"):  # a multi-byte character is still incomplete
            end = min(end, len(text) - 1)
        out, self.sent = text[self.sent:end], max(self.sent, end)
        return out


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def add_openai_routes(app: FastAPI, engine: Any, tokenizer: Any, cfg: Any, metrics: Any) -> None:
    max_len = engine.engine.max_seq_len

    def budget(prompt_len: int, asked: int | None) -> int:
        room = max_len - prompt_len
        if asked is None:
            asked = room if cfg.max_tokens_cap is None else min(room, cfg.max_tokens_cap)
        elif cfg.max_tokens_cap is not None and asked > cfg.max_tokens_cap:
            raise ValueError(f"max_tokens={asked} is out of range; allowed [1, {cfg.max_tokens_cap}]")
        if asked < 1 or prompt_len + asked > max_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({asked}) is out of "
                             f"range; allowed <= context length {max_len}")
        return asked

    def requests(prompts: list[list[int]], body: Any, asked: int | None) -> list[ModelRequest]:
        out = []
        for ids in prompts:
            if not ids:
                raise ValueError("prompt is empty: it needs at least one token")
            g: GenerationConfig = body.gconfig(budget(len(ids), asked))
            for i in range(body.n):
                seed = None if g.seed is None else g.seed + i
                out.append(ModelRequest(input_ids=ids, gconfig=g.replace(seed=seed)))
        return out

    async def run_all(reqs: list[ModelRequest]) -> list[ModelResponse]:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
        for o in outs:
            metrics.observe(o, time.perf_counter() - t0)
        return list(outs)

    def usage(prompts: list[list[int]], outs: list[ModelResponse]) -> dict:
        prompt, completion = sum(len(p) for p in prompts), sum(o.output_len for o in outs)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": cfg.model_name, "object": "model", "owned_by": "asyncrl",
                "max_model_len": max_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(body: CompletionBody):
        prompts = [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=False)
                   for p in body.prompts()]
        reqs = requests(prompts, body, body.max_tokens)
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        stops = reqs[0].gconfig.stop
        if body.stream:
            return StreamingResponse(
                stream(reqs, stops, lambda i, text, tok, fin: {
                    "id": cid, "object": "text_completion", "created": created,
                    "model": cfg.model_name,
                    "choices": [{"index": i, "text": text, "finish_reason": fin,
                                 "logprobs": completion_logprobs(tok) if body.logprobs is not None
                                 else None}]}),
                media_type="text/event-stream")
        outs = await run_all(reqs)
        choices = []
        for i, o in enumerate(outs):
            tracker = TextTracker(tokenizer, stops)
            tracker.tokens = list(o.output_tokens)
            lp = completion_logprobs(o) if body.logprobs is not None else None
            choices.append({"index": i, "text": tracker.text(), "logprobs": lp,
                            "finish_reason": FINISH[o.stop_reason]})
        return {"id": cid, "object": "text_completion", "created": created,
                "model": cfg.model_name, "choices": choices, "usage": usage(prompts, outs)}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionBody):
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        prompt = encode_chat_prompt(tokenizer, messages, tools=body.tools)
        reqs = requests([prompt], body, body.requested_max_tokens())
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        stops = reqs[0].gconfig.stop
        if body.stream:
            def chunk(i, text, tok, fin):
                delta = {"role": "assistant", "content": text} if text or fin is None else {}
                lp = {"content": chat_logprobs(tok)} if body.logprobs and tok else None
                return {"id": cid, "object": "chat.completion.chunk", "created": created,
                        "model": cfg.model_name,
                        "choices": [{"index": i, "delta": delta, "logprobs": lp,
                                     "finish_reason": fin}]}
            return StreamingResponse(stream(reqs, stops, chunk), media_type="text/event-stream")
        outs = await run_all(reqs)
        choices = []
        for i, o in enumerate(outs):
            tracker = TextTracker(tokenizer, stops)
            tracker.tokens = list(o.output_tokens)
            lp = {"content": chat_logprobs(o)} if body.logprobs else None
            choices.append({"index": i, "message": {"role": "assistant", "content": tracker.text()},
                            "logprobs": lp, "finish_reason": FINISH[o.stop_reason]})
        return {"id": cid, "object": "chat.completion", "created": created,
                "model": cfg.model_name, "choices": choices, "usage": usage([prompt], outs)}

    def token_strs(ids: list[int]) -> list[str]:
        return [tokenizer.decode([t]) for t in ids]

    def completion_logprobs(o: Any) -> dict:
        toks = token_strs(o.output_tokens)
        offsets, pos = [], 0
        for t in toks:
            offsets.append(pos)
            pos += len(t)
        return {"tokens": toks, "token_logprobs": list(o.output_logprobs),
                "top_logprobs": [{t: lp} for t, lp in zip(toks, o.output_logprobs)],
                "text_offset": offsets}

    def chat_logprobs(o: Any) -> list[dict]:
        return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(token_strs(o.output_tokens), o.output_logprobs)]

    async def stream(reqs: list[ModelRequest], stops: list[str], make) -> AsyncIterator[str]:
        """Interleave the choices' token streams into one SSE stream, then `[DONE]`."""
        events: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: ModelRequest) -> None:
            try:
                async for item in engine.agenerate_stream(req):
                    await events.put((i, item))
            except Exception as err:  # boundary: the client gets an error event, others go on
                await events.put((i, err))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        trackers = [TextTracker(tokenizer, stops) for _ in reqs]
        pending = len(reqs)
        try:
            while pending:
                i, item = await events.get()
                if isinstance(item, Exception):
                    pending -= 1
                    yield sse({"error": {"message": str(item), "type": "server_error"}})
                    continue
                final = isinstance(item, ModelResponse)
                text = trackers[i].delta(item.output_tokens if not final else
                                         item.output_tokens[len(trackers[i].tokens):], final)
                if text or not final:
                    yield sse(make(i, text, item if not final else None, None))
                if final:
                    pending -= 1
                    metrics.observe(item, item.latency)
                    yield sse(make(i, "", None, FINISH[item.stop_reason]))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
