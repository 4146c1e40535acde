"""Objects named by dotted paths in configs (`package.module:name`), with one-line errors."""

from __future__ import annotations

import importlib
from typing import Any

from asyncrl.errors import UserError


def import_object(path: str, what: str = "object") -> Any:
    """`package.module:attr` (or `package.module.attr`) -> the object, with one-line errors."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise UserError(f"{what} {path!r}: expected 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"{what} {path!r}: cannot import module {module_name!r}: {err}") from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise UserError(f"{what} {path!r}: module {module_name!r} has no {attr!r}") from err
