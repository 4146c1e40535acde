"""Every field of a config with its value, its default and what it means (`--print-config`).

A field's description is its `Field(description=...)`, else the comment written next to it in
the class (the `#` lines right above the field, or at the end of its line): configs document
their fields with comments, and reading them here keeps one place to write them. Nested
configs are walked section by section; a union section (data, workflow) shows the member the
config holds.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import textwrap
import tokenize
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args, get_origin

import annotated_types
import pydantic


@dataclass(frozen=True)
class FieldDoc:
    key: str  # dotted path, e.g. train.optimizer.lr
    value: Any
    default: Any  # the value the same key has in the config class's own defaults
    description: str


def _comments_by_line(source: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment block above it (contiguous `#` lines) plus its line's comment,
    for fields assigned in `cls`'s own body."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    lines = source.splitlines()
    comments = _comments_by_line(source)
    body = ast.parse(source).body[0]
    out: dict[str, str] = {}
    for node in getattr(body, "body", []):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above: list[str] = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments.get(line, ""))
            line -= 1
        inline = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]
        text = " ".join(part for part in [*above, *inline] if part)
        if text:
            out[node.target.id] = text
    return out


def _fields(cls: type) -> dict[str, Any]:
    """name -> (annotation, metadata, description) of a pydantic model's or a dataclass's fields."""
    if isinstance(cls, type) and issubclass(cls, pydantic.BaseModel):
        return {n: (f.annotation, f.metadata, f.description or "")
                for n, f in cls.model_fields.items()}
    if dataclasses.is_dataclass(cls):
        hints = typing_hints(cls)
        return {f.name: (hints.get(f.name), [], "") for f in dataclasses.fields(cls)}
    return {}


def typing_hints(cls: type) -> dict[str, Any]:
    import typing

    try:
        return typing.get_type_hints(cls)
    except (NameError, TypeError):
        return {}


def _allowed(annotation: Any, metadata: list[Any]) -> str:
    """'allowed: a | b' for Literal fields, the range for constrained numbers."""
    options = [a for arg in (get_args(annotation) or (annotation,)) if get_origin(arg) is Literal
               for a in get_args(arg)] if get_origin(annotation) is not Literal else list(
        get_args(annotation))
    if options:
        return "allowed: " + " | ".join(json.dumps(o) for o in options)
    bounds = []
    for item in metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if isinstance(item, getattr(annotated_types, attr.capitalize())):
                bounds.append(f"{sign} {getattr(item, attr)}")
    return "range: " + ", ".join(bounds) if bounds else ""


def describe_field(cls: type, name: str) -> str:
    """`cls.name`'s description: Field(description=...), else its comment in the nearest class
    of the MRO that assigns it; followed by the allowed values or range the type says."""
    annotation, metadata, text = _fields(cls)[name]
    if not text:
        for klass in cls.__mro__:
            if name in vars(klass).get("__annotations__", {}):
                text = field_comments(klass).get(name, "")
                break
    allowed = _allowed(annotation, metadata)
    return f"{text} ({allowed})" if text and allowed else text or allowed


def _is_config(value: Any) -> bool:
    return bool(_fields(type(value)))


def _at(value: Any, name: str) -> Any:
    return getattr(value, name) if name in _fields(type(value)) else _MISSING


_MISSING = object()


def walk_fields(cfg: Any, defaults: Any = _MISSING,
                prefix: str = "") -> Iterator[FieldDoc]:
    """Every leaf field of `cfg` in declaration order; `defaults` is the same config built from
    defaults only (nested sections keep the defaults their parent chose for them)."""
    if defaults is _MISSING:
        try:
            defaults = type(cfg)()
        except (pydantic.ValidationError, TypeError):  # required fields: no default config
            defaults = None
    for name in _fields(type(cfg)):
        value = getattr(cfg, name)
        default = _at(defaults, name)
        if _is_config(value) and (default is _MISSING or default is None
                                  or type(default) is type(value)):
            yield from walk_fields(value, default if _is_config(default) else None,
                                   f"{prefix}{name}.")
            continue
        if _is_config(value):  # another union member than the default: its own defaults apply
            yield from walk_fields(value, prefix=f"{prefix}{name}.")
            continue
        yield FieldDoc(f"{prefix}{name}", value, default, describe_field(type(cfg), name))


def _show(value: Any) -> str:
    if value is _MISSING:
        return "-"
    if isinstance(value, pydantic.BaseModel):
        value = value.model_dump(mode="json")
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


def format_config(cfg: Any) -> str:
    """One block per field: `key = value` (with `(default ...)` when it differs), then its
    description indented below."""
    blocks = []
    for doc in walk_fields(cfg):
        value, default = _show(doc.value), _show(doc.default)
        head = f"{doc.key} = {value}"
        if default != value:
            head += f"   (default {default})"
        text = textwrap.fill(doc.description, width=96, initial_indent="    ",
                             subsequent_indent="    ") if doc.description else ""
        blocks.append(head + ("\n" + text if text else ""))
    return "\n".join(blocks)
