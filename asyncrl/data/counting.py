"""The embedded counting task: rendered scenes of a few shapes, "How many objects are there?".

The vision-language counterpart of the arithmetic task, in CLEVR-Count-70K's spirit (the user's
documents' `clevr_count_70k`) with no download: each scene is a grey square of `image_size`
pixels holding `min_objects`..`max_objects` circles, squares and triangles of random colour and
size at random places (no two overlap, so every object is countable), drawn with PIL from a
seeded RNG, so a config always gives the same scenes. The answer is the count, as digits.

The harder variant (`questions: attributes`) asks about a subset, as CLEVR does: "How many red
squares are there?", "How many circles are there?", "How many blue objects are there?" (a colour,
a shape or both, drawn from what the scene holds half the time, so answers of 0 occur), and
`occlusion` lets an object cover part of those drawn before it (free layout; up to that share of
the smaller one's box, so each stays visible).

Rows carry their image in `images` (a list of one PIL image) and a chat prompt whose user turn is
an image part followed by the question; models/vision.py turns both into model inputs.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, ClassVar, Literal

import pydantic

from asyncrl.data.kind import DatasetKind
from asyncrl.data.split import Row, SplitRows

if TYPE_CHECKING:
    from PIL import Image

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 160, 60), "blue": (40, 80, 220),
           "yellow": (230, 200, 30), "purple": (140, 60, 180), "black": (20, 20, 20)}
# CLEVR's scenes are grey; this grey is the image processors' mean colour (CLIP's, which Qwen2-VL
# uses), so an empty patch is zero input and only the objects stand out
BACKGROUND = (123, 117, 104)


class CountingTaskConfig(DatasetKind):
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
    # total: every row asks `question`; attributes: each asks for a colour, a shape or both
    # (left out of a saved config at its default, as `occlusion`: the warm starts cached for the
    # plain variant keep their keys)
    questions: Literal["total", "attributes"] = pydantic.Field(
        "total", exclude_if=lambda v: v == "total")
    # layout free: the largest share of the smaller box two objects may overlap by (0: apart)
    occlusion: float = pydantic.Field(0.0, ge=0.0, le=0.5, exclude_if=lambda v: v == 0.0)

    @pydantic.model_validator(mode="after")
    def _object_range(self) -> CountingTaskConfig:
        if self.min_objects > self.max_objects:
            raise ValueError(f"min_objects={self.min_objects} > max_objects={self.max_objects}")
        if self.occlusion and self.layout != "free":
            raise ValueError(f"occlusion={self.occlusion} needs layout 'free' (a cell holds one "
                             f"object); layout={self.layout!r}")
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
        image, objects = render_scene(rng, count, self.image_size, cell, self.occlusion)
        question, answer = self.question, count
        if self.questions == "attributes":
            question, answer = attribute_question(rng, objects)
        return {"id": f"count-{split}-{index}", "question": question, "answer": str(answer),
                "images": [image], "objects": objects,
                "messages": [{"role": "user", "content": [
                    {"type": "image"}, {"type": "text", "text": question}]}]}


def attribute_question(rng: random.Random, objects: list[dict[str, object]]) -> tuple[str, int]:
    """A question about a colour, a shape or both (taken from an object of the scene half the
    time, else from all of them), and how many objects of the scene match it."""
    seen = rng.choice(objects) if objects and rng.random() < 0.5 else None
    colour = seen["colour"] if seen else rng.choice(list(COLOURS))
    shape = seen["shape"] if seen else rng.choice(SHAPES)
    kind = rng.choice(("colour", "shape", "both"))
    if kind == "colour":
        shape = None
    elif kind == "shape":
        colour = None
    noun = f"{shape}s" if shape else "objects"
    question = f"How many {colour + ' ' if colour else ''}{noun} are there?"
    answer = sum((colour is None or o["colour"] == colour) and (shape is None or o["shape"] == shape)
                 for o in objects)
    return question, answer


def render_scene(rng: random.Random, count: int, size: int, cell: int | None = None,
                 occlusion: float = 0.0) -> tuple[Image.Image, list[dict[str, object]]]:
    """A scene of `count` shapes, and what was drawn (shape, colour, box); with `cell`, each
    shape inside its own randomly chosen cell of that many pixels, else anywhere, overlapping
    another by at most `occlusion` of the smaller box."""
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
            box = _free_place(rng, boxes, size, low, high, count, occlusion)
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
                high: int, count: int, occlusion: float = 0.0) -> tuple[int, int, int, int]:
    """Rejection sampling: a box apart from every one of `boxes` (or overlapping each by at most
    `occlusion` of the smaller one's area)."""
    for _ in range(1000):
        side = rng.randint(low, high)
        x, y = rng.randint(1, size - side - 2), rng.randint(1, size - side - 2)
        box = (x, y, x + side, y + side)
        if all(_overlap(box, b) <= occlusion if occlusion else (
                box[2] + 2 < b[0] or b[2] + 2 < box[0] or box[3] + 2 < b[1] or b[3] + 2 < box[1])
               for b in boxes):
            return box
    raise ValueError(f"{count} objects do not fit apart in {size} px; lower max_objects "
                     "or raise image_size")


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> float:
    """The area two boxes share, over the smaller one's."""
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    if w <= 0 or h <= 0:
        return 0.0
    smaller = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
    return w * h / smaller
