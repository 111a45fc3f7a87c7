"""Experiment parameters as data, for the theory lab (Shulgin & Richtarik, ICML 2024, arXiv 2306.16484).

Every experiment declares its parameters as a frozen dataclass derived from ``Parameters``;
each field is made by ``option(default, help, ...)``, which records its help line and bounds.
Constructing one validates it (``Parameters.__post_init__``):
  1. each field has the declared type (int, float, or a non-empty tuple of them), finite;
  2. each value (each item of a tuple) lies within the field's bounds, a tuple holds no value
     twice and no more than ``max_items`` of them;
  3. the experiment's own cross-field rules run (``Parameters.check``; for example Perm-q's
     d = q n, or a tail no longer than the run).
Every failure is a ``UsageError`` whose one line names the option and the fix.

The command line reaches them through ``from_options`` (text to parameters):
  a. every option given must be a parameter of the experiment, or ``d`` where the experiment has
     ``n`` and ``q`` (the dimension stands for q = d / n, and must be a multiple of n);
  b. each text is parsed by the field's type: an integer, a number, or comma-separated ones;
  c. the dataclass is built, which runs steps 1-3.
``describe`` gives the lines of ``thinwire theory --list``.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from thinwire.errors import UsageError

Number = int | float

MAX_DIM = 40  # d = q n: the stationary error solves a d^2 x d^2 system, seconds at d = 40
MAX_VALUES = 100_000_000  # arrays of iterations x d x d doubles (0.8 GB) at most


def flag(name: str) -> str:
    """The command-line spelling of a parameter: ``mc_rounds`` -> ``--mc-rounds``."""
    return "--" + name.replace("_", "-")


def option(
    default: Any,
    help: str,
    *,
    low: float | None = None,
    high: float | None = None,
    above: float | None = None,
    example: str | None = None,
    max_items: int = 10,
) -> Any:
    """A parameter field: default, one-line help and bounds (``low <= v <= high``, ``v > above``)."""
    meta = {
        "help": help,
        "low": low,
        "high": high,
        "above": above,
        "example": example,
        "max_items": max_items,
    }
    return dataclasses.field(default=default, metadata=meta)


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(_show(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclasses.dataclass(frozen=True)
class Parameters:
    """Base of every experiment's parameters: validation on construction (steps 1-3)."""

    experiment: ClassVar[str] = "experiment"

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            _check_field(self.experiment, f, hints[f.name], getattr(self, f.name))  # steps 1-2
        self.check()  # step 3

    def check(self) -> None:
        """Cross-field rules of one experiment (step 3); raise ``UsageError``."""

    def fail(self, message: str) -> UsageError:
        """A ``UsageError`` prefixed with the experiment's name."""
        return UsageError(f"{self.experiment}: {message}")


P = TypeVar("P", bound=Parameters)


def _base(hint: Any) -> tuple[type, bool]:
    """(int or float, whether the field is a tuple of them)."""
    if typing.get_origin(hint) is tuple:
        return typing.get_args(hint)[0], True
    return hint, False


def _example(f: dataclasses.Field[Any]) -> str:
    return f.metadata["example"] or f"{flag(f.name)} {_show(f.default)}"


def _check_field(experiment: str, f: dataclasses.Field[Any], hint: Any, value: Any) -> None:
    """Steps 1 and 2 for one field."""
    kind, many = _base(hint)
    name, meta = flag(f.name), f.metadata
    fix = f"e.g. {_example(f)}"
    items = value if many else (value,)
    if many and (not isinstance(value, tuple) or not value):
        raise UsageError(f"{experiment}: {name} needs one or more values; {fix}")
    if many and len(value) > meta["max_items"]:
        raise UsageError(
            f"{experiment}: {name} takes at most {meta['max_items']} values, got {len(value)}; "
            f"{fix}"
        )
    what = "an integer" if kind is int else "a number"
    for v in items:
        ok = isinstance(v, int) if kind is int else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok or (kind is float and not math.isfinite(v)):
            raise UsageError(f"{experiment}: {name} must be {what}, got {v!r}; {fix}")
        low, high, above = meta["low"], meta["high"], meta["above"]
        if above is not None and not v > above:
            raise UsageError(f"{experiment}: {name} must be > {above:g}, got {_show(v)}; {fix}")
        if low is not None and v < low:
            raise UsageError(f"{experiment}: {name} must be >= {low:g}, got {_show(v)}; {fix}")
        if high is not None and v > high:
            raise UsageError(f"{experiment}: {name} must be <= {high:g}, got {_show(v)}; {fix}")
    if many and len(set(value)) != len(value):
        twice = next(v for v in value if value.count(v) > 1)
        raise UsageError(
            f"{experiment}: {name} lists {_show(twice)} more than once; give each value once"
        )


