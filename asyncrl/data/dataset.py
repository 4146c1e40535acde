"""Choosing a dataset from config: the `DATASETS` registry (asyncrl/plugins.py), each kind a config
whose `build()` returns its dataset.

A YAML `data: {kind: gsm8k, path: ...}` validates into the matching config class; a mapping
without `kind` is the embedded arithmetic task, so `data.num_train=200` on the command line tunes
the default. A new source is one config class deriving from `DatasetKind` (data/kind.py) with
`kind` and `build()`, and `DATASETS.register`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from asyncrl.config import ConfigError
from asyncrl.data.arithmetic import ArithmeticTaskConfig
from asyncrl.data.arithmetic_submit import ArithmeticSubmitTaskConfig
from asyncrl.data.chain import ChainTaskConfig
from asyncrl.data.counting import CountingTaskConfig
from asyncrl.data.files import FileDatasetConfig
from asyncrl.data.gsm8k import GSM8KConfig
from asyncrl.data.hf import HFDatasetConfig
from asyncrl.data.kind import DatasetKind
from asyncrl.data.split import Row
from asyncrl.plugins import Registry


class TaskDataset(Protocol):
    """What trainers and workflows need from a dataset: two lists of rows (see data/split.py)."""

    def train_rows(self) -> list[Row]: ...

    def eval_rows(self) -> list[Row]: ...


DATASETS: Registry = Registry("dataset", base=DatasetKind, default_kind="arithmetic")
for _cls in (ArithmeticTaskConfig, ArithmeticSubmitTaskConfig, ChainTaskConfig, CountingTaskConfig,
             GSM8KConfig, FileDatasetConfig, HFDatasetConfig):
    DATASETS.register(_cls)

DatasetConfig = DATASETS.field()


def parse_dataset_config(data: Mapping[str, Any], source: str = "data") -> Any:
    """A dataset config from a plain mapping (e.g. `asyncrl eval --data '{kind: hf, ...}'`),
    with one-line errors prefixed by `source`."""
    try:
        return DATASETS.parse(data)
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
