"""Options: frozen dataclasses whose fields carry their help, and named registries of them.

Every configurable thing in thinwire (a method, a model, a dataset, a codec) declares its options
as a frozen dataclass built with :func:`opt`, validating itself in ``__post_init__`` with
:func:`check`. A bad value raises :class:`OptionError` (a :class:`~thinwire.errors.UsageError`),
whose one-line message names the option and the fix.

A :class:`Registry` maps names to entries that live in their own modules (``"module:attr"``),
imported on first use, so a new method, model or dataset is one file plus one registry line and
nothing else in the library names it.

Why not a CLI/config library. jsonargparse 4.53 and tyro 1.0.16 were tried on a two-method
miniature of ``[method]`` (frozen option dataclasses, a per-method option given to the wrong
method, a bad value, a value that ``__post_init__`` rejects); neither keeps what this module and
:mod:`thinwire.config` promise:

- errors: jsonargparse prints the usage, a tip and a nested 3-4 line error ("Parser key
  "method": Problem with given class_path ...: Option 'local_steps' is not accepted", never which
  method owns the option); tyro prints a 10-15 line boxed panel. Ours is one line naming the
  option, its owner and the fix (``method.local_steps is an option of method ist, not of dp;
  drop it or choose --method.name ist``), exit 2, for the command line and TOML files alike;
- per-method scoping: tyro scopes a Union of dataclasses by subcommands (``method:ist
  --method.local-steps 20``, order-sensitive, kebab-case), which would change every documented
  command, and jsonargparse by ``class_path`` (``--method IST``); both need every method's class
  imported up front, where :class:`Registry` imports an entry on first use (``thinwire plan`` and
  ``thinwire theory`` start without torch.distributed); jsonargparse also accepted
  ``local_steps=0`` at parse time (the class validates only when instantiated later);
- neither parses the spec syntax of ``--method ist:local_steps=20`` and ``--methods
  dp,ist:local_steps=20,topk`` (:func:`parse_spec`, :func:`split_top`), nor merges a TOML file
  with overrides the way a resumed run's ``config.toml`` needs (:func:`thinwire.config.merge`).
So the hand-written parsing stays: ``opt`` fields carry help and choices, ``check`` gives the one
line, :mod:`thinwire.commands.common` turns the fields into ``--section.option`` arguments.
The theory lab's parameters (:mod:`thinwire.theory.params`) are a second, smaller system because
they need what ``opt`` lacks (numeric bounds, comma-separated tuples of values with a maximum
count, a derived parameter, d = q n).
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from thinwire.errors import UsageError


class OptionError(UsageError):
    """An invalid option value; the message names the option and the fix."""


def opt(default: Any, help: str, *, choices: tuple[Any, ...] | None = None, **kw: Any) -> Any:
    """A dataclass field with its help text (and, for enumerations, the allowed values)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use tuples for defaults")
    meta: dict[str, Any] = {"help": help, **kw}
    if choices is not None:
        meta["choices"] = tuple(choices)
    return field(default=default, metadata=meta)


def check(cond: bool, name: str, msg: str) -> None:
    """Raise :class:`OptionError` ``"name: msg"`` unless ``cond``."""
    if not cond:
        raise OptionError(f"{name}: {msg}")


def check_choices(obj: Any, prefix: str) -> None:
    """Check every field of dataclass ``obj`` declared with ``choices`` holds one of them."""
    for f in dataclasses.fields(obj):
        allowed = f.metadata.get("choices")
        if allowed is not None:
            value = getattr(obj, f.name)
            check(value in allowed, f"{prefix}.{f.name}",
                  f"got {value!r}; use one of {', '.join(map(str, allowed))}")


