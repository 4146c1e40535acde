"""The OpenAI-compatible endpoints of the proxy: generate through the engine, record, answer.

Each of the `n` choices is one engine request. The reply text is decoded from the exact sampled
ids (cut before a stop string, as OpenAI does) and read with the model's chat options: `<think>`
reasoning becomes `reasoning_content`, and with `tools` in the request the model's tool-call
format (`model.tool_parser`) becomes `tool_calls` (malformed calls stay plain content). The
prompt is rendered with `model.chat_template_kwargs` under the request's own. With a
vision-language policy, `image_url` parts (data URLs; file URLs under `image_dir`) become the
request's images, their placeholders expanded as the trainer's are, and every completion keeps
them. Streaming replays
the finished choices as SSE chunks: the engine protocol returns whole sequences, and recording
needs them anyway.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from asyncrl.api import GenerationConfig, InferenceEngine, ModelRequest, ModelResponse
from asyncrl.api.images import ImageInputs
from asyncrl.inference import messages_api, responses_api
from asyncrl.inference.http_schema import ChatCompletionBody, CompletionBody, OpenAISampling
from asyncrl.inference.openai_routes import FINISH, replay_chat, reply_text, sse, usage
from asyncrl.models.chat import stop_at_eos
from asyncrl.models.chat_options import ChatOptions
from asyncrl.models.vision import VisionPromptEncoder, load_image
from asyncrl.proxy.config import ProxyConfig
from asyncrl.proxy.errors import NotFoundError, SessionEndedError
from asyncrl.proxy.prompt_reuse import build_prompt
from asyncrl.proxy.records import Completion, Session, SessionStatus

stream_chat = replay_chat  # a finished chat completion as SSE chunks (shared with the server)


class ProxyRoutes:
    def __init__(self, engine: InferenceEngine, tokenizer: Any, cfg: ProxyConfig,
                 context_length: int | None, chat: ChatOptions | None = None,
                 vision: VisionPromptEncoder | None = None) -> None:
        self.engine, self.tokenizer, self.cfg, self.vision = engine, tokenizer, cfg, vision
        self.chat_options = chat or ChatOptions()
        self.context_length = context_length
        self.stats = {"completions": 0, "reused_prompts": 0, "prompt_drift_tokens": 0,
                      "tool_calls": 0, "malformed_tool_calls": 0}

    # ---- request building ---------------------------------------------------------------------

    def budget(self, prompt_len: int, asked: int | None) -> int:
        cap = self.cfg.max_tokens_cap
        if asked is not None and asked > cap:
            raise ValueError(f"max_tokens={asked} is out of range; allowed [1, {cap}]")
        room = (self.context_length - prompt_len) if self.context_length else cap
        if room < 1:
            raise ValueError(f"the prompt has {prompt_len} tokens; allowed < context length "
                             f"{self.context_length}")
        if asked is not None and asked > room:
            raise ValueError(f"prompt ({prompt_len} tokens) + max_tokens ({asked}) is out of "
                             f"range; allowed <= context length {self.context_length}")
        return asked if asked is not None else min(cap, room)

    def gconfig(self, body: OpenAISampling, max_new: int) -> GenerationConfig:
        if body.n > self.cfg.max_n:
            raise ValueError(f"n={body.n} is out of range; allowed [1, {self.cfg.max_n}]")
        return stop_at_eos(body.gconfig(max_new), self.tokenizer)

    async def generate(self, prompts: list[list[int]], g: GenerationConfig,
                       n: int, images: ImageInputs | None = None) -> list[ModelResponse]:
        reqs = [ModelRequest(input_ids=ids, gconfig=g.replace(
                    seed=None if g.seed is None else g.seed + i), images=images)
                for ids in prompts for i in range(n)]
        return list(await asyncio.gather(*(self.engine.agenerate(r) for r in reqs)))

    def text(self, out: ModelResponse, stops: list[str], parse_tools: bool = False) -> str:
        return reply_text(self.tokenizer, out, stops, self.chat_options, parse_tools)

    # ---- /v1/chat/completions -----------------------------------------------------------------

    async def chat(self, session: Session, body: ChatCompletionBody,
                   rid: str | None = None) -> dict[str, Any]:
        """`rid`: the completion id (default chatcmpl-...; the Messages and Responses routes
        record under their own msg_/resp_ ids, which their rewards then name)."""
        require_active(session)
        messages, tools = body.message_dicts(), body.tool_dicts()
        template_kwargs = self.chat_options.template_kwargs(body.chat_template_kwargs)
        images, encode = self.images(messages) if body.has_images() else (None, None)
        prompt, parent, drift = build_prompt(self.tokenizer, messages, tools,
                                             list(session.completions.values()), template_kwargs,
                                             encode)
        g = self.gconfig(body, self.budget(len(prompt), body.requested_max_tokens()))
        outs = await self.generate([prompt], g, body.n, images)
        rid = rid or f"chatcmpl-{uuid.uuid4().hex}"
        parse = bool(body.tools) and body.tool_choice != "none"
        records, choices = [], []
        for i, out in enumerate(outs):
            reply = self.chat_options.read_reply(self.text(out, g.stop, parse), parse,
                                                 template_kwargs)
            message = reply.message()
            self.stats["tool_calls"] += len(reply.tool_calls or [])
            self.stats["malformed_tool_calls"] += reply.malformed_tool_call
            records.append(self.record(session, rid, i, body.n, prompt, out, message,
                                       messages, tools, parent, drift, template_kwargs, images))
            choices.append({"index": i, "message": message,
                            "logprobs": {"content": self.chat_logprobs(out)} if body.logprobs
                            else None,
                            "finish_reason": "tool_calls" if reply.tool_calls
                            else FINISH[out.stop_reason]})
        session.add_turn(records)
        self.stats["reused_prompts"] += parent is not None
        self.stats["prompt_drift_tokens"] += drift
        return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": self.cfg.model_name, "choices": choices,
                "usage": usage([prompt], outs)}

    # ---- /v1/messages and /v1/responses (over the chat path) --------------------------------

    async def messages(self, session: Session, body: messages_api.MessagesBody) -> dict[str, Any]:
        chat = messages_api.to_chat(body)
        msg_id = f"msg_{uuid.uuid4().hex}"
        reply = await self.chat(session, chat, msg_id)
        raw = self.tokenizer.decode(session.completion(msg_id).output_ids)
        return messages_api.from_chat(reply, msg_id, body.model, raw,
                                      list(body.stop_sequences or []))

    async def responses(self, session: Session, body: responses_api.ResponsesBody
                        ) -> dict[str, Any]:
        history = []
        if body.previous_response_id is not None:
            try:
                history = session.responses.get(body.previous_response_id)
            except KeyError:
                raise NotFoundError(f"previous_response_id {body.previous_response_id!r} is "
                                    "not a response of this session") from None
        chat = responses_api.to_chat(body, history)
        resp_id = f"resp_{uuid.uuid4().hex}"
        reply = await self.chat(session, chat, resp_id)
        session.responses.put(resp_id, responses_api.conversation(chat, reply,
                                                                  bool(body.instructions)))
        return responses_api.from_chat(reply, resp_id, body)

    def record(self, session: Session, rid: str, i: int, n: int, prompt: list[int],
               out: ModelResponse, message: dict[str, Any], messages: list[dict] | None,
               tools: list[dict] | None, parent: Completion | None, drift: int,
               template_kwargs: dict[str, Any] | None = None,
               images: ImageInputs | None = None) -> Completion:
        self.stats["completions"] += 1
        return Completion(id=rid if n == 1 else f"{rid}:{i}", turn=len(session.turns),
                          prompt_ids=list(prompt), output_ids=list(out.output_tokens),
                          logprobs=list(out.output_logprobs), versions=list(out.output_versions),
                          stop_reason=out.stop_reason, messages=messages, tools=tools,
                          message=message, parent=parent.id if parent else None,
                          retokenize_drift=drift, template_kwargs=template_kwargs or {},
                          images=images, routes=out.routes)

    def images(self, messages: list[dict[str, Any]]
               ) -> tuple[ImageInputs | None, Callable[[str], list[int]]]:
        """The conversation's images (every image_url part, in order) and the text encoder that
        expands their placeholders; ValueError (a 400) for a text-only policy or a URL this
        proxy does not read."""
        if self.vision is None:
            raise ValueError("messages: image_url parts need a vision-language policy; this "
                             "one reads text only")
        pictures = [load_image(self.image_url(part["image_url"]["url"]))
                    for m in messages if isinstance(m.get("content"), list)
                    for part in m["content"] if part.get("type") == "image_url"]
        inputs = self.vision.image_inputs(pictures)
        counts = self.vision.tokens_per_image(inputs.grid_thw) if inputs is not None else []
        return inputs, lambda text: self.vision.expand(text, counts)

    def image_url(self, url: str) -> str | Path:
        """A data URL as it is; a file:// URL as its path when under `cfg.image_dir`."""
        if url.startswith("data:"):
            return url
        if url.startswith("file://"):
            if self.cfg.image_dir is None:
                raise ValueError("image_url: file:// URLs are not read by this proxy (its "
                                 "image_dir is unset); send a data:image/...;base64 URL")
            root = Path(self.cfg.image_dir).resolve()
            path = Path(unquote(urlsplit(url).path)).resolve()
            if not path.is_relative_to(root):
                raise ValueError(f"image_url {url[:80]!r}: outside the directory this proxy "
                                 f"reads images from ({root})")
            return path
        raise ValueError(f"image_url {url[:40]!r}...: allowed a data:image/...;base64 URL or a "
                         "file:// URL under the proxy's image_dir (nothing is fetched)")

    def chat_logprobs(self, out: ModelResponse) -> list[dict]:
        toks = [self.tokenizer.decode([t]) for t in out.output_tokens]
        return [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(toks, out.output_logprobs)]

    # ---- /v1/completions ----------------------------------------------------------------------

    async def completions(self, session: Session, body: CompletionBody) -> dict[str, Any]:
        require_active(session)
        prompts = [p if isinstance(p, list) else
                   self.tokenizer.encode(p, add_special_tokens=False) for p in body.prompts()]
        if any(not p for p in prompts):
            raise ValueError("prompt is empty: it needs at least one token")
        g = self.gconfig(body, max(self.budget(len(p), body.max_tokens) for p in prompts))
        outs = await self.generate(prompts, g, body.n)
        rid = f"cmpl-{uuid.uuid4().hex}"
        records, choices = [], []
        history = list(session.completions.values())
        for i, out in enumerate(outs):
            prompt = prompts[i // body.n]
            text = self.text(out, g.stop)
            records.append(self.record(session, rid, i, len(outs), prompt, out, {"text": text},
                                       None, None, continued(prompt, history), 0))
            choices.append({"index": i, "text": text, "logprobs": None,
                            "finish_reason": FINISH[out.stop_reason]})
        session.add_turn(records)
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.cfg.model_name, "choices": choices, "usage": usage(prompts, outs)}


def require_active(session: Session) -> None:
    if session.status != SessionStatus.ACTIVE:
        raise SessionEndedError(session.id)


def continued(prompt: list[int], history: list[Completion]) -> Completion | None:
    """The longest earlier completion whose prompt + output `prompt` starts with (token ids)."""
    best = None
    for c in history:
        head = c.prompt_ids + c.output_ids
        if len(head) < len(prompt) and prompt[:len(head)] == head:
            if best is None or len(head) > len(best.prompt_ids) + len(best.output_ids):
                best = c
    return best


def stream_completion(reply: dict[str, Any]) -> Iterator[str]:
    head = {k: reply[k] for k in ("id", "object", "created", "model")}
    for choice in reply["choices"]:
        yield sse({**head, "choices": [{**choice, "finish_reason": None}]})
        yield sse({**head, "choices": [{**choice, "text": "",
                                        "finish_reason": choice["finish_reason"]}]})
    yield "data: [DONE]\n\n"
