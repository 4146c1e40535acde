"""Silence transformers' own progress bars (loading/saving shards) inside our progress output."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def quiet_hf_progress() -> Iterator[None]:
    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_on:
            hf_logging.enable_progress_bar()
