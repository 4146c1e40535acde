"""Generic local JSONL / parquet datasets read through HF `datasets`, with configurable field names.

Only local files: the path is checked to exist before `datasets` sees it (so it never tries to
resolve a hub repo), downloads are `local_files_only`, and the Arrow cache goes to a temporary
directory that is removed after loading (`keep_in_memory`), leaving nothing in ~/.cache.

An answer holding "#### N" is split like GSM8K (the HF gsm8k parquet files have that shape);
other answers are kept as strings. Columns other than the mapped ones are passed through as extras;
among them `conversation` (a whole OpenAI message list, which SFT trains on instead of
`messages` + `answer`) and `tools` are checked for shape.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pydantic

from asyncrl.data.gsm8k import LocalFileSource, describe, normalise_answer, split_marked_answer
from asyncrl.data.split import (DatasetError, Row, deterministic_split, ensure_ids, fill_prompt,
                                make_row)

RESERVED = ("id", "question", "answer", "messages", "solution")
BUILDER = {"jsonl": "json", "parquet": "parquet"}  # our kind -> `datasets` packaged builder


class FileDatasetConfig(LocalFileSource):
    kind: Literal["jsonl", "parquet"]
    question_field: str = "question"
    answer_field: str = "answer"
    id_field: str | None = pydantic.Field(None, description="None: ids hashed from the question")

    def build(self) -> FileDataset:
        return FileDataset(self)


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """Silence `datasets` for one call: its progress bars and its own ERROR log line would
    repeat, noisily, what our one-line DatasetError already says."""
    import datasets.utils as hf_utils
    import datasets.utils.logging as hf_logging

    bars_were_off = hf_utils.are_progress_bars_disabled()
    verbosity = hf_logging.get_verbosity()
    hf_utils.disable_progress_bars()
    hf_logging.set_verbosity(hf_logging.CRITICAL)
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if not bars_were_off:
            hf_utils.enable_progress_bars()


def read_records(path: str, kind: str) -> list[dict[str, Any]]:
    """The file's rows as dicts, via `datasets` ("jsonl" uses its "json" builder)."""
    if not Path(path).is_file():
        raise DatasetError(f"{path}: dataset file not found")
    if Path(path).stat().st_size == 0:
        raise DatasetError(f"{path}: no rows")
    import datasets  # deferred: ~1 s to import, and only file datasets need it

    try:
        with quiet_datasets(), tempfile.TemporaryDirectory(prefix="asyncrl-datasets-") as cache:
            table = datasets.load_dataset(
                BUILDER[kind], data_files=str(Path(path).resolve()), split="train",
                keep_in_memory=True, cache_dir=cache,
                download_config=datasets.DownloadConfig(local_files_only=True, cache_dir=cache))
            records = table.to_list()
    except datasets.exceptions.DatasetGenerationError as err:
        reason = str(err.__cause__ or err).splitlines()[0]
        raise DatasetError(f"{path}: cannot read as {kind}: {reason}") from None
    if not records:
        raise DatasetError(f"{path}: no rows")
    return records


def check_chat_extras(record: dict[str, Any], where: str) -> None:
    """`conversation` (an OpenAI message list, used by SFT) and `tools` pass through as extras;
    check their shape here, where the error can name the file and row."""
    conv = record.get("conversation")
    if conv is not None and not (isinstance(conv, list) and conv and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in conv)):
        raise DatasetError(f"{where}: field 'conversation' must be a non-empty list of messages "
                           f"with a string 'role', got {conv!r:.80}")
    if record.get("tools") is not None and not isinstance(record["tools"], list):
        raise DatasetError(f"{where}: field 'tools' must be a list, "
                           f"got {type(record['tools']).__name__}")


def to_row(record: dict[str, Any], cfg: FileDatasetConfig, where: str) -> Row:
    """One record -> row; `where` is "file: row i" for the error message."""
    present = {k: v for k, v in record.items() if v is not None}

    def field(name: str, types: tuple[type, ...]) -> Any:
        if name not in present:
            raise DatasetError(f"{where}: missing field '{name}' (have: {describe(present)})")
        value = present[name]
        if not isinstance(value, types) or isinstance(value, bool):
            allowed = " or ".join(t.__name__ for t in types)
            raise DatasetError(f"{where}: field '{name}' must be {allowed}, "
                               f"got {type(value).__name__}")
        return value

    check_chat_extras(present, where)
    question = field(cfg.question_field, (str,))
    raw_answer = str(field(cfg.answer_field, (str, int, float)))
    extra = {k: v for k, v in record.items()
             if k not in (cfg.question_field, cfg.answer_field, cfg.id_field) and k not in RESERVED}
    parts = split_marked_answer(raw_answer)
    if parts is not None:
        extra["solution"], answer = parts
    else:
        answer = normalise_answer(raw_answer)
    if not answer:
        raise DatasetError(f"{where}: field '{cfg.answer_field}' is empty")
    row_id = str(field(cfg.id_field, (str, int))) if cfg.id_field else None
    prompt = fill_prompt(cfg.prompt_template, "{question}", question)
    return make_row(row_id, question, answer, prompt, **extra)


def read_rows(path: str, cfg: FileDatasetConfig) -> list[Row]:
    records = read_records(path, cfg.kind)
    rows = [to_row(rec, cfg, f"{path}: row {i}") for i, rec in enumerate(records)]
    if cfg.id_field:
        first: dict[str, int] = {}
        for i, row in enumerate(rows):
            if (j := first.setdefault(row["id"], i)) != i:
                raise DatasetError(f"{path}: row {i}: duplicate {cfg.id_field}={row['id']!r} "
                                   f"(first seen at row {j})")
    return ensure_ids(rows, "q")


class FileDataset:
    """Train/eval rows of a local JSONL or parquet file (plus an optional separate eval file)."""

    def __init__(self, cfg: FileDatasetConfig):
        self.cfg = cfg
        rows = read_rows(cfg.path, cfg)
        if cfg.eval_path is None:
            self._train, self._eval = deterministic_split(rows, cfg.eval_fraction, cfg.seed)
        else:
            self._train = rows
            self._eval = read_rows(cfg.eval_path, cfg)

    def train_rows(self) -> list[Row]:
        return list(self._train)

    def eval_rows(self) -> list[Row]:
        return list(self._eval)
