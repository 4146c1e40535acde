"""Chat-format encoding shared by SFT, rollout workflows, evaluation and the proxy.

Rendering to text and then encoding without extra special tokens keeps the ids exactly what the
chat template says (some transformers versions add a BOS when tokenizing inside the template call).
A template that refuses the messages (its `raise_exception`, an undefined field, a value of the
wrong type) raises `ChatTemplateError`, a ValueError naming the template's complaint: the input
is at fault, and servers answer it with a 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jinja2

from asyncrl.api import GenerationConfig
from asyncrl.models.chat_options import check_template_kwargs


class ChatTemplateError(ValueError):
    """The tokenizer's chat template could not render these messages and tools."""


def stop_at_eos(gconfig: GenerationConfig, tokenizer: Any) -> GenerationConfig:
    """`gconfig` that also stops at the tokenizer's EOS (a chat model's end of turn).

    The caller's stop ids keep their order and EOS is appended when missing; `gconfig` itself is
    returned when there is nothing to add. Every backend treats stop ids as a set.
    """
    eos = tokenizer.eos_token_id
    if eos is None or eos in gconfig.stop_token_ids:
        return gconfig
    return gconfig.replace(stop_token_ids=[*gconfig.stop_token_ids, eos])


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: Mapping[str, Any] | None = None) -> str:
    """The chat template's text; `template_kwargs` are extra template variables (Qwen3's
    `enable_thinking`, see ChatOptions), checked not to shadow apply_chat_template's own."""
    kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
    if tools:
        kwargs["tools"] = tools
    if template_kwargs:
        check_template_kwargs(template_kwargs, "chat_template_kwargs")
        kwargs.update(template_kwargs)
    try:
        return tokenizer.apply_chat_template(messages, **kwargs)
    except (jinja2.TemplateError, TypeError) as err:  # the messages' fault, not the caller's
        raise ChatTemplateError(f"the chat template cannot render these messages: "
                                f"{type(err).__name__}: {err}") from err


def encode_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                       tools: list[dict[str, Any]] | None = None,
                       template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
    """Token ids of `messages` followed by the assistant generation prompt."""
    text = render_chat(tokenizer, messages, True, tools, template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def text_after_reply(tokenizer: Any, messages: list[dict[str, Any]], reply: int,
                     tools: list[dict[str, Any]] | None = None,
                     template_kwargs: Mapping[str, Any] | None = None, closed: bool = True,
                     full_text: str | None = None) -> str | None:
    """The template text that follows the assistant reply `messages[reply]` up to the next
    generation prompt, for continuing a sequence that holds the reply's sampled ids as they were
    (re-rendering the reply could tokenize it otherwise). `closed`: the sampled ids end with the
    EOS token (else the text starts with it). None when the template does not render the
    conversation as the reply's text followed by more (it rewrites earlier turns)."""
    full = full_text if full_text is not None else render_chat(
        tokenizer, messages, True, tools, template_kwargs)
    upto = render_chat(tokenizer, messages[:reply + 1], False, tools, template_kwargs)
    eos = tokenizer.eos_token or ""
    end = upto.rfind(eos) if eos else -1
    if end < 0 or not full.startswith(upto):
        return None
    after = upto[end + len(eos):] + full[len(upto):]
    return after if closed else eos + after


def encode_completion(tokenizer: Any, text: str) -> list[int]:
    """Token ids of an assistant reply as the model should produce it, ending with EOS."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos_token; set eos_token in tokenizer_config.json")
    return ids + [tokenizer.eos_token_id]
