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
    module = import_module(module_name, f"{what} {path!r}")
    try:
        return getattr(module, attr)
    except AttributeError as err:
        raise UserError(f"{what} {path!r}: module {module_name!r} has no {attr!r}") from err


def import_module(module_name: str, what: str) -> Any:
    """The module, or a one-line UserError starting with `what`: a module that is not there
    says where Python looked and how to add a directory."""
    importable_from_cwd(module_name)
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not module_name.startswith(err.name):
            raise UserError(f"{what}: importing module {module_name!r} failed: {err}") from err
        looked = ", ".join(dict.fromkeys(p for p in sys.path if p and os.path.isdir(p)))
        raise UserError(
            f"{what}: no module {err.name!r} in the working directory ({os.getcwd()}) or on "
            f"Python's path ({looked}); run from the directory that holds "
            f"{err.name.replace('.', '/')}(.py), or add that directory to PYTHONPATH "
            "(PYTHONPATH=/path/to/dir asyncrl train ...)") from err
    except ImportError as err:
        raise UserError(f"{what}: cannot import module {module_name!r}: {err}") from err


def importable_from_cwd(module_name: str) -> None:
    """Let `examples.x.agent:Agent` resolve from the working directory, as `python -m` would,
    when launched through the `asyncrl` console script (whose sys.path lacks the cwd). Spawned
    subprocesses inherit sys.path, so they can unpickle the same objects."""
    top = module_name.split(".")[0]
    cwd = os.getcwd()
    if importlib.util.find_spec(top) is None and (
            os.path.isdir(os.path.join(cwd, top)) or os.path.isfile(os.path.join(cwd, top + ".py"))):
        sys.path.append(cwd)
