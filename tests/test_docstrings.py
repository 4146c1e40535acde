"""Every name `asyncrl` exports has a docstring of its own, and so has every public method of an
exported class.

The API reference is generated from these docstrings, so a public name without one is a hole in
the documentation. A class counts only with `__doc__` set in its own body: one inherited from
pydantic's BaseModel or `object`, or the signature a dataclass writes in when there is none, says
nothing about the class. Methods, classmethods, staticmethods and properties are those defined on
the class itself (`vars(cls)`); data fields and pydantic's generated attributes are not methods.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import asyncrl


def _own_doc(cls: type) -> str:
    """The class's own docstring, or "" when it has none (a dataclass's generated signature
    counts as none)."""
    doc = vars(cls).get("__doc__") or ""
    if dataclasses.is_dataclass(cls) and doc.startswith(f"{cls.__name__}("):
        return ""
    return doc.strip()


def _function_of(attr: Any) -> Any:
    """The function behind a method, classmethod, staticmethod or property; None otherwise."""
    if isinstance(attr, (classmethod, staticmethod)):
        return attr.__func__
    if isinstance(attr, property):
        return attr.fget
    if inspect.isfunction(attr):
        return attr
    return None


def _missing_docstrings() -> list[str]:
    missing = []
    for name in asyncrl.__all__:
        obj = getattr(asyncrl, name)
        if inspect.isclass(obj):
            if not _own_doc(obj):
                missing.append(f"{name} (class)")
            for attr_name, attr in vars(obj).items():
                fn = _function_of(attr)
                if attr_name.startswith("_") or fn is None:
                    continue
                if not (fn.__doc__ or "").strip():
                    missing.append(f"{name}.{attr_name}")
        elif inspect.isfunction(obj):
            if not (obj.__doc__ or "").strip():
                missing.append(name)
    return missing


def test_every_exported_name_and_public_method_has_a_docstring():
    missing = _missing_docstrings()
    assert missing == [], f"exported names without a docstring of their own: {missing}"


def test_inherited_and_generated_class_docstrings_do_not_count():
    """Guards the check itself: a pydantic model or a dataclass without a docstring fails it."""
    from asyncrl.config import Config

    class Bare(Config):
        x: int = 0

    @dataclasses.dataclass
    class Plain:
        x: int = 0

    assert Plain.__doc__  # the dataclass's generated signature: present, but says nothing
    assert _own_doc(Bare) == "" and _own_doc(Plain) == ""
    assert _function_of(vars(asyncrl.Sample)["num_generated"]) is not None
