"""What every dataset kind's config is: the base class of the `DATASETS` registry (data/dataset.py).

A dataset config has a `kind` (its name in the registry) and `build()`, which returns the dataset
(two lists of rows, data/split.py). It declares as class attributes what the rest of a run checks
it against: `has_images`, whether its rows carry images (a vision-language model's task).
"""

from __future__ import annotations

from typing import Any, ClassVar

from asyncrl.config import Config


class DatasetKind(Config):
    """The base of every dataset config (`DATASETS.register` refuses any other class)."""

    has_images: ClassVar[bool] = False  # rows carry images: a vision-language model's task

    def build(self) -> Any:
        """The dataset (`train_rows()`, `eval_rows()`); every kind defines it."""
        raise NotImplementedError(f"{type(self).__name__} does not define build()")
