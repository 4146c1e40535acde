"""A prompt's images, as requests and training samples carry them (api layer: torch-free)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageInputs:
    """A prompt's images as a vision-language model takes them (models/vision.py builds them):
    pixel patches [patches, features] and each image's (t, h, w) patch grid [images, 3], torch
    tensors (typed loosely: this module stays torch-free). `digest` names the content (equal
    images, equal digest). Samples of one prompt share one ImageInputs object."""

    pixel_values: Any
    grid_thw: Any
    digest: str
