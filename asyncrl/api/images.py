"""A prompt's images, as requests and training samples carry them (api layer: torch-free)."""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ImageInputs:
    """A prompt's images as a vision-language model takes them (models/vision.py builds them):
    pixel patches [patches, features] and each image's (t, h, w) patch grid [images, 3], torch
    tensors (typed loosely: this module stays torch-free). `digest` names the content (equal
    images, equal digest). Samples of one prompt share one ImageInputs object.

    `pad_id` is the token that stands for each merged patch block in the prompt's ids,
    `vision_ids` every vision token id (pad, vision start/end, video pad), and `sources` the
    images the pixels came from (PIL, in order): what a server that processes images itself
    (vLLM) is sent, with each run of pads collapsed to one."""

    pixel_values: Any
    grid_thw: Any
    digest: str
    pad_id: int | None = None
    vision_ids: tuple[int, ...] = ()
    sources: tuple[Any, ...] = field(default=(), compare=False, repr=False)

    def data_urls(self) -> list[str]:
        """Each source image as a PNG data URL (lossless: a server's image processor sees the
        pixels this one did)."""
        if not self.sources:
            raise ValueError("these images carry no source images (sources=()), so they cannot "
                             "be sent to a server that processes images itself")
        urls = []
        for img in self.sources:
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            urls.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
        return urls

    def collapse_pads(self, ids: list[int]) -> list[int]:
        """`ids` with each run of `pad_id` reduced to one: the prompt form of a server that
        expands each image's placeholder itself (vLLM's token-in route)."""
        if self.pad_id is None:
            raise ValueError("these images name no pad_id, so their placeholders cannot be found")
        return [t for i, t in enumerate(ids) if t != self.pad_id or i == 0 or ids[i - 1] != t]
