"""Objects named by dotted paths in configs (`package.module:name`), with one-line errors."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import Any

from asyncrl.errors import UserError


def import_object(path: str, what: str = "object") -> Any:
    """`package.module:attr` (or `package.module.attr`) -> the object, with one-line errors."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise UserError(f"{what} {path!r}: expected 'package.module:name'")
    importable_from_cwd(module_name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise UserError(f"{what} {path!r}: cannot import module {module_name!r}: {err}") from err
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise UserError(f"{what} {path!r}: module {module_name!r} has no {attr!r}") from err


def importable_from_cwd(module_name: str) -> None:
    """Let `examples.x.agent:Agent` resolve from the working directory, as `python -m` would,
    when launched through the `asyncrl` console script (whose sys.path lacks the cwd). Spawned
    subprocesses inherit sys.path, so they can unpickle the same objects."""
    top = module_name.split(".")[0]
    cwd = os.getcwd()
    if importlib.util.find_spec(top) is None and (
            os.path.isdir(os.path.join(cwd, top)) or os.path.isfile(os.path.join(cwd, top + ".py"))):
        sys.path.append(cwd)
