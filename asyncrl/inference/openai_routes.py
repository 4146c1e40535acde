"""OpenAI-compatible `/v1/completions`, `/v1/chat/completions` and `/v1/models` on the engine, and
Anthropic's `/v1/messages` and OpenAI's `/v1/responses` over the chat path (messages_api.py,
responses_api.py; generated whole, streamed as a replay).

Each of the `n` choices of each prompt is one engine request (the engine returns one sequence per
request), run concurrently. Text is decoded from the exact sampled ids; a stop string ends the
text before it, as OpenAI does, while the ids keep every sampled token. Streaming holds back the
last few characters until it knows they do not start a stop string.

Chat replies are read with the server's chat options (models/chat_options.py): `<think>`
reasoning comes back as `reasoning_content`, tool calls in the model's format (`--tool-parser`)
as `tool_calls`. A streamed chat that needs either is generated whole and then replayed as
chunks (`replay_chat`): a reasoning or tool-call boundary is only known once the text is there.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection, Iterator
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from asyncrl.api import GenerationConfig, ModelRequest, ModelResponse, StopReason
from asyncrl.inference import messages_api, responses_api
from asyncrl.inference.http_schema import ChatCompletionBody, CompletionBody
from asyncrl.models.chat import encode_chat_prompt
from asyncrl.models.chat_options import ChatOptions, decode_keeping

FINISH = {StopReason.STOP: "stop", StopReason.LENGTH: "length", StopReason.ABORT: "abort",
          StopReason.TOOL_CALLS: "tool_calls"}
STREAM_PIECE = 16  # characters of content per replayed chunk


class ResponseNotFound(LookupError):
    """A previous_response_id this server does not hold (a 404)."""


class TextTracker:
    """Incremental detokenisation of one choice, with stop-string trimming and hold-back."""

    def __init__(self, tokenizer: Any, stops: list[str], keep: Collection[int] = ()) -> None:
        self.tokenizer, self.stops, self.keep = tokenizer, stops, keep  # keep: special ids
        self.tokens: list[int] = []
        self.sent = 0
        self.hold = max((len(s) for s in stops), default=1) - 1

    def text(self) -> str:
        text = decode_keeping(self.tokenizer, self.tokens, self.keep)
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


def reply_text(tokenizer: Any, out: ModelResponse, stops: list[str], chat: ChatOptions,
               parse_tools: bool = False) -> str:
    """A whole reply's text; with its tool calls to parse, their markers kept."""
    tracker = TextTracker(tokenizer, stops, chat.marker_ids(tokenizer) if parse_tools else ())
    tracker.tokens = list(out.output_tokens)
    return tracker.text()


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class OpenAIRoutes:
    """Handlers of the OpenAI-compatible endpoints, bound to one engine and tokenizer."""

    def __init__(self, engine: Any, tokenizer: Any, cfg: Any, metrics: Any) -> None:
        self.engine, self.tokenizer, self.cfg, self.metrics = engine, tokenizer, cfg, metrics
        # ServerConfig carries the chat options; a bare config object means the defaults
        self.chat_options = cfg if isinstance(cfg, ChatOptions) else ChatOptions()
        self.response_memory = responses_api.ResponseMemory()

    def register(self, app: FastAPI) -> None:
        app.get("/v1/models")(self.models)
        app.post("/v1/completions")(self.completions)
        app.post("/v1/chat/completions")(self.chat)
        app.post(messages_api.PATH)(self.messages)
        app.post(responses_api.PATH)(self.responses)

    # ---- request building ------------------------------------------------------------------

    def budget(self, prompt_len: int, asked: int | None) -> int:
        """max_new_tokens for a prompt: what was asked, never silently cut to fit the context."""
        cap, room = self.cfg.max_tokens_cap, self.engine.max_seq_len - prompt_len
        if asked is None:
            asked = room if cap is None else min(room, cap)
        elif cap is not None and asked > cap:
            raise ValueError(f"max_tokens={asked} is out of range; allowed [1, {cap}]")
        if asked < 1 or prompt_len + asked > self.engine.max_seq_len:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({asked}) is out of "
                             f"range; allowed <= context length {self.engine.max_seq_len}")
        return asked

    def requests(self, prompts: list[list[int]], body: Any, asked: int | None) -> list[ModelRequest]:
        out = []
        for ids in prompts:
            if not ids:
                raise ValueError("prompt is empty: it needs at least one token")
            g: GenerationConfig = body.gconfig(self.budget(len(ids), asked))
            for i in range(body.n):
                seed = None if g.seed is None else g.seed + i
                out.append(ModelRequest(input_ids=ids, gconfig=g.replace(seed=seed)))
        # A 400 now, before a stream has sent its 200 (the engine would reject it mid-stream);
        # the choices of one prompt differ only in their seed.
        for req in out[::body.n]:
            self.engine.validate(req)
        return out

    async def run_all(self, reqs: list[ModelRequest]) -> list[ModelResponse]:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(self.engine.agenerate(r) for r in reqs))
        for o in outs:
            self.metrics.observe(o, time.perf_counter() - t0)
        return list(outs)

    def final_text(self, o: ModelResponse, stops: list[str], parse_tools: bool = False) -> str:
        return reply_text(self.tokenizer, o, stops, self.chat_options, parse_tools)

    # ---- endpoints -------------------------------------------------------------------------

    async def models(self) -> dict:
        card = {"id": self.cfg.model_name, "object": "model", "owned_by": "asyncrl",
                "root": self.engine.model_path, "max_model_len": self.engine.max_seq_len}
        return {"object": "list", "data": [card]}

    async def completions(self, body: CompletionBody):
        prompts = [p if isinstance(p, list) else self.tokenizer.encode(p, add_special_tokens=False)
                   for p in body.prompts()]
        reqs = self.requests(prompts, body, body.max_tokens)
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.cfg.model_name}
        stops = reqs[0].gconfig.stop
        want_lp = body.logprobs is not None

        def chunk(i: int, text: str, tok: Any, fin: str | None) -> dict:
            lp = self.completion_logprobs(tok) if want_lp and tok is not None else None
            return {**head, "choices": [{"index": i, "text": text, "finish_reason": fin,
                                         "logprobs": lp}]}

        if body.stream:
            tail = usage_chunk(head, "text_completion", prompts) if body.stream_usage() else None
            return StreamingResponse(self.stream(reqs, stops, chunk, tail),
                                     media_type="text/event-stream")
        outs = await self.run_all(reqs)
        choices = [{"index": i, "text": self.final_text(o, stops),
                    "logprobs": self.completion_logprobs(o) if want_lp else None,
                    "finish_reason": FINISH[o.stop_reason]} for i, o in enumerate(outs)]
        return {**head, "choices": choices, "usage": usage(prompts, outs)}

    async def chat(self, body: ChatCompletionBody):
        if body.has_images():
            raise ValueError("messages: image_url parts are not served here (text prompts "
                             "only); a vision-language policy reads them through the agent "
                             "proxy of a training run")
        template_kwargs = self.chat_options.template_kwargs(body.chat_template_kwargs)
        prompt = encode_chat_prompt(self.tokenizer, body.message_dicts(), body.tool_dicts(),
                                    template_kwargs)
        reqs = self.requests([prompt], body, body.requested_max_tokens())
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.cfg.model_name}
        stops = reqs[0].gconfig.stop
        parse_tools = bool(body.tools) and body.tool_choice != "none"

        def chunk(i: int, text: str, tok: Any, fin: str | None) -> dict:
            delta = {"role": "assistant", "content": text} if text or fin is None else {}
            lp = {"content": self.chat_logprobs(tok)} if body.logprobs and tok else None
            return {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": fin}]}

        if body.stream and not parse_tools and self.chat_options.reasoning is None:
            tail = (usage_chunk(head, "chat.completion.chunk", [prompt]) if body.stream_usage()
                    else None)
            return StreamingResponse(self.stream(reqs, stops, chunk, tail),
                                     media_type="text/event-stream")
        result, _ = await self.chat_reply(body, prompt, reqs, head)
        if body.stream:
            return StreamingResponse(replay_chat(result, body.stream_usage()),
                                     media_type="text/event-stream")
        return result

    async def chat_reply(self, body: ChatCompletionBody, prompt: list[int],
                         reqs: list[ModelRequest], head: dict[str, Any]
                         ) -> tuple[dict[str, Any], list[ModelResponse]]:
        """The whole chat completion of `reqs` (one per choice) and the engine's outputs."""
        template_kwargs = self.chat_options.template_kwargs(body.chat_template_kwargs)
        parse_tools = bool(body.tools) and body.tool_choice != "none"
        stops = reqs[0].gconfig.stop
        outs = await self.run_all(reqs)
        choices = []
        for i, o in enumerate(outs):
            reply = self.chat_options.read_reply(self.final_text(o, stops, parse_tools),
                                                 parse_tools, template_kwargs)
            choices.append({"index": i, "message": reply.message(),
                            "logprobs": {"content": self.chat_logprobs(o)} if body.logprobs
                            else None,
                            "finish_reason": "tool_calls" if reply.tool_calls
                            else FINISH[o.stop_reason]})
        return ({**head, "object": "chat.completion", "choices": choices,
                 "usage": usage([prompt], outs)}, outs)

    async def whole_chat(self, body: ChatCompletionBody, rid: str
                         ) -> tuple[dict[str, Any], list[ModelResponse]]:
        """A chat request generated whole under id `rid` (the Messages and Responses routes)."""
        if body.has_images():
            raise ValueError("messages: images are not served here (text prompts only); a "
                             "vision-language policy reads them through the agent proxy of a "
                             "training run")
        template_kwargs = self.chat_options.template_kwargs(body.chat_template_kwargs)
        prompt = encode_chat_prompt(self.tokenizer, body.message_dicts(), body.tool_dicts(),
                                    template_kwargs)
        reqs = self.requests([prompt], body, body.requested_max_tokens())
        head = {"id": rid, "created": int(time.time()), "model": self.cfg.model_name}
        return await self.chat_reply(body, prompt, reqs, head)

    async def messages(self, body: messages_api.MessagesBody):
        chat = messages_api.to_chat(body)
        msg_id = f"msg_{uuid.uuid4().hex}"
        reply, outs = await self.whole_chat(chat, msg_id)
        message = messages_api.from_chat(reply, msg_id, body.model,
                                         self.tokenizer.decode(outs[0].output_tokens),
                                         list(body.stop_sequences or []))
        if body.stream:
            return StreamingResponse(messages_api.stream_events(message),
                                     media_type="text/event-stream")
        return message

    async def responses(self, body: responses_api.ResponsesBody):
        history = []
        if body.previous_response_id is not None:
            try:
                history = self.response_memory.get(body.previous_response_id)
            except KeyError:
                raise ResponseNotFound(
                    f"previous_response_id {body.previous_response_id!r} is not known here "
                    f"(this server keeps the last {self.response_memory.capacity} "
                    "responses)") from None
        chat = responses_api.to_chat(body, history)
        resp_id = f"resp_{uuid.uuid4().hex}"
        reply, _ = await self.whole_chat(chat, resp_id)
        self.response_memory.put(resp_id, responses_api.conversation(
            chat, reply, bool(body.instructions)))
        response = responses_api.from_chat(reply, resp_id, body)
        if body.stream:
            return StreamingResponse(responses_api.stream_events(response),
                                     media_type="text/event-stream")
        return response

    # ---- formatting ------------------------------------------------------------------------

    def token_strs(self, ids: list[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in ids]

    def completion_logprobs(self, o: Any) -> dict:
        toks = self.token_strs(o.output_tokens)
        offsets = [sum(len(t) for t in toks[:i]) for i in range(len(toks))]
        return {"tokens": toks, "token_logprobs": list(o.output_logprobs),
                "top_logprobs": [{t: lp} for t, lp in zip(toks, o.output_logprobs)],
                "text_offset": offsets}

    def chat_logprobs(self, o: Any) -> list[dict]:
        return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(self.token_strs(o.output_tokens), o.output_logprobs)]

    async def stream(self, reqs: list[ModelRequest], stops: list[str],
                     make: Callable[[int, str, Any, str | None], dict],
                     tail: Callable[[list[ModelResponse]], dict] | None = None,
                     ) -> AsyncIterator[str]:
        """Interleave the choices' token streams into one SSE stream, then `tail(finished
        responses in request order)` if given (the usage chunk), then `[DONE]`."""
        events: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, req: ModelRequest) -> None:
            try:
                async for item in self.engine.agenerate_stream(req):
                    await events.put((i, item))
            except Exception as err:  # boundary: this choice reports an error, others go on
                await events.put((i, err))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
        trackers = [TextTracker(self.tokenizer, stops) for _ in reqs]
        finished: list[ModelResponse | None] = [None] * len(reqs)
        pending = len(reqs)
        try:
            while pending:
                i, item = await events.get()
                if isinstance(item, Exception):
                    pending -= 1
                    yield sse({"error": {"message": str(item), "type": "server_error"}})
                    continue
                final = isinstance(item, ModelResponse)
                new = item.output_tokens[len(trackers[i].tokens):] if final else item.output_tokens
                text = trackers[i].delta(new, final)
                if text or not final:
                    yield sse(make(i, text, None if final else item, None))
                if final:
                    pending -= 1
                    finished[i] = item
                    self.metrics.observe(item, item.latency)
                    yield sse(make(i, "", None, FINISH[item.stop_reason]))
            done = [o for o in finished if o is not None]
            if tail is not None and len(done) == len(reqs):  # no usage after an error chunk
                yield sse(tail(done))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()


