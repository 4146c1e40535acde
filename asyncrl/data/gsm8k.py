"""GSM8K-format JSONL: one {"question", "answer"} object a line, the answer ending in "#### N".

The row's `answer` is N (stripped, thousands commas removed) and `solution` is the reasoning before
"####", so SFT can train on the worked solution while the reward checks only N. The file is read
line by line here rather than through HF `datasets` so that every error names `file:line`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import pydantic

from asyncrl.config import Config
from asyncrl.data.kind import DatasetKind
from asyncrl.data.split import (
    DatasetError,
    Row,
    SplitRows,
    ensure_ids,
    fill_prompt,
    make_row,
    require_placeholder,
    split_rows,
)

MARKER = "####"
COMMA_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


class LocalFileSource(Config):
    """Fields shared by datasets read from local files: where, the held-out part, the prompt."""

    path: str  # the local data file
    eval_path: str | None = pydantic.Field(
        None, description="held-out file; None: hold out eval_fraction of `path`")
    eval_fraction: float = pydantic.Field(0.1, ge=0, le=1,
                                          description="ignored when eval_path is set")
    seed: int = 0  # of the eval_fraction hold-out
    prompt_template: str = "{question}"  # the user message; {question}: the row's question

    @pydantic.field_validator("prompt_template")
    @classmethod
    def _template_shows_question(cls, template: str) -> str:
        return require_placeholder(template, "{question}")


class GSM8KConfig(DatasetKind, LocalFileSource):
    kind: Literal["gsm8k"] = "gsm8k"  # GSM8K-format JSONL ("#### N" answers)
    # the user message; {question} is replaced by the row's question
    prompt_template: str = "{question}\nPut the final answer after ####."

    def build(self) -> SplitRows:
        """Train/eval rows of the file (plus an optional separate eval file)."""
        def read(path: str) -> list[Row]:
            return read_gsm8k_jsonl(path, self.prompt_template)

        return split_rows(read(self.path), self.eval_path and (lambda: read(self.eval_path)),
                          self.eval_fraction, self.seed)


def normalise_answer(text: str) -> str:
    """Strip, and drop thousands separators from numbers ("1,000" -> "1000"); other text is kept."""
    text = text.strip()
    return text.replace(",", "") if COMMA_NUMBER.fullmatch(text) else text


def split_marked_answer(text: str) -> tuple[str, str] | None:
    """(solution, final answer) of "reasoning #### N", or None when there is no marker."""
    if MARKER not in text:
        return None
    solution, _, final = text.rpartition(MARKER)
    return solution.strip(), normalise_answer(final)


def describe(obj: dict[str, Any]) -> str:
    """The fields a record really has, for "missing field" messages (null counts as missing)."""
    return ", ".join(k for k, v in obj.items() if v is not None) or "no fields"


def parse_line(line: str, where: str, template: str) -> Row:
    """One JSONL line -> row; `where` is "file:line" for the error message."""
    try:
        # Without the newline, a truncated object reports its own column, not "line 2 column 1".
        obj = json.loads(line.rstrip("\r\n"))
    except json.JSONDecodeError as err:
        raise DatasetError(f"{where}: malformed JSON: {err.msg} (column {err.colno})") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for field in ("question", "answer"):
        if obj.get(field) is None:
            raise DatasetError(f"{where}: missing field '{field}' (have: {describe(obj)})")
        if not isinstance(obj[field], str):
            raise DatasetError(f"{where}: field '{field}' must be a string, "
                               f"got {type(obj[field]).__name__}")
    parts = split_marked_answer(obj["answer"])
    if parts is None:
        snippet = obj["answer"] if len(obj["answer"]) <= 60 else obj["answer"][:57] + "..."
        raise DatasetError(f"{where}: field 'answer' has no '{MARKER} <final answer>' marker: "
                           f"{snippet!r}")
    solution, final = parts
    if not final:
        raise DatasetError(f"{where}: field 'answer' is empty after '{MARKER}'")
    row_id = None if obj.get("id") is None else str(obj["id"])
    prompt = fill_prompt(template, "{question}", obj["question"])
    return make_row(row_id, obj["question"], final, prompt, solution=solution)


def read_gsm8k_jsonl(path: str, template: str) -> list[Row]:
    """All rows of a GSM8K-format file; blank lines are skipped, line numbers count from 1."""
    if not Path(path).is_file():
        raise DatasetError(f"{path}: dataset file not found")
    rows = []
    # Bytes, decoded per line: a text-mode decode error would surface a buffer later, at the
    # wrong line number.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig")
            except UnicodeDecodeError as err:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 text (byte {err.start})") from None
            if line.strip():
                rows.append(parse_line(line, f"{path}:{lineno}", template))
    if not rows:
        raise DatasetError(f"{path}: no rows")
    return ensure_ids(rows, "gsm8k")
