"""The row contract every loader returns, and the deterministic train/eval split.

A row is a plain dict: `id` (stable, unique), `question`, `answer` (the exact final answer as a
string), `messages` (the chat-format prompt; the chat template is applied later by the model side),
plus optional extras such as `solution`. The helpers here build rows the same way for every loader.

The split hashes (seed, id) with sha256, so a row's side depends on nothing else: not on file order,
not on how many other rows exist, not on PYTHONHASHSEED. Adding rows to a file never moves an old
row between train and eval.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from asyncrl.errors import UserError

Row = dict[str, Any]


class DatasetError(UserError):
    """A dataset file or row the user must fix; one line naming file, place and field."""


def text_id(text: str, prefix: str) -> str:
    """A stable id from content, for data that carries no ids of its own."""
    return f"{prefix}-{hashlib.sha1(text.encode('utf-8')).hexdigest()[:12]}"


def require_placeholder(template: str, placeholder: str) -> str:
    """Validator body for prompt templates: the template must show the problem somewhere."""
    if placeholder not in template:
        raise ValueError(f"prompt_template={template!r} must contain {placeholder!r}")
    return template


def fill_prompt(template: str, placeholder: str, value: str) -> str:
    # Plain replacement rather than str.format: a template may contain other braces (JSON,
    # LaTeX) that format() would reject or swallow.
    return template.replace(placeholder, value)


def make_row(row_id: str | None, question: str, answer: str, prompt: str, **extra: Any) -> Row:
    row: Row = {"id": row_id, "question": question, "answer": answer,
                "messages": [{"role": "user", "content": prompt}]}
    row.update(extra)
    return row


def ensure_ids(rows: Iterable[Row], prefix: str = "q") -> list[Row]:
    """Rows with an `id` for every row; missing ones are hashed from the question.

    A repeated question gets `-2`, `-3`, ... so ids stay unique (the duplicates are kept: the file
    is the user's, and dropping rows silently would change the epoch size).
    """
    rows = list(rows)
    taken = {r["id"] for r in rows if r.get("id") is not None}
    out = []
    for index, row in enumerate(rows):
        if row.get("id") is None:
            if not isinstance(row.get("question"), str):
                raise DatasetError(f"row {index}: has neither an 'id' nor a string 'question' "
                                   f"to derive one from (have: {', '.join(row) or 'nothing'})")
            base = text_id(row["question"], prefix)
            row_id, n = base, 1
            while row_id in taken:
                n += 1
                row_id = f"{base}-{n}"
            taken.add(row_id)
            row = {**row, "id": row_id}
        out.append(row)
    return out


def split_score(seed: int, row_id: str) -> float:
    """Uniform in [0, 1), a pure function of (seed, id)."""
    digest = hashlib.sha256(f"{seed}\x00{row_id}".encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def deterministic_split(rows: Iterable[Row], eval_fraction: float,
                        seed: int = 0) -> tuple[list[Row], list[Row]]:
    """(train, eval): a row goes to eval iff split_score(seed, id) < eval_fraction.

    The eval share is eval_fraction in expectation, not exactly: exactness would need a global
    ranking, which would let one added row move others across the boundary.
    """
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction={eval_fraction!r}: must be in [0, 1]")
    train: list[Row] = []
    held_out: list[Row] = []
    for row in ensure_ids(rows):
        (held_out if split_score(seed, str(row["id"])) < eval_fraction else train).append(row)
    return train, held_out


@dataclass(frozen=True)
class SplitRows:
    """A dataset's rows (a TaskDataset): the training rows and the held-out ones."""

    train: list[Row]
    held_out: list[Row]

    def train_rows(self) -> list[Row]:
        return list(self.train)

    def eval_rows(self) -> list[Row]:
        return list(self.held_out)


def split_rows(rows: list[Row], eval_rows: Callable[[], list[Row]] | None, eval_fraction: float,
               seed: int) -> SplitRows:
    """`rows` for training and `eval_rows()` held out, or, without a separate eval source, the
    deterministic split of `rows`."""
    if eval_rows is None:
        return SplitRows(*deterministic_split(rows, eval_fraction, seed))
    return SplitRows(rows, eval_rows())
