"""One table record -> one row (data/split.py), for every loader that reads tables.

Local JSONL/parquet files and `datasets.load_dataset` sources share this mapping, so a column
means the same thing whichever way it was loaded:

- `question_field` / `answer_field` / `id_field` may be dotted paths into nested columns
  (`reward_model.ground_truth`, the verl/TRL layout); a key that itself contains the dot wins.
- The prompt: the row's own `messages` column (a list of chat messages), else the TRL
  conversational `prompt` column (`prompt_field`, also a message list), else the question filled
  into `prompt_template` as one user message. A string `prompt` column is TRL's "standard"
  format: the question text, used when the record has no `question_field`.
- `system_prompt` is prepended as a system message unless the prompt already starts with one
  (the row's own system message is the more specific).

Images: a record's `images_field` column (default `images`; a list of images or one: PIL images
as `datasets` decodes an Image column, paths, bytes, `{"bytes", "path"}`) goes to the row's
`images`, and the built prompt's user turn gets one image part per image: where the question
marks `<image>` (CLEVR-Count-70K's `problem`, LLaMA-Factory's format), else before the text.
A record with its own `messages` places its image parts itself.

An answer holding "#### N" is split like GSM8K (the HF gsm8k files have that shape); other answers
are kept as strings. Columns other than the mapped ones pass through as extras; among them
`conversation` (a whole OpenAI message list, which SFT trains on instead of `messages` +
`answer`) and `tools` are checked for shape.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import pydantic

from asyncrl.config import Config
from asyncrl.data.gsm8k import describe, normalise_answer, split_marked_answer
from asyncrl.data.split import (DatasetError, Row, ensure_ids, fill_prompt, make_row,
                                require_placeholder)

RESERVED = ("id", "question", "answer", "messages", "solution", "images")
IMAGE_MARK = "<image>"
MESSAGES = "messages"
_MISSING = object()


class RecordFields(Config):
    """Which columns of a table record make a row, and how its prompt is built."""

    # the question's column; a dotted path reads nested columns (extra_info.question)
    question_field: str = "question"
    answer_field: str = "answer"  # the exact final answer's column, e.g. reward_model.ground_truth
    id_field: str | None = pydantic.Field(None, description="None: ids hashed from the question")
    # TRL's conversational column: a list of {role, content} messages used as the prompt
    prompt_field: str = "prompt"
    system_prompt: str | None = None  # prepended as a system message to every prompt
    prompt_template: str = "{question}"  # for rows whose prompt is built from the question
    images_field: str = "images"  # a record's images (a list, or one); see the module docstring

    @pydantic.field_validator("prompt_template")
    @classmethod
    def _template_shows_question(cls, template: str) -> str:
        return require_placeholder(template, "{question}")


def lookup(record: Mapping[str, Any], path: str) -> Any:
    """The value at `path` (a key, or dot-separated keys into nested mappings); _MISSING when
    absent or null."""
    if path in record:
        return _MISSING if record[path] is None else record[path]
    node: Any = record
    for key in path.split("."):
        if not isinstance(node, Mapping) or node.get(key) is None:
            return _MISSING
        node = node[key]
    return node


def missing_field(record: Mapping[str, Any], path: str, where: str) -> DatasetError:
    """"missing field 'a.b' (have: ...)" naming the keys at the level where the path stopped."""
    node: Any = record
    prefix = ""
    for key in path.split(".")[:-1]:
        child = node.get(key) if isinstance(node, Mapping) else None
        if not isinstance(child, Mapping):
            break
        node, prefix = child, f"{prefix}{key}."
    have = ", ".join(f"{prefix}{k}" for k, v in node.items() if v is not None) if prefix \
        else describe(dict(record))
    return DatasetError(f"{where}: missing field '{path}' (have: {have or 'no fields'})")


def is_message_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in value)


def check_chat_extras(record: dict[str, Any], where: str) -> None:
    """`conversation` (an OpenAI message list, used by SFT) and `tools` pass through as extras;
    check their shape here, where the error can name the file and row."""
    conv = record.get("conversation")
    if conv is not None and not is_message_list(conv):
        raise DatasetError(f"{where}: field 'conversation' must be a non-empty list of messages "
                           f"with a string 'role', got {conv!r:.80}")
    if record.get("tools") is not None and not isinstance(record["tools"], list):
        raise DatasetError(f"{where}: field 'tools' must be a list, "
                           f"got {type(record['tools']).__name__}")


def own_messages(record: Mapping[str, Any], cfg: RecordFields, where: str
                 ) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(the column it came from, the record's own prompt messages), or (None, None)."""
    for name in dict.fromkeys((MESSAGES, cfg.prompt_field)):
        value = lookup(record, name)
        if value is _MISSING or (name == cfg.prompt_field and isinstance(value, str)):
            continue  # a string prompt is the question text (TRL's standard format)
        if not is_message_list(value):
            raise DatasetError(f"{where}: field '{name}' must be a non-empty list of messages "
                               f"with a string 'role', got {value!r:.80}")
        # plain dicts with only what a chat template reads: parquet structs carry every key of
        # the column's schema, None where a message lacks it
        return name, [{k: v for k, v in m.items() if v is not None} for m in value]
    return None, None


