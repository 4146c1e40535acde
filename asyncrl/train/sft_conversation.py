"""SFT examples from whole conversations: every assistant turn is trained on, nothing else.

A row's `conversation` is an OpenAI message list (assistant turns may carry `tool_calls`, tool
results are `tool` messages) and its optional `tools` the tool list the prompt shows. The example
is the rendered conversation; the loss covers each assistant turn's text through its EOS (not the
newline the template puts after it, not any other role's text).

Turn boundaries come from the chat template itself: the text an assistant turn adds is
`render(msgs[:k+1])` minus `render(msgs[:k], add_generation_prompt=True)`. That is only meaningful
if rendering is prefix-stable (a later message never rewrites earlier text), which is also what
multi-turn RL relies on, so it is checked and a template that breaks it is an error. Each piece is
encoded separately, the way the engine sees it: prompt tokens, then generated tokens.
"""

from __future__ import annotations

from typing import Any

from asyncrl.errors import UserError
from asyncrl.models.chat import render_chat


def check_conversation(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The row's `conversation`, after checking its shape.

    Errors are UserError (a ValueError the CLI prints as one line) naming the row id: bad rows and
    an unusable template are things the user fixes, not bugs to show a traceback for.
    """
    conv = row.get("conversation")
    where = f"row {row.get('id')!r}: conversation"
    if not isinstance(conv, list) or not conv:
        raise UserError(f"{where} must be a non-empty list of messages, got {conv!r:.80}")
    for i, msg in enumerate(conv):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise UserError(f"{where}[{i}] must be an object with a string 'role', got {msg!r:.80}")
    if not any(m["role"] == "assistant" for m in conv):
        raise UserError(f"{where} has no assistant turn: nothing to train on")
    tools = row.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise UserError(f"row {row.get('id')!r}: tools must be a list, got {type(tools).__name__}")
    return conv


def assistant_spans(tokenizer: Any, row: dict[str, Any],
                    template_kwargs: dict[str, Any] | None = None,
                    ) -> tuple[str, list[tuple[int, int]]]:
    """(full text, [(start, end) character span of each assistant turn through its EOS]);
    `template_kwargs`: the model's chat template variables (model.chat_template_kwargs)."""
    conv = check_conversation(row)
    tools = row.get("tools")
    eos = tokenizer.eos_token
    if not eos:
        raise UserError("tokenizer has no eos_token; set eos_token in tokenizer_config.json")
    full = render_chat(tokenizer, conv, False, tools, template_kwargs)
    spans = []
    for k, msg in enumerate(conv):
        if msg["role"] != "assistant":
            continue
        before = render_chat(tokenizer, conv[:k], True, tools, template_kwargs)
        upto = render_chat(tokenizer, conv[:k + 1], False, tools, template_kwargs)
        if not (upto.startswith(before) and full.startswith(upto)):
            raise UserError(
                f"row {row.get('id')!r}: the chat template is not prefix-stable at message {k} "
                f"(rendering more messages changed earlier text), so assistant turns cannot be "
                f"located; fix the template or train on `messages` + `answer` rows instead")
        end = upto.rfind(eos)
        if end < len(before):
            raise UserError(f"row {row.get('id')!r}: assistant message {k} renders without the "
                             f"EOS token {eos!r}; the model would never learn to stop")
        spans.append((len(before), end + len(eos)))
    return full, spans


def conversation_ids(tokenizer: Any, row: dict[str, Any],
                     template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, target_mask) of a conversation row; mask 1 on assistant-turn tokens."""
    full, spans = assistant_spans(tokenizer, row, template_kwargs)
    ids: list[int] = []
    mask: list[int] = []
    pos = 0
    for start, end in spans:
        for text, flag in ((full[pos:start], 0), (full[start:end], 1)):
            piece = tokenizer.encode(text, add_special_tokens=False) if text else []
            ids += piece
            mask += [flag] * len(piece)
        pos = end
    tail = tokenizer.encode(full[pos:], add_special_tokens=False) if full[pos:] else []
    return ids + tail, mask + [0] * len(tail)


def first_turn(tokenizer: Any, row: dict[str, Any],
               template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], str]:
    """(prompt ids up to the first assistant turn, that turn's demonstrated text through EOS).

    SFT evaluation of conversation rows: does the model's greedy first turn (for a tool agent,
    the tool call) equal the demonstration's? Meaningful when the eval rows are clean demos.
    """
    full, spans = assistant_spans(tokenizer, row, template_kwargs)
    start, end = spans[0]
    return tokenizer.encode(full[:start], add_special_tokens=False), full[start:end]
