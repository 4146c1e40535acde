"""A picture of an evaluation: the first held-out rows that have images, each drawn with its
question (shortened), the model's greedy answer under it (green when its reward counts as
correct, red otherwise) and the reference answer, tiled into one PNG in the run directory. People would rather look than read.

`eval_grid_initial.png` is the evaluation before the first update, `eval_grid.png` the latest;
each is rewritten atomically, so a viewer never reads half a file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from asyncrl.rollout.answer_eval import CORRECT_THRESHOLD

GRID_FILE, INITIAL_GRID_FILE = "eval_grid.png", "eval_grid_initial.png"
TILE = 160  # pixels per image side in the grid
CAPTION = 48  # pixels of text under each image
COLUMNS = 4


def first_image(row: Mapping[str, Any]) -> Any:
    """The row's first image (its `images` list, or an image part of its messages), else None."""
    from asyncrl.models.vision import load_image, message_images

    if row.get("images"):
        return load_image(row["images"][0])
    found = message_images(row.get("messages") or [], [])
    return found[0] if found else None


def save_eval_grid(path: Path, rows: Sequence[Mapping[str, Any]],
                   answers: Mapping[str, tuple[str, float]], title: str, count: int = 8
                   ) -> Path | None:
    """Draw up to `count` of `rows` that have images and an answer; None when none has both."""
    from PIL import Image, ImageDraw

    picked = []
    for i, row in enumerate(rows):
        key = str(row.get("id", i))
        if key in answers and (row.get("images") or _has_image_part(row)):
            picked.append((row, *answers[key]))
        if len(picked) == count:
            break
    if not picked:
        return None
    cols = min(COLUMNS, len(picked))
    rows_n = -(-len(picked) // cols)
    sheet = Image.new("RGB", (cols * TILE, 24 + rows_n * (TILE + CAPTION)), "white")
    draw = ImageDraw.Draw(sheet)
    draw.text((6, 6), title, fill="black")
    for k, (row, text, reward) in enumerate(picked):
        x, y = (k % cols) * TILE, 24 + (k // cols) * (TILE + CAPTION)
        image = first_image(row)
        if image is not None:
            sheet.paste(image.resize((TILE - 8, TILE - 8)), (x + 4, y + 4))
        answer = " ".join(text.split())[:22] or "(empty)"
        colour = (20, 140, 40) if reward > CORRECT_THRESHOLD else (200, 30, 30)
        question = str(row.get("question", "")).removeprefix("How many ").removesuffix(
            " are there?")
        draw.text((x + 6, y + TILE), f"q: {question[:24]}", fill="black")
        draw.text((x + 6, y + TILE + 14), f"model: {answer}", fill=colour)
        draw.text((x + 6, y + TILE + 28), f"answer: {row.get('answer', '?')}", fill="black")
    tmp = path.with_suffix(".tmp.png")
    sheet.save(tmp)
    os.replace(tmp, path)
    return path


def _has_image_part(row: Mapping[str, Any]) -> bool:
    from asyncrl.models.vision import message_has_images

    return message_has_images(row.get("messages") or [])