def last_user_text(messages: list[dict[str, Any]]) -> str | None:
    for message in reversed(messages):
        if message["role"] == "user" and isinstance(message.get("content"), str):
            return message["content"]
    return None


def typed(value: Any, name: str, types: tuple[type, ...], where: str) -> Any:
    if not isinstance(value, types) or isinstance(value, bool):
        allowed = " or ".join(t.__name__ for t in types)
        raise DatasetError(f"{where}: field '{name}' must be {allowed}, got {type(value).__name__}")
    return value


def question_of(record: Mapping[str, Any], cfg: RecordFields,
                messages: list[dict[str, Any]] | None, where: str) -> str:
    """The question text: `question_field`, else a string `prompt`, else the last user turn."""
    value = lookup(record, cfg.question_field)
    if value is not _MISSING:
        return typed(value, cfg.question_field, (str,), where)
    prompt = lookup(record, cfg.prompt_field)
    if isinstance(prompt, str):
        return prompt
    text = last_user_text(messages) if messages else None
    if text is None:
        raise missing_field(record, cfg.question_field, where)
    return text


def to_row(record: dict[str, Any], cfg: RecordFields, where: str) -> Row:
    """One record -> row; `where` is "source: row i" for the error message."""
    present = {k: v for k, v in record.items() if v is not None}
    check_chat_extras(present, where)
    source, messages = own_messages(present, cfg, where)
    question = question_of(present, cfg, messages, where)
    raw = lookup(present, cfg.answer_field)
    if raw is _MISSING:
        raise missing_field(present, cfg.answer_field, where)
    raw_answer = str(typed(raw, cfg.answer_field, (str, int, float), where))
    used = {cfg.question_field, cfg.answer_field, cfg.id_field, source}
    if lookup(present, cfg.question_field) is _MISSING:
        used.add(cfg.prompt_field)  # the question came from it
    # a nested path leaves its parent column as an extra (it may hold more than the answer)
    extra = {k: v for k, v in record.items() if k not in used and k not in RESERVED}
    parts = split_marked_answer(raw_answer)
    if parts is not None:
        extra["solution"], answer = parts
    else:
        answer = normalise_answer(raw_answer)
    if not answer:
        raise DatasetError(f"{where}: field '{cfg.answer_field}' is empty")
    row_id = None
    if cfg.id_field:
        value = lookup(present, cfg.id_field)
        if value is _MISSING:
            raise missing_field(present, cfg.id_field, where)
        row_id = str(typed(value, cfg.id_field, (str, int), where))
    images = lookup(present, cfg.images_field)
    images = [] if images is _MISSING else images if isinstance(images, list) else [images]
    prompt = fill_prompt(cfg.prompt_template, "{question}", question)
    row = make_row(row_id, question.replace(IMAGE_MARK, "").strip() if images else question,
                   answer, prompt, **{k: v for k, v in extra.items() if k != cfg.images_field})
    if images:
        row["images"] = images
        if messages is None:
            row["messages"] = [{"role": "user", "content": image_content(prompt, len(images),
                                                                         where)}]
    if messages is not None:
        row["messages"] = messages
    if cfg.system_prompt is not None and row["messages"][0]["role"] != "system":
        row["messages"] = [{"role": "system", "content": cfg.system_prompt}, *row["messages"]]
    return row


def image_content(text: str, count: int, where: str) -> list[dict[str, Any]]:
    """A user turn's parts: `count` images where `text` marks <image> (else first), then text."""
    marks = text.count(IMAGE_MARK)
    if marks not in (0, count):
        raise DatasetError(f"{where}: the question marks {IMAGE_MARK} {marks} times but the "
                           f"record has {count} images")
    pieces = text.split(IMAGE_MARK) if marks else ["", text]
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if i:
            parts.append({"type": "image"})
        if piece.strip():
            parts.append({"type": "text", "text": piece.strip()})
    if not marks:
        parts[:0] = [{"type": "image"}] * (count - 1)
    return parts


def records_to_rows(records: Iterable[dict[str, Any]], cfg: RecordFields,
                    source: str) -> list[Row]:
    """Rows of every record, ids unique (a repeated `id_field` value is an error naming both
    rows; missing ids are hashed from the question)."""
    rows = [to_row(rec, cfg, f"{source}: row {i}") for i, rec in enumerate(records)]
    if cfg.id_field:
        first: dict[str, int] = {}
        for i, row in enumerate(rows):
            if (j := first.setdefault(row["id"], i)) != i:
                raise DatasetError(f"{source}: row {i}: duplicate {cfg.id_field}={row['id']!r} "
                                   f"(first seen at row {j})")
    return ensure_ids(rows, "q")
