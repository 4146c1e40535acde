"""How one model's chats are rendered and its replies read: the options vLLM takes per server.

- `chat_template_kwargs`: extra variables for the chat template (Qwen3's `enable_thinking`),
  passed to every prompt the job renders; an OpenAI request's own `chat_template_kwargs` (vLLM's
  extension) overrides them key by key.
- `reasoning_parser`: splits `<think>` reasoning off the reply (`reasoning_content`).
- `tool_parser`: which tool-call format the model writes (`tool_calls`).

They belong to the model, not to a workflow: the same checkpoint needs the same template
variables and parsers in rollouts, evaluation, SFT prompts, the proxy and `asyncrl serve`, so
`ModelConfig` and the server's config both carry them (this class is their common base).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import pydantic

from asyncrl.config import Config
from asyncrl.models.reasoning import REASONING_PARSERS, ThinkParser, reasoning_parser
from asyncrl.models.tool_parsers import TOOL_PARSERS, ToolCalls, ToolParser, tool_parser

# Arguments of `apply_chat_template` itself: a template kwarg of the same name would silently
# replace what the library sets (the messages, the tools, whether to tokenize).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "sanitize_control_tokens"})


def check_template_kwargs(kwargs: Mapping[str, Any], field: str | None) -> None:
    """ValueError (naming `field` when given) for a key that would override an argument of
    apply_chat_template itself."""
    clash = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if clash:
        where = f"{field}: " if field else ""
        raise ValueError(f"{where}{', '.join(map(repr, clash))} is reserved by "
                         "apply_chat_template; allowed: template variables such as "
                         "enable_thinking")


@dataclass(frozen=True)
class Reply:
    """One generated reply as the client sees it (the sampled ids are kept elsewhere, whole)."""

    content: str | None
    reasoning: str | None = None
    tool_calls: ToolCalls | None = None
    malformed_tool_call: bool = False  # it tried to call a tool and got the format wrong

    def message(self) -> dict[str, Any]:
        """The assistant message of a chat completion; reasoning under vLLM's two spellings
        (`reasoning_content`, and `reasoning` since vLLM 0.10)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = msg["reasoning"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


class ChatOptions(Config):
    chat_template_kwargs: dict[str, Any] = pydantic.Field(
        default_factory=dict,
        description="chat template variables, e.g. {enable_thinking: false} for Qwen3")
    reasoning_parser: str | None = pydantic.Field(
        None, description=f"none | {' | '.join(REASONING_PARSERS)}: reasoning_content split "
                          "off the reply")
    tool_parser: str = pydantic.Field(
        "hermes", description=f"{' | '.join(TOOL_PARSERS)}: the model's tool-call format")

    @pydantic.field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_template_kwargs(value, None)
        return value

    # The messages name only the value: the config loader prefixes the field's dotted path.
    @pydantic.field_validator("reasoning_parser")
    @classmethod
    def _known_reasoning(cls, value: str | None) -> str | None:
        if value is None or value == "none":
            return None
        if value not in REASONING_PARSERS:
            raise ValueError(f"{value!r} is unknown; allowed: none, {', '.join(REASONING_PARSERS)}")
        return value

    @pydantic.field_validator("tool_parser")
    @classmethod
    def _known_tools(cls, value: str) -> str:
        if value not in TOOL_PARSERS:
            raise ValueError(f"{value!r} is unknown; allowed: {', '.join(TOOL_PARSERS)}")
        return value

    @property
    def reasoning(self) -> ThinkParser | None:
        return reasoning_parser(self.reasoning_parser)

    @property
    def tools(self) -> ToolParser:
        return tool_parser(self.tool_parser)

    def template_kwargs(self, request: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The configured template variables with a request's own laid over them."""
        if not request:
            return dict(self.chat_template_kwargs)
        check_template_kwargs(request, "chat_template_kwargs")
        return {**self.chat_template_kwargs, **request}

    def marker_ids(self, tokenizer: Any) -> frozenset[int]:
        """Ids of the tool parser's markers in `tokenizer` (Mistral's `[TOOL_CALLS]`): special
        tokens a reply is decoded keeping (`decode_keeping`) when its tool calls are parsed."""
        ids = (tokenizer.convert_tokens_to_ids(m) for m in self.tools.markers)
        return frozenset(i for i in ids if i is not None and i != tokenizer.unk_token_id)

    def read_reply(self, text: str, parse_tools: bool = False,
                   template_kwargs: Mapping[str, Any] | None = None) -> Reply:
        """`text` split into reasoning and content, then tool calls parsed from the content
        only (a call the model merely considered while thinking is not made)."""
        reasoning, content = (None, text) if self.reasoning is None else \
            self.reasoning.split(text, template_kwargs)
        if not parse_tools or content is None:
            return Reply(content, reasoning)
        parser = self.tools
        rest, calls = parser.parse(content)
        if calls is None:
            return Reply(content, reasoning, None, parser.attempted(content))
        return Reply(rest, reasoning, calls)

    def reward_text(self, text: str, with_reasoning: bool,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
        """What a reward function reads: the whole reply, or its content without reasoning."""
        if with_reasoning or self.reasoning is None:
            return text
        return self.reasoning.split(text, template_kwargs)[1] or ""


def decode_keeping(tokenizer: Any, ids: list[int], keep: Collection[int] = ()) -> str:
    """`ids` decoded without special tokens, except those in `keep`, written as their text."""
    if not keep or not any(t in keep for t in ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    parts, run = [], []
    for t in ids:
        if t in keep:
            parts += [tokenizer.decode(run, skip_special_tokens=True),
                      tokenizer.convert_ids_to_tokens(t)]
            run = []
        else:
            run.append(t)
    return "".join(parts) + tokenizer.decode(run, skip_special_tokens=True)
