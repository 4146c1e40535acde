"""Choosing a dataset from config: a discriminated union on `kind`, each member building itself.

A YAML `data: {kind: gsm8k, path: ...}` validates straight into the matching config class (pydantic
dispatches on `kind`; a missing `kind` means the arithmetic task), and `cfg.build()` returns its
dataset, so adding a source means adding a config class to the union, not a dispatcher branch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Protocol, Union, get_args

import pydantic

from asyncrl.config import ConfigError
from asyncrl.data.arithmetic import ArithmeticTaskConfig
from asyncrl.data.files import FileDatasetConfig
from asyncrl.data.gsm8k import GSM8KConfig
from asyncrl.data.hf import HFDatasetConfig
from asyncrl.data.split import Row


class TaskDataset(Protocol):
    """What trainers and workflows need from a dataset: two lists of rows (see data/split.py)."""

    def train_rows(self) -> list[Row]: ...

    def eval_rows(self) -> list[Row]: ...


DATASET_CONFIGS = (ArithmeticTaskConfig, GSM8KConfig, FileDatasetConfig, HFDatasetConfig)

# kind -> config class, read off the `kind` Literals so it cannot drift from the classes.
CONFIG_BY_KIND: dict[str, type] = {
    kind: cls for cls in DATASET_CONFIGS for kind in get_args(cls.model_fields["kind"].annotation)
}

# A section without `kind` is the embedded default task, so `data.num_train=200` on the command
# line tunes the default instead of failing with "unable to extract tag".
DEFAULT_KIND = "arithmetic"


def dataset_kind(value: Any) -> str | None:
    """The union's discriminator: `kind` of a mapping (default DEFAULT_KIND) or of a config."""
    if isinstance(value, Mapping):
        return value.get("kind", DEFAULT_KIND)
    return getattr(value, "kind", None)


DatasetConfig = Annotated[
    Union[
        Annotated[ArithmeticTaskConfig, pydantic.Tag("arithmetic")],
        Annotated[GSM8KConfig, pydantic.Tag("gsm8k")],
        Annotated[FileDatasetConfig, pydantic.Tag("jsonl")],
        Annotated[FileDatasetConfig, pydantic.Tag("parquet")],
        Annotated[HFDatasetConfig, pydantic.Tag("hf")],
    ],
    pydantic.Discriminator(dataset_kind),
]


def parse_dataset_config(data: Mapping[str, Any], source: str = "data") -> DatasetConfig:
    """A dataset config from a plain mapping, with the same one-line errors as `Config.from_dict`.

    Looking the class up by `kind` first (rather than validating the union) keeps unknown-key
    errors free of the union's tag in the key path, so they get the did-you-mean hint.
    """
    kind = dataset_kind(data)
    cls = CONFIG_BY_KIND.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ConfigError(f"{source}: kind={kind!r}: unknown dataset kind; "
                          f"allowed: {', '.join(CONFIG_BY_KIND)}")
    return cls.from_dict(dict(data), source)


def load_dataset_from_config(cfg: DatasetConfig | Mapping[str, Any],
                             source: str = "data") -> TaskDataset:
    """Build the dataset a config (or a plain `{kind: ..., ...}` mapping) describes."""
    if isinstance(cfg, Mapping):
        cfg = parse_dataset_config(cfg, source)
    return cfg.build()
