"""Generic local JSONL / parquet datasets read through HF `datasets`, with configurable field names.

Only local files: the path is checked to exist before `datasets` sees it (so it never tries to
resolve a hub repo), downloads are `local_files_only`, and the Arrow cache goes to a temporary
directory that is removed after loading (`keep_in_memory`), leaving nothing in ~/.cache.
Records become rows as data/records.py says (nested field paths, the TRL `prompt` column, a
row's own `messages`, `system_prompt`), the same mapping `kind: hf` uses.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

from asyncrl.data.gsm8k import LocalFileSource
from asyncrl.data.kind import DatasetKind
from asyncrl.data.records import RecordFields, records_to_rows
from asyncrl.data.split import DatasetError, Row, SplitRows, split_rows

BUILDER = {"jsonl": "json", "parquet": "parquet"}  # our kind -> `datasets` packaged builder


class FileDatasetConfig(DatasetKind, RecordFields, LocalFileSource):
    kind: Literal["jsonl", "parquet"]  # the file's format

    def build(self) -> SplitRows:
        """Train/eval rows of the file (plus an optional separate eval file)."""
        return split_rows(read_rows(self.path, self),
                          self.eval_path and (lambda: read_rows(self.eval_path, self)),
                          self.eval_fraction, self.seed)


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


def read_rows(path: str, cfg: FileDatasetConfig) -> list[Row]:
    return records_to_rows(read_records(path, cfg.kind), cfg, path)