def replay_chat(reply: dict[str, Any], include_usage: bool) -> Iterator[str]:
    """A finished chat completion as OpenAI `chat.completion.chunk` events, then [DONE]."""
    head = {"id": reply["id"], "object": "chat.completion.chunk", "created": reply["created"],
            "model": reply["model"]}

    def chunk(i: int, delta: dict, finish: str | None = None, logprobs: Any = None) -> str:
        return sse({**head, "choices": [{"index": i, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish}]})

    for choice in reply["choices"]:
        i, msg = choice["index"], choice["message"]
        yield chunk(i, {"role": "assistant", "content": ""})
        reasoning = msg.get("reasoning_content") or ""
        for start in range(0, len(reasoning), STREAM_PIECE):
            piece = reasoning[start:start + STREAM_PIECE]
            yield chunk(i, {"reasoning_content": piece, "reasoning": piece})
        content = msg.get("content") or ""
        for start in range(0, len(content), STREAM_PIECE):
            yield chunk(i, {"content": content[start:start + STREAM_PIECE]})
        for j, call in enumerate(msg.get("tool_calls") or []):
            yield chunk(i, {"tool_calls": [{"index": j, **call}]})
        yield chunk(i, {}, choice["finish_reason"], choice["logprobs"])
    if include_usage:
        yield sse({**head, "choices": [], "usage": reply["usage"]})
    yield "data: [DONE]\n\n"


def usage(prompts: list[list[int]], outs: list[ModelResponse]) -> dict:
    prompt, completion = sum(len(p) for p in prompts), sum(o.output_len for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def usage_chunk(head: dict, obj: str, prompts: list[list[int]]
                ) -> Callable[[list[ModelResponse]], dict]:
    """The last chunk of a stream with stream_options.include_usage: usage and no choices."""
    return lambda outs: {**head, "object": obj, "choices": [], "usage": usage(prompts, outs)}


def add_openai_routes(app: FastAPI, engine: Any, tokenizer: Any, cfg: Any, metrics: Any) -> None:
    OpenAIRoutes(engine, tokenizer, cfg, metrics).register(app)
