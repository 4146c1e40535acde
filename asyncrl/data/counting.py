"""The embedded counting task: rendered scenes of a few shapes, "How many objects are there?".

The vision-language counterpart of the arithmetic task, in CLEVR-Count-70K's spirit (the user's
documents' `clevr_count_70k`) with no download: each scene is a grey square of `image_size`
pixels holding `min_objects`..`max_objects` circles, squares and triangles of random colour and
size at random places (no two overlap, so every object is countable), drawn with PIL from a
seeded RNG, so a config always gives the same scenes. The answer is the count, as digits.

Rows carry their image in `images` (a list of one PIL image) and a chat prompt whose user turn is
an image part followed by the question; models/vision.py turns both into model inputs.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, ClassVar, Literal

import pydantic

from asyncrl.config import Config
from asyncrl.data.split import Row, SplitRows

if TYPE_CHECKING:
    from PIL import Image

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220),
           "yellow": (230, 200, 30), "purple": (140, 60, 180), "black": (20, 20, 20)}
# CLEVR's scenes are grey; this grey is the image processors' mean colour (CLIP's, which Qwen2-VL
# uses), so an empty patch is zero input and only the objects stand out
BACKGROUND = (123, 117, 104)


class CountingTaskConfig(Config):
    """Rendered counting scenes (the dataset kind for vision-language models)."""

    # the dataset (DATASETS: arithmetic | arithmetic_submit | chain | counting | gsm8k | jsonl | parquet | hf)
    kind: Literal["counting"] = "counting"
    has_images: ClassVar[bool] = True  # rows carry images: a vision-language model's task
    min_objects: int = pydantic.Field(1, ge=0)
    max_objects: int = pydantic.Field(6, ge=1, le=12)  # more do not fit apart at 112 px
    image_size: int = pydantic.Field(112, ge=56, le=1024)  # pixels per side
    num_train: int = pydantic.Field(4000, ge=0)
    num_eval: int = pydantic.Field(256, ge=0)  # held-out scenes (their own seed stream)
    seed: int = 0
    question: str = "How many objects are there?"
    # cells: each object sits somewhere inside its own cell of a grid of `cell_size`-pixel cells
    # (28 px: one image token of the tiny VLM, 14-px patches merged 2 x 2), which a small model
    # learns to count within minutes; free: anywhere, as CLEVR (slower to learn)
    layout: Literal["cells", "free"] = "cells"
    cell_size: int = pydantic.Field(28, ge=8)

    @pydantic.model_validator(mode="after")
    def _object_range(self) -> CountingTaskConfig:
        if self.min_objects > self.max_objects:
            raise ValueError(f"min_objects={self.min_objects} > max_objects={self.max_objects}")
        cells = (self.image_size // self.cell_size) ** 2
        if self.layout == "cells" and self.max_objects > cells:
            raise ValueError(f"max_objects={self.max_objects} does not fit the {cells} cells of "
                             f"{self.cell_size} px in image_size={self.image_size}; allowed "
                             f"max_objects <= {cells}, or layout 'free'")
        return self

    def build(self) -> SplitRows:
        return SplitRows([self.row("train", i) for i in range(self.num_train)],
                         [self.row("eval", i) for i in range(self.num_eval)])

    def row(self, split: str, index: int) -> Row:
        """Scene `index` of `split`: the same for the same config, whatever the other sizes."""
        rng = random.Random(f"{self.seed}:{split}:{index}")
        count = rng.randint(self.min_objects, self.max_objects)
        cell = self.cell_size if self.layout == "cells" else None
        image, objects = render_scene(rng, count, self.image_size, cell)
        return {"id": f"count-{split}-{index}", "question": self.question, "answer": str(count),
                "images": [image], "objects": objects,
                "messages": [{"role": "user", "content": [
                    {"type": "image"}, {"type": "text", "text": self.question}]}]}


def render_scene(rng: random.Random, count: int, size: int, cell: int | None = None
                 ) -> tuple[Image.Image, list[dict[str, object]]]:
    """A scene of `count` non-overlapping shapes, and what was drawn (shape, colour, box); with
    `cell`, each shape inside its own randomly chosen cell of that many pixels."""
    from PIL import Image, ImageDraw  # here: a run config loads without it

    image = Image.new("RGB", (size, size), BACKGROUND)
    draw = ImageDraw.Draw(image)
    boxes: list[tuple[int, int, int, int]] = []
    objects: list[dict[str, object]] = []
    low, high = max(6, size // 10), max(8, size // 5)
    per_side = size // cell if cell else 0
    cells = rng.sample(range(per_side * per_side), count) if cell else []
    while len(objects) < count:
        if cell:
            side = rng.randint(max(4, cell // 3), max(5, cell * 3 // 4))
            cy, cx = divmod(cells[len(objects)], per_side)
            x = cx * cell + rng.randint(1, cell - side - 1)
            y = cy * cell + rng.randint(1, cell - side - 1)
            box = (x, y, x + side, y + side)
        else:
            box = _free_place(rng, boxes, size, low, high, count)
            side, x, y = box[2] - box[0], box[0], box[1]
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        fill = COLOURS[colour]
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x + side / 2, y), (x, y + side), (x + side, y + side)], fill=fill)
        boxes.append(box)
        objects.append({"shape": shape, "colour": colour, "box": box})
    return image, objects


def _free_place(rng: random.Random, boxes: list[tuple[int, int, int, int]], size: int, low: int,
                high: int, count: int) -> tuple[int, int, int, int]:
    """Rejection sampling: a box apart from every one of `boxes`."""
    for _ in range(1000):
        side = rng.randint(low, high)
        x, y = rng.randint(1, size - side - 2), rng.randint(1, size - side - 2)
        box = (x, y, x + side, y + side)
        if all(box[2] + 2 < b[0] or b[2] + 2 < box[0] or box[3] + 2 < b[1]
               or b[3] + 2 < box[1] for b in boxes):
            return box
    raise ValueError(f"{count} objects do not fit apart in {size} px; lower max_objects "
                     "or raise image_size")
