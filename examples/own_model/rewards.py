"""A reward of one's own, as `reward: package.module:function` names it (configs/train_hf.yaml).

asyncrl calls it as `score(completion, row)`: the completion's text (the reasoning stripped when
`model.reasoning_parser` is set) and the data row it answers (`row["answer"]` is the dataset's
answer column). Return a float; a sync function runs on a thread, off the event loop.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_answer(text: str) -> str | None:
    """The text after the last '####', else the last number in the text."""
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def score(completion: str, row: dict) -> float:
    """1.0 when the final answer equals the row's (numbers compared as numbers), else 0.0."""
    got, want = final_answer(completion), str(row["answer"]).rsplit("####", 1)[-1].strip()
    if got is None:
        return 0.0
    try:
        return float(float(got.replace(",", "")) == float(want.replace(",", "")))
    except ValueError:
        return float(got == want)
