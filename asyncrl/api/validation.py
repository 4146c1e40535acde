"""Range checks for stdlib dataclasses in the api layer.

`assert` disappears under `python -O`; these raise ValueError naming the field, its value and the
allowed range, which is the message a user needs to fix a config.
"""

from __future__ import annotations

from typing import Any


def check_range(
    name: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
) -> None:
    """Raise ValueError unless lo <= value <= hi (lo < value when lo_open)."""
    too_low = lo is not None and (value <= lo if lo_open else value < lo)
    too_high = hi is not None and value > hi
    if too_low or too_high:
        left = "(" if lo_open else "["
        lo_s = "-inf" if lo is None else repr(lo)
        hi_s = "inf" if hi is None else repr(hi)
        raise ValueError(f"{name}={value!r} is out of range; allowed {left}{lo_s}, {hi_s}]")


def check_choice(name: str, value: Any, allowed: list[Any] | tuple[Any, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed; choose one of {list(allowed)}")
