"""Typed, component-owned configuration: YAML in, dotted CLI overrides, validation, YAML out.

Each component defines its own `Config` subclass next to its code; a run config nests them. Built
on pydantic so types and ranges are checked by a well-kept library; this module adds what users of
a training CLI expect: `a.b.c=value` overrides, unknown keys rejected with a did-you-mean hint,
one-line errors naming the field, the bad value and the allowed range, and a YAML dump that loads
back to an identical config.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from asyncrl.errors import UserError

C = TypeVar("C", bound="Config")


class ConfigError(UserError):
    """A configuration the user must fix; the message is one line per problem, no traceback."""


@dataclasses.dataclass(frozen=True)
class SpellOut:
    """Field metadata: how a raw value of the field is written out in full before defaults are
    laid under it (a plugin kind's shorthands: `reward: math` is `{kind: math}`)."""

    fn: typing.Callable[[Any], Any]


class Config(pydantic.BaseModel):
    """Base of every component config: unknown keys are errors, assignments are re-validated."""

    model_config = pydantic.ConfigDict(
        extra="forbid",
        validate_assignment=True,
        validate_default=True,
        # `name=123` on the command line parses as YAML int; a str field should still accept it.
        coerce_numbers_to_str=True,
    )

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any], source: str = "config") -> C:
        """Validate `data` laid over this class's defaults, so `train: {optimizer: {lr: 1e-4}}`
        changes only the learning rate and keeps the other values the preset chose."""
        data = merge_over_defaults(cls, spell_out(cls, cls.shorthand(data)))
        try:
            return cls.model_validate(data)
        except pydantic.ValidationError as err:
            raise ConfigError(format_validation_error(cls, err, data, source)) from None

    @classmethod
    def shorthand(cls, data: dict[str, Any]) -> dict[str, Any]:
        """Spell out a config's shorthands before defaults are laid under it (e.g. a union
        member implied by its keys); the base has none."""
        return data

    @classmethod
    def load(cls: type[C], path: str | Path | None = None, overrides: list[str] = ()) -> C:
        """Load YAML (or defaults when `path` is None) then apply `key.sub=value` overrides."""
        data = load_yaml(path) if path is not None else {}
        for item in overrides:
            key, value = parse_override(item)
            set_dotted(data, key, value)
        where = [str(path)] if path else []
        if overrides:
            where.append("the command line")
        return cls.from_dict(data, source=" + ".join(where) or "defaults")

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(self.to_yaml())


def _merge(base: Any, over: Any) -> Any:
    if not (isinstance(base, dict) and isinstance(over, dict)):
        return over
    if "kind" in over and base.get("kind") != over["kind"]:
        return over  # another member of a tagged union: its own defaults apply
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(base[key], value) if key in base else value
    return out


def spell_out(cls: Any, data: Any) -> Any:
    """`data` with every field that has `SpellOut` metadata written out, at any depth."""
    if not isinstance(data, dict):
        return data
    fields = getattr(cls, "model_fields", {})
    out = dict(data)
    for name, value in data.items():
        field = fields.get(name)
        if field is None:
            continue
        spell = next((m for m in field.metadata if isinstance(m, SpellOut)), None)
        if spell is not None:
            out[name] = spell.fn(value)
            continue
        nested = _config_classes(field.annotation)
        if len(nested) == 1:
            out[name] = spell_out(nested[0], value)
    return out


def merge_over_defaults(cls: type[Config], data: dict[str, Any]) -> dict[str, Any]:
    """`data` deep-merged over `cls()`'s values (as is, when the class has required fields)."""
    try:
        defaults = cls().model_dump(mode="python")
    except pydantic.ValidationError:
        return data
    return _merge(defaults, data)


def load_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found")
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{p}:{where}: malformed YAML: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of keys, got {type(data).__name__}")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """`actor.optimizer.lr=3e-4` -> ("actor.optimizer.lr", 3e-4); values are parsed as YAML."""
    key, sep, raw = item.partition("=")
    key = key.strip().lstrip("-")
    if not sep or not key:
        raise ConfigError(f"override {item!r} must look like key.sub=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    return key, value


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            prefix = ".".join(parts[: i + 1])
            raise ConfigError(f"override {key}: {prefix} is a value ({child!r}), not a section")
        node = child
    node[parts[-1]] = value


def _field_types(model: Any) -> dict[str, Any]:
    if isinstance(model, type) and issubclass(model, pydantic.BaseModel):
        return {k: f.annotation for k, f in model.model_fields.items()}
    if dataclasses.is_dataclass(model):
        return {f.name: f.type for f in dataclasses.fields(model)}
    return {}


def _config_classes(ann: Any) -> list[Any]:
    """Config classes an annotation can hold: X, X | None, Annotated[Union[A, B], ...]."""
    if _field_types(ann):
        return [ann]
    return [c for arg in typing.get_args(ann) for c in _config_classes(arg)]


def _walk(cls: Any, loc: tuple) -> tuple[tuple, list[str]]:
    """(loc without union tags, field names at the end of loc) for messages and hints.

    pydantic puts a tagged union's tag into the error location (data.gsm8k.path); users wrote
    data.path, so the tag is dropped from what we print.
    """
    shown: list[Any] = []
    classes = [cls]
    for part in loc:
        owner = next((c for c in classes if part in _field_types(c)), None)
        if owner is not None:
            shown.append(part)
            classes = _config_classes(_field_types(owner)[part])
            continue
        tagged = [c for c in classes if getattr(_field_types(c).get("kind"), "__args__", ()) and
                  part in typing.get_args(_field_types(c)["kind"])]
        if not tagged:
            shown.append(part)
            classes = []
            continue
        classes = tagged
    fields = list(_field_types(classes[0])) if len(classes) == 1 else []
    return tuple(shown), fields


def _value_at(data: Any, loc: tuple) -> Any:
    for part in loc:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return "<missing>"
    return data


def format_validation_error(
    cls: type[pydantic.BaseModel], err: pydantic.ValidationError, data: dict, source: str
) -> str:
    lines = []
    head = f"{source}: " if source else ""
    for e in err.errors():
        raw_loc = tuple(e["loc"])
        loc, _ = _walk(cls, raw_loc)
        dotted = ".".join(str(p) for p in loc)
        if e["type"] in ("extra_forbidden", "unexpected_keyword_argument"):
            _, allowed = _walk(cls, raw_loc[:-1])
            hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
            msg = f"{head}unknown key '{dotted}'"
            msg += f"; did you mean '{hint[0]}'?" if hint else ""
            msg += f" (allowed: {', '.join(allowed)})" if allowed else ""
        elif e["type"] == "missing":
            msg = f"{head}missing required key '{dotted}'"
        elif e["type"] == "value_error":  # our own checks already name the field and value
            where = f"{dotted}: " if dotted else ""
            msg = f"{head}{where}{e['msg'].removeprefix('Value error, ')}"
        else:
            value = _value_at(data, loc)
            text = e["msg"].removeprefix("Value error, ")
            msg = f"{head}{dotted}={value!r}: {text}"
        lines.append(msg)
    return "\n".join(lines)
