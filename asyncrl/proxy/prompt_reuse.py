"""Prompt token ids for a chat request that continue the session's earlier completions exactly.

An agent sends its whole conversation every turn. Re-rendering it with the chat template and
tokenizing again may give other ids than the model sampled (a tool call re-serialised with other
spacing, a reply cut at a stop string, a BPE merge across the turn boundary), and the trainer would
then learn from tokens the policy never produced. So when the messages start with an earlier
completion's messages followed by exactly the assistant reply the proxy returned for it, the new
prompt is that completion's prompt ids + its sampled output ids + the template text that follows
the reply, tokenized on its own. `drift` counts the positions where naive re-rendering would have
disagreed with those ids (what this module prevents).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from asyncrl.models.chat import render_chat, text_after_reply
from asyncrl.proxy.records import Completion


def normalise_message(msg: dict[str, Any]) -> dict[str, Any]:
    """The fields that shape the prompt, in a comparable form (SDKs add nulls and extras)."""
    out: dict[str, Any] = {"role": msg.get("role"), "content": msg.get("content") or ""}
    if msg.get("tool_calls"):
        out["tool_calls"] = [_call_key(c) for c in msg["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if msg.get(key) is not None:
            out[key] = msg[key]
    return out


def _call_key(call: dict[str, Any]) -> tuple[str, str]:
    fn = call.get("function") or {}
    args = fn.get("arguments", "")
    if isinstance(args, str):  # compared as JSON: a client may re-serialise it (the Messages
        try:                   # API sends tool input back as an object)
            args = json.loads(args)
        except ValueError:
            return fn.get("name", ""), args
    return fn.get("name", ""), json.dumps(args, separators=(",", ":"), sort_keys=True)


def _matches(earlier: Completion, messages: list[dict[str, Any]],
             tools: list[dict[str, Any]] | None, template_kwargs: dict[str, Any]) -> bool:
    k = len(earlier.messages or [])
    if earlier.messages is None or len(messages) <= k or earlier.tools != tools \
            or earlier.template_kwargs != template_kwargs:
        return False
    head = [normalise_message(m) for m in messages[:k + 1]]
    reply = normalise_message({"role": "assistant", **earlier.message})
    return head[:k] == [normalise_message(m) for m in earlier.messages] and head[k] == reply


def build_prompt(tokenizer: Any, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None,
                 history: list[Completion], template_kwargs: dict[str, Any] | None = None,
                 encode: Callable[[str], list[int]] | None = None,
                 ) -> tuple[list[int], Completion | None, int]:
    """(prompt ids, the completion they continue or None, drift vs naive re-rendering);
    `template_kwargs`: the chat template variables (ChatOptions.template_kwargs); `encode`:
    rendered text -> ids (default the tokenizer's; with images, one that expands the newest
    images' placeholders: VisionPromptEncoder.expand)."""
    template_kwargs = template_kwargs or {}
    encode = encode or (lambda text: tokenizer.encode(text, add_special_tokens=False))
    full_text = render_chat(tokenizer, messages, True, tools, template_kwargs)
    naive = encode(full_text)
    # Longest reusable conversation first; among equals the latest.
    for earlier in sorted(history, key=lambda c: (len(c.messages or []), c.turn), reverse=True):
        if not _matches(earlier, messages, tools, template_kwargs):
            continue
        closed = bool(earlier.output_ids) and earlier.output_ids[-1] == tokenizer.eos_token_id
        delta = text_after_reply(tokenizer, messages, len(earlier.messages), tools,
                                 template_kwargs, closed, full_text)
        if delta is None:
            continue
        ids = earlier.prompt_ids + earlier.output_ids + encode(delta)
        return ids, earlier, drift(ids, naive)
    return naive, None, 0


def drift(ids: list[int], naive: list[int]) -> int:
    """Positions where two token sequences differ (length difference counted too)."""
    return sum(a != b for a, b in zip(ids, naive)) + abs(len(ids) - len(naive))