def check_perm_q(params: Parameters, n: int, qs: tuple[int, ...]) -> None:
    """Perm-q needs d = q n; d is capped at ``MAX_DIM`` (shared rule of the quadratic experiments)."""
    for q in qs:
        if q * n > MAX_DIM:
            raise params.fail(
                f"d = q n = {q} x {n} = {q * n} is above {MAX_DIM}, the largest dimension whose "
                f"d^2 x d^2 moment systems are solved here; lower --q or --n"
            )


def check_size(params: Parameters, rounds: int, d: int, option_name: str) -> None:
    """Rounds of d x d matrices held at once stay below ``MAX_VALUES`` doubles."""
    if rounds * d * d > MAX_VALUES:
        raise params.fail(
            f"{option_name} {rounds} with d = {d} needs {rounds * d * d:.3g} values "
            f"(more than {MAX_VALUES:.0e}); lower {option_name} or d"
        )


def names(cls: type[Parameters]) -> tuple[str, ...]:
    """The option names (without dashes, with underscores) an experiment takes."""
    taken = tuple(f.name for f in dataclasses.fields(cls))
    return taken + (("d",) if {"n", "q"} <= set(taken) else ())


def _parse_one(experiment: str, f: dataclasses.Field[Any], kind: type, text: str) -> Number:
    """Step b for one item."""
    name = flag(f.name)
    try:
        if kind is int:
            return int(text.strip())
        value = float(text.strip())
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise UsageError(
            f"{experiment}: {name} must be {what}, got {text!r}; e.g. {_example(f)}"
        ) from None
    if not math.isfinite(value):
        raise UsageError(
            f"{experiment}: {name} must be a finite number, got {text!r}; e.g. {_example(f)}"
        )
    return value


def parse(experiment: str, f: dataclasses.Field[Any], hint: Any, text: str) -> Any:
    """Step b: text to the field's type (a tuple from comma-separated items)."""
    kind, many = _base(hint)
    if not many:
        if "," in text:
            raise UsageError(
                f"{experiment}: {flag(f.name)} takes one value, got {text!r}; e.g. {_example(f)}"
            )
        return _parse_one(experiment, f, kind, text)
    return tuple(_parse_one(experiment, f, kind, item) for item in text.split(","))


def _q_from_d(cls: type[Parameters], values: dict[str, Any], d_text: str, q_given: bool) -> Any:
    """Step a for ``d``: q = d / n, which must be a whole number (Perm-q needs d = q n)."""
    exp = cls.experiment
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _, many = _base(typing.get_type_hints(cls)["q"])
    if not many and "," in d_text:
        raise UsageError(f"{exp}: --d takes one value, got {d_text!r}; e.g. --d 20")
    n = values.get("n", fields["n"].default)
    _check_field(exp, fields["n"], int, n)
    qs = []
    for item in d_text.split(","):
        try:
            d = int(item.strip())
        except ValueError:
            raise UsageError(f"{exp}: --d must be an integer, got {item!r}; e.g. --d 20") from None
        if d < 1 or d % n:
            raise UsageError(
                f"{exp}: --d {d} is not a multiple of --n {n}; Perm-q needs d = q n, "
                f"e.g. --d {n} (q = 1) or --d {2 * n} (q = 2)"
            )
        qs.append(d // n)
    q = tuple(qs) if many else qs[0]
    if q_given and values["q"] != q:
        raise UsageError(
            f"{exp}: --d {d_text} and --q {_show(values['q'])} disagree with --n {n}; "
            f"Perm-q needs d = q n: give --q or --d, not both"
        )
    return q


def from_options(cls: type[P], given: Mapping[str, str]) -> P:
    """Steps a-c: ``given`` maps option names (underscores) to their text."""
    exp = cls.experiment
    fields = {f.name: f for f in dataclasses.fields(cls)}
    known = names(cls)
    for name in given:  # step a
        if name not in known:
            taken = ", ".join(flag(k) for k in known) or "none"
            raise UsageError(
                f"{exp} takes no {flag(name)}; its options are {taken} "
                f"(see `thinwire theory --list`)"
            )
    hints = typing.get_type_hints(cls)
    values = {
        name: parse(exp, fields[name], hints[name], text)  # step b
        for name, text in given.items()
        if name != "d"
    }
    if "d" in given:
        values["q"] = _q_from_d(cls, values, given["d"], "q" in given)
    return cls(**values)  # step c


def describe(cls: type[Parameters]) -> list[str]:
    """One line per option: spelling, default and help (for ``--list``)."""
    hints = typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        _, many = _base(hints[f.name])
        metavar = "V[,V...]" if many else "V"
        lines.append(
            f"{flag(f.name)} {metavar}".ljust(26)
            + f"{f.metadata['help']} (default: {_show(f.default)})"
        )
    if "d" in names(cls):
        lines.append(
            "--d V".ljust(26) + "instead of --q: the dimension d, a multiple of --n (q = d / n)"
        )
    return lines
