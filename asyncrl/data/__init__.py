"""Datasets and synthetic tasks: every loader returns plain-dict rows with the same keys.

Row: {"id", "question", "answer" (exact final answer), "messages" (chat prompt), ...extras}.
Sources: the synthetic arithmetic task, GSM8K-format JSONL, generic local JSONL/parquet, and
anything `datasets.load_dataset` reads (`kind: hf`: hub ids from the HF cache, local dirs); pick
one with a `DatasetConfig` (the `DATASETS` registry, by `kind`) and call `.build()`.
"""

from asyncrl.data.arithmetic import ArithmeticTask, ArithmeticTaskConfig
from asyncrl.data.dataset import DATASETS, DatasetConfig, TaskDataset, parse_dataset_config
from asyncrl.data.files import FileDatasetConfig
from asyncrl.data.gsm8k import GSM8KConfig
from asyncrl.data.hf import HFDatasetConfig
from asyncrl.data.split import DatasetError, Row, SplitRows, deterministic_split

__all__ = [
    "ArithmeticTask", "ArithmeticTaskConfig", "DatasetConfig", "DatasetError",
    "FileDatasetConfig", "GSM8KConfig", "HFDatasetConfig", "Row", "SplitRows", "TaskDataset",
    "DATASETS", "deterministic_split", "parse_dataset_config",
]
