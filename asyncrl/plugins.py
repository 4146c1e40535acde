"""The one plugin pattern: every pluggable kind (dataset, reward, workflow, loss, inference backend,
launcher) is chosen by a config whose `build(...)` makes it (torchtitan's `Configurable`).

A `Registry` maps each name of a kind (`kind: math`) to its config class; a run config's field of
that kind (`Registry.field()`) takes the name alone (`reward: math`), a mapping with a `kind`
(`reward: {kind: judge, model: ...}`), a shorthand the registry spells out (`reward: pkg.mod:fn`),
or a built config. Validation, the one-line errors naming the allowed kinds, `--print-config` and
the CLI's choices all read the registry, so a new kind is one config class and one `register`
line, in the package or in the user's own code: `plugins: [my_pkg.plugins]` in a run config
imports such modules before the rest of the config is read.

Each registry has a base class every kind's config derives from (a run config's field is typed
as it, so a validator reads any kind's declarations as attributes): a plugin config declares what
it supports as class attributes of that base (a backend: its weight transports, LoRA, the server
versions tested, images; a dataset: whether its rows carry images), and `register` refuses a class
that leaves one unmade.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Generic, TypeVar, get_args

import pydantic

from asyncrl.config import Config, ConfigError, SpellOut, format_validation_error
from asyncrl.imports import import_module

P = TypeVar("P", bound=Config)
Shorthand = Callable[[str], Mapping[str, Any]]


class Registry(Generic[P]):
    """The kinds of one pluggable thing (`what` names it in errors: "reward", "dataset")."""

    def __init__(self, what: str, *, base: type[P] = Config,  # type: ignore[assignment]
                 shorthand: Shorthand | None = None, default_kind: str | None = None,
                 infer_kind: Callable[[Mapping[str, Any]], str | None] | None = None) -> None:
        """`base`: the class every kind's config derives from (what a run config's field of this
        kind is typed as); its class attributes annotated without a value are declarations each
        kind must make."""
        self.what, self.base = what, base
        self._shorthand = shorthand  # a string that is not a kind name -> the mapping it means
        self._default_kind = default_kind  # the kind of a mapping without one
        self._infer_kind = infer_kind  # or the kind its keys imply
        self._classes: dict[str, type[P]] = {}

    def register(self, cls: type[P]) -> type[P]:
        """Add `cls` under every name its `kind: Literal[...]` field allows (a decorator).
        TypeError if it does not derive from `base` or leaves a declaration of it unmade."""
        if not (isinstance(cls, type) and issubclass(cls, self.base)):
            raise TypeError(f"a {self.what} config must derive from {self.base.__module__}."
                            f"{self.base.__qualname__}; {cls!r} does not")
        missing = [name for name in getattr(self.base, "__annotations__", {})
                   if name in self.base.__class_vars__ and not hasattr(cls, name)]
        if missing:
            raise TypeError(f"{cls.__qualname__} does not declare {missing} (class attributes "
                            f"every {self.what} kind sets: see {self.base.__qualname__})")
        field = cls.model_fields.get("kind")
        names = get_args(field.annotation) if field is not None else ()
        if not names or not all(isinstance(n, str) for n in names):
            raise TypeError(f"{cls.__name__} needs a `kind: Literal['name', ...]` field to be "
                            f"registered as a {self.what}")
        for name in names:
            other = self._classes.get(name)
            if other is not None and other is not cls:
                raise ValueError(f"{self.what} kind {name!r} is taken by {other.__qualname__}; "
                                 f"{cls.__qualname__} needs another name")
            self._classes[name] = cls
        return cls

    def kinds(self) -> list[str]:
        return list(self._classes)

    def config_class(self, kind: Any) -> type[P]:
        if kind not in self._classes:
            raise ConfigError(f"{self.what} kind={kind!r} is not known; allowed: "
                              f"{', '.join(self._classes)}")
        return self._classes[kind]

    def spell_out(self, value: Any) -> Any:
        """A name or a shorthand as the mapping it means; a mapping with the kind it implies
        (anything else as it is, for `parse` to refuse)."""
        if isinstance(value, str):
            return {"kind": value} if value in self._classes or self._shorthand is None \
                else dict(self._shorthand(value))
        if isinstance(value, Mapping) and "kind" not in value:
            kind = self._infer_kind(value) if self._infer_kind is not None else None
            kind = kind or self._default_kind
            if kind is not None:
                return {"kind": kind, **value}
        return value

    def parse(self, value: Any) -> P:
        """The typed config `value` names (see the module docstring); ConfigError otherwise."""
        if isinstance(value, Config) and type(value) in self._classes.values():
            return value  # type: ignore[return-value]
        value = self.spell_out(value)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{self.what}={value!r}: expected a name or a mapping with a "
                              f"'kind'; allowed kinds: {', '.join(self._classes)}")
        data = dict(value)
        if "kind" not in data:
            raise ConfigError(f"{self.what}={value!r}: a mapping needs a 'kind'; allowed: "
                              f"{', '.join(self._classes)}")
        cls = self.config_class(data["kind"])
        try:
            return cls.model_validate(data)
        except pydantic.ValidationError as err:
            # one line per problem, keys relative to this field (the caller names the field)
            raise ConfigError(format_validation_error(cls, err, data, "")) from None

    def field(self) -> Any:
        """The annotation of a run-config field of this kind."""
        return Annotated[self.base, SpellOut(self.spell_out),
                         pydantic.BeforeValidator(self._validate), pydantic.PlainSerializer(_dump)]

    def _validate(self, value: Any) -> P:
        try:
            return self.parse(value)
        except ConfigError as err:
            raise ValueError(str(err).replace("\n", "; ")) from None


def _dump(value: Config, info: pydantic.SerializationInfo) -> dict[str, Any]:
    return value.model_dump(mode=info.mode)


def import_plugins(modules: Iterable[str], setting: str = "plugins") -> None:
    """Import each `package.module` so the kinds it registers exist (a user's plugins)."""
    for name in modules:
        import_module(name, f"{setting}: {name!r}")
