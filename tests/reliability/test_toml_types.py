"""Property test over TOML config files: a value of the wrong type or shape in any field of any
section (a list for a name, a table for a number, a string for a boolean, a section that is a
plain value) ends with one line on stderr and exit code 2, never a traceback, and nothing is
launched."""

from __future__ import annotations

import datetime as dt
import typing
from pathlib import Path
from typing import Any

import pytest
from harness import stderr_lines
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thinwire import run as run_mod
from thinwire.cli import main
from thinwire.config import CHOICES, SECTIONS, iter_options
from thinwire.config import _toml_value as config_toml_value

FIELDS = [(dotted, typ, owners) for dotted, _f, typ, owners in iter_options()]


def _kind(typ: Any) -> str:
    """'int', 'float', 'bool', 'str' or 'tuple' (a list of those) for a field's type."""
    origin = typing.get_origin(typ)
    if origin is tuple:
        return "tuple"
    if origin is not None:  # Optional[X]
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    return {int: "int", float: "float", bool: "bool", str: "str"}[typ]


WHEN = dt.datetime(2020, 1, 2, 3, 4, 5)
# values of each TOML type; a field refuses those whose type cannot be its own
VALUES: dict[str, list[Any]] = {
    "list": [[], [1], ["dp"], [[1]]],
    "table": [{}, {"a": 1}],
    "bool": [True, False],
    "int": [1, 0, -3],
    "float": [1.5, -0.25],
    "str": ["x", "10", "true"],
    "datetime": [WHEN, WHEN.date()],
}
WRONG = {"int": ("list", "table", "bool", "str", "datetime"),
         "float": ("list", "table", "bool", "str", "datetime"),
         "bool": ("list", "table", "int", "float", "str", "datetime"),
         "str": ("list", "table", "bool", "int", "float", "datetime"),
         "tuple": ("table", "bool", "int", "float", "datetime")}


def toml_value(v: Any) -> str:
    """TOML for ``v``: the config writer's for scalars, and dates, tables and nested lists."""
    if isinstance(v, (dt.date, dt.datetime)):
        return v.isoformat()
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list):
        return "[" + ", ".join(map(toml_value, v)) + "]"
    return config_toml_value(v)


@st.composite
def wrong_config(draw: st.DrawFn) -> str:
    """A TOML text whose one bad value is a wrong type in one field (or a whole section)."""
    if draw(st.integers(0, 9)) == 0:  # a section that is a plain value or a list of tables
        section = draw(st.sampled_from(list(SECTIONS)))
        if draw(st.booleans()):
            return f"{section} = {toml_value(draw(st.sampled_from(VALUES['int'] + VALUES['str'])))}\n"
        return f"[[{section}]]\nname = \"x\"\n"
    dotted, typ, owners = draw(st.sampled_from(FIELDS))
    section, _, key = dotted.partition(".")
    kind = draw(st.sampled_from(WRONG[_kind(typ)]))
    value = draw(st.sampled_from(VALUES[kind]))
    lines = [f"[{section}]"]
    if owners and section in CHOICES:
        lines.append(f'name = "{draw(st.sampled_from(owners))}"')
    lines.append(f"{key} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


class Launched(Exception):
    """Raised instead of a run: the file was accepted."""


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(wrong_config())
def test_a_wrong_type_anywhere_in_a_toml_file_is_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path_factory: pytest.TempPathFactory, text: str) -> None:
    def launched(*args: object, **kwargs: object) -> None:
        raise Launched(text)

    monkeypatch.setattr(run_mod, "run_config", launched)
    path = tmp_path_factory.mktemp("toml") / "c.toml"
    path.write_text(text)
    capsys.readouterr()
    code = main(["train", "--config", str(path)])
    err = stderr_lines(capsys.readouterr().err)
    assert code == 2, text
    assert len(err) == 1 and "Traceback" not in err[0], (text, err)


@pytest.mark.parametrize("text", ['[method]\nname = ["dp"]\n', '[model]\nname = ["mlp"]\n',
                                  '[data]\nname = ["digits"]\n', '[method]\nname = {a = 1}\n'])
def test_a_list_or_table_for_a_name_is_one_line(tmp_path: Path, text: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and ".name" in err[0] and "expected a string" in err[0], err
