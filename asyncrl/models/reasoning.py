"""Reasoning parsers: split a reply into its `<think>` reasoning and the answer after it.

Named like vLLM's `--reasoning-parser` so one model config serves both. Reasoning models write
`<think> ... </think> answer`; newer chat templates (DeepSeek-R1 after its 2025-01 update,
Qwen3.5 and the Qwen3 2507 thinking models) open `<think>` in the prompt, so the reply holds only
`</think>`. Both parsers therefore accept the reply with or without its opening tag. They differ
on a reply without `</think>`:

- `deepseek_r1`: the model always thinks, so the reply was cut mid-thought: all reasoning.
- `qwen3`: thinking may be switched off (`chat_template_kwargs: {enable_thinking: false}`, whose
  template closes an empty think block in the prompt); then the reply is all content, otherwise
  it was cut mid-thought as above.

Parsing only ever reads the decoded text: the sampled token ids (what the trainer learns from)
keep the reasoning, whatever is shown to the client or the reward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass(frozen=True)
class ThinkParser:
    """`<think>...</think>` splitter; `off_switch` is the chat-template kwarg that disables
    thinking (None: the model cannot be told not to think)."""

    name: str
    off_switch: str | None = None

    def split(self, text: str, template_kwargs: Mapping[str, Any] | None = None
              ) -> tuple[str | None, str | None]:
        """(reasoning, content) of one reply; either is None when empty."""
        head, opened, rest = text.partition(THINK_OPEN)
        # Text before an opening tag is not reasoning; keep it with the content.
        before, body = (head, rest) if opened else ("", head)
        if THINK_CLOSE in body:
            reasoning, _, content = body.partition(THINK_CLOSE)
            return reasoning or None, (before + content) or None
        thinking_off = (self.off_switch is not None and not opened
                        and (template_kwargs or {}).get(self.off_switch, True) is False)
        if thinking_off:
            return None, text or None
        return body or None, before or None


REASONING_PARSERS: dict[str, ThinkParser] = {
    p.name: p for p in (ThinkParser("deepseek_r1"), ThinkParser("qwen3", "enable_thinking"))}


def reasoning_parser(name: str | None) -> ThinkParser | None:
    """The parser registered as `name`; None (or "none") means replies are all content."""
    if name is None or name == "none":
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={name!r} is unknown; allowed: none, "
                         f"{', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
