"""`kind: hf`: a dataset loaded by `datasets.load_dataset`, the way the HF ecosystem names them.

`name` is a hub id (`org/name`, at `revision`) or a local directory or file; `config` picks the
subset, `split` the training rows and `eval_split` the held-out ones (unset: `eval_fraction` of
`split`, by the deterministic split of data/split.py). Records become rows as data/records.py
says, the same mapping the local jsonl/parquet kinds use.

A hub id is resolved through the HF hub cache (models/hub.py): offline (`HF_HUB_OFFLINE=1` or
`HF_DATASETS_OFFLINE=1`) the cached snapshot is loaded as a local directory, or else whatever
`datasets` itself cached from an earlier online load; online `datasets` downloads as usual. Local
sources are read with a throwaway Arrow cache (`keep_in_memory`), leaving nothing in ~/.cache.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Literal

import pydantic

from asyncrl.data.files import quiet_datasets
from asyncrl.data.kind import DatasetKind
from asyncrl.data.records import RecordFields, records_to_rows
from asyncrl.data.split import DatasetError, Row, SplitRows, split_rows

# file suffix -> `datasets` packaged builder, for a `name` that is a single local file
FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
OFFLINE_VARS = ("HF_DATASETS_OFFLINE",)


class HFDatasetConfig(DatasetKind, RecordFields):
    kind: Literal["hf"] = "hf"  # anything datasets.load_dataset reads
    name: str = pydantic.Field(description="hub id (org/name) or a local directory or file")
    config: str | None = None  # the subset (load_dataset's second argument), e.g. "main"
    revision: str | None = None  # of a hub id: branch, tag or commit; None: main
    split: str = "train"  # the training rows
    eval_split: str | None = pydantic.Field(
        None, description="held-out split; None: hold out eval_fraction of `split`")
    eval_fraction: float = pydantic.Field(0.1, ge=0, le=1,
                                          description="ignored when eval_split is set")
    seed: int = 0  # of the eval_fraction hold-out

    @pydantic.model_validator(mode="after")
    def _revision_of_a_hub_id(self) -> HFDatasetConfig:
        # the obvious case only; `org/name` may still turn out local where the job runs
        if self.revision is not None and self.name.startswith(("/", ".", "~")):
            raise ValueError(f"revision={self.revision!r} applies to a hub id (org/name) only, "
                             f"and name={self.name!r} is a local path")
        return self

    def build(self) -> SplitRows:
        """Train/eval rows of a `datasets.load_dataset` source (one split, or two)."""
        splits = load_splits(self)

        def rows(name: str, field: str) -> list[Row]:
            records = pick_split(splits, name, self, field)
            return records_to_rows(records, self, f"{self.name}[{name}]")

        return split_rows(rows(self.split, "split"),
                          self.eval_split and (lambda: rows(self.eval_split, "eval_split")),
                          self.eval_fraction, self.seed)


def _load(source: str, cfg: HFDatasetConfig, local: bool) -> Any:
    """`datasets.load_dataset` of every split of `source` (a DatasetDict)."""
    import datasets

    file_builder = FILE_BUILDERS.get(Path(source).suffix.lower()) if local else None
    if local and file_builder is None and not Path(source).is_dir():
        allowed = ", ".join(FILE_BUILDERS)
        raise DatasetError(f"data.name={source}: not a directory nor a file ending in {allowed}")
    if not local:  # online, or offline from `datasets`' own cache: its defaults, as usual
        return datasets.load_dataset(source, cfg.config, revision=cfg.revision,
                                     keep_in_memory=True)
    with tempfile.TemporaryDirectory(prefix="asyncrl-datasets-") as cache:
        download = datasets.DownloadConfig(local_files_only=True, cache_dir=cache)
        if file_builder is not None:
            return datasets.load_dataset(file_builder, data_files=str(Path(source).resolve()),
                                         keep_in_memory=True, cache_dir=cache,
                                         download_config=download)
        return datasets.load_dataset(source, cfg.config, keep_in_memory=True, cache_dir=cache,
                                     download_config=download)


def _config_error(source: str, cfg: HFDatasetConfig, err: ValueError) -> DatasetError:
    """The one-line error for a ValueError of load_dataset: the subsets when the config is
    missing or unknown, else datasets' own first line."""
    import datasets

    try:
        names = datasets.get_dataset_config_names(source)
    except (ValueError, OSError):  # then datasets' own message is the best there is
        names = []
    if names and cfg.config is None and len(names) > 1:
        return DatasetError(f"data.name={cfg.name}: has several subsets; set data.config to one "
                            f"of: {', '.join(names)}")
    if names and cfg.config not in names:
        return DatasetError(f"data.name={cfg.name}: config={cfg.config!r} is not a subset of this "
                            f"dataset; allowed: {', '.join(names)}")
    return DatasetError(f"data.name={cfg.name}: cannot load: {str(err).splitlines()[0]}")


def load_splits(cfg: HFDatasetConfig) -> dict[str, list[dict[str, Any]]]:
    """split name -> its records, for every split the source has."""
    import datasets  # deferred, like models.hub (asyncrl.models imports transformers)

    from asyncrl.models.hub import HubCacheMiss, hub_offline, looks_local, snapshot_dir

    local = looks_local(cfg.name)
    source = str(Path(cfg.name).expanduser()) if local else cfg.name
    if local and not Path(source).exists():
        raise DatasetError(f"data.name={cfg.name}: not found; expected a local directory or "
                           "file, or a hub id (org/name)")
    if local and cfg.revision is not None:
        raise DatasetError(f"data.name={cfg.name}: revision={cfg.revision!r} applies to hub ids "
                           "(org/name) only, and this is a local path")
    miss = None
    if not local and hub_offline(*OFFLINE_VARS):
        try:
            source, local = str(snapshot_dir(cfg.name, repo_type="dataset", revision=cfg.revision,
                                             offline_vars=OFFLINE_VARS, setting="data.name")), True
        except HubCacheMiss as err:
            # `datasets` may still have it prepared in its own cache, which it reads without the
            # network only when it was offline from its import on (a real job's environment)
            if not (datasets.config.HF_HUB_OFFLINE or datasets.config.HF_DATASETS_OFFLINE):
                raise DatasetError(str(err)) from None
            miss = err
    try:
        with quiet_datasets():
            table = _load(source, cfg, local)
    except ValueError as err:  # datasets' way to say "no such config", among others
        raise (DatasetError(str(miss)) if miss else _config_error(source, cfg, err)) from None
    except (ConnectionError, FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as err:
        raise DatasetError(str(miss) if miss else f"data.name={cfg.name}: cannot load: "
                           f"{str(err).splitlines()[0]}") from None
    except datasets.exceptions.DatasetGenerationError as err:
        reason = str(err.__cause__ or err).splitlines()[0]
        raise DatasetError(f"data.name={cfg.name}: cannot read: {reason}") from None
    return {name: split.to_list() for name, split in table.items()}


def pick_split(splits: dict[str, list[dict[str, Any]]], name: str, cfg: HFDatasetConfig,
               field: str) -> list[dict[str, Any]]:
    if name not in splits:
        raise DatasetError(f"data.name={cfg.name}: {field}={name!r} not found; allowed: "
                           f"{', '.join(splits)}")
    if not splits[name]:
        raise DatasetError(f"data.name={cfg.name}: {field}={name!r} has no rows")
    return splits[name]