def check_finite(obj: Any, prefix: str) -> None:
    """Every float field of dataclass ``obj`` is finite (inf and nan are never a setting)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, float):
            check(math.isfinite(value), f"{prefix}.{f.name}", f"got {value}; use a finite number")


MAX_INT = 2**53
"""Largest integer option accepted (beyond it counts and seeds lose meaning)."""


def coerce(name: str, typ: Any, value: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, or fail naming the field."""
    origin = typing.get_origin(typ)
    if origin is tuple:
        if isinstance(value, str):
            parts = value.replace(" ", "").split(",")
            if value.strip() and not all(parts):
                raise OptionError(f"{name}: an empty entry in {value!r}; separate the values "
                                  "by single commas, e.g. 1024,1024")
            value = [v for v in parts if v]
        if not isinstance(value, (list, tuple)):
            raise OptionError(f"{name}: expected a list such as 1024,1024, got {value!r}")
        (inner, *_rest) = typing.get_args(typ)
        return tuple(coerce(name, inner, v) for v in value)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(typ) if a is not type(None)][0]
        return coerce(name, inner, value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise OptionError(f"{name}: expected true or false, got {value!r}")
    if typ in (int, float):
        if isinstance(value, bool):
            raise OptionError(f"{name}: expected a number, got {value!r}")
        try:
            if typ is int:
                if isinstance(value, str):
                    value = value.strip()
                    as_float = float(value)
                    if not as_float.is_integer():
                        raise ValueError
                    out = int(value) if value.lstrip("+-").isdigit() else int(as_float)
                elif isinstance(value, float):
                    if not value.is_integer():
                        raise ValueError
                    out = int(value)
                else:
                    out = int(value)
                if abs(out) > MAX_INT:
                    raise OptionError(f"{name}: {value!r} is out of range; use a value with "
                                      f"magnitude <= 2**53")
                return out
            out_f = float(value)
        except (TypeError, ValueError, OverflowError):
            raise OptionError(f"{name}: expected {'an integer' if typ is int else 'a number'}, "
                              f"got {value!r}") from None
        if not math.isfinite(out_f):
            raise OptionError(f"{name}: got {value!r}; use a finite number")
        return out_f
    if typ is str:
        if not isinstance(value, str):
            raise OptionError(f"{name}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported option type {typ} for {name}")


def build_options(cls: type, values: Mapping[str, Any], prefix: str, *,
                  owner: str = "") -> Any:
    """An instance of options dataclass ``cls`` from ``values``; unknown keys are errors."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in values:
        if key not in known:
            where = f" of {owner}" if owner else ""
            listing = ", ".join(sorted(known)) if known else "none"
            raise OptionError(f"unknown option {prefix}.{key}{where}; known: {listing}")
    kwargs = {k: coerce(f"{prefix}.{k}", hints[k], v) for k, v in values.items()}
    try:
        obj = cls(**kwargs)
    except OptionError:
        raise
    check_choices(obj, prefix)
    check_finite(obj, prefix)
    return obj


def iter_fields(cls: type) -> Iterator[tuple[dataclasses.Field[Any], Any]]:
    """(field, resolved type) of options dataclass ``cls``, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        yield f, hints[f.name]


def as_dict(obj: Any) -> dict[str, Any]:
    return dataclasses.asdict(obj) if obj is not None else {}


def split_top(text: str, what: str = "spec") -> list[str]:
    """Split ``text`` on the commas outside parentheses (``a=1,b=(x:y=1,z=2)`` -> ``a=1`` and
    ``b=(x:y=1,z=2)``); unbalanced parentheses are an :class:`OptionError`."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise OptionError(f"{what} {text!r}: a ')' closes nothing")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise OptionError(f"{what} {text!r}: a '(' is never closed")
    parts.append(text[start:])
    return parts


def parse_spec(text: str, what: str = "spec") -> tuple[str, dict[str, str]]:
    """``"name:key=value,key=value"`` -> ``("name", {"key": "value", ...})``.

    The syntax of codec and method specs on the command line (``topk:ratio=0.01``). A value
    that has commas of its own, such as a codec spec with two options given to a method, goes in
    parentheses, which are removed: ``pipeline:codec_fwd=(topk:ratio=0.1,ef=true)``."""
    name, _, rest = text.strip().partition(":")
    if not name:
        raise OptionError(f"{what} {text!r}: give a name, e.g. topk or topk:ratio=0.01")
    values: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in split_top(rest, what))):
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise OptionError(f"{what} {text!r}: {item!r} is not KEY=VALUE")
        value = value.strip()
        if value.startswith("(") and _encloses(value):
            value = value[1:-1].strip()
        if key.strip() in values:
            raise OptionError(f"{what} {text!r}: {key.strip()} is given twice; give each option "
                              "once")
        values[key.strip()] = value
    return name.strip(), values


def _encloses(value: str) -> bool:
    """Whether the '(' opening ``value`` is closed by its last character."""
    depth = 0
    for i, ch in enumerate(value):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            return i == len(value) - 1
    return False


@dataclass(frozen=True)
class NoOptions:
    """For entries that take no options."""


E = TypeVar("E")


class Registry(Generic[E]):
    """Names -> entries defined in their own modules (``"package.module:ATTR"``), lazily imported.

    ``kind`` names what the registry holds in error messages ("method", "model", ...)."""

    def __init__(self, kind: str, paths: Mapping[str, str]) -> None:
        self.kind = kind
        self.paths = dict(paths)
        self._cache: dict[str, E] = {}

    def names(self) -> tuple[str, ...]:
        return tuple(self.paths)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.paths

    def get(self, name: str) -> E:
        """The entry registered as ``name``; an unknown name is a one-line error."""
        if name not in self:
            raise OptionError(f"unknown {self.kind} {name!r}; known: {', '.join(self.paths)}")
        if name not in self._cache:
            module, _, attr = self.paths[name].partition(":")
            self._cache[name] = getattr(importlib.import_module(module), attr)
        return self._cache[name]

    def register(self, name: str, path: str) -> None:
        """Add an entry defined outside the library, named as the built-in ones are
        (``"package.module:ATTR"``, imported on first use); a name already taken is a one-line
        error."""
        if name in self:
            raise OptionError(f"{self.kind} {name!r} is already registered ({self.paths[name]}); "
                              "register it under another name")
        self.paths[name] = path

    def unregister(self, name: str) -> None:
        """Remove the entry ``name`` (one :meth:`register` added; nothing if there is none)."""
        self.paths.pop(name, None)
        self._cache.pop(name, None)

    def entries(self) -> Iterator[tuple[str, E]]:
        for name in self.paths:
            yield name, self.get(name)
