"""The shape of the library: no method named outside its own module and the registry, no layer
climbing into the command line, a light ``import thinwire``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import thinwire
from thinwire.models import MODELS
from thinwire.strategies import METHODS

SRC = Path(thinwire.__file__).parent


def _literals(path: Path) -> set[str]:
    """String constants of a module that are whole values (not docstrings, not f-string parts)."""
    tree = ast.parse(path.read_text())
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docs.add(id(body[0].value))
    parts = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in docs and id(n) not in parts}


def _home(kind_paths: dict[str, str], name: str) -> Path:
    module = kind_paths[name].partition(":")[0]
    rel = Path(*module.split(".")[1:])
    return SRC / (str(rel) + ".py") if (SRC / (str(rel) + ".py")).exists() else SRC / rel


@pytest.mark.parametrize("registry,registry_file", [(METHODS, SRC / "strategies" / "__init__.py"),
                                                    (MODELS, SRC / "models" / "__init__.py")])
def test_no_method_or_model_name_outside_its_module_and_the_registry(registry, registry_file) -> None:
    """A name used as a value (``if name == "ist"``, a default ``"dp"``) anywhere but the entry's
    own module (or package) and the registry file means a layer knows a method or model.
    Theory-lab experiments (``theory/exp_*.py``) are studies of named methods, as benchmarks
    are: they choose methods as data and are exempt. The mesh's dimension names (``data``,
    ``pipeline``, ``tensor``: torch DeviceMesh's) are not method names where the mesh defines
    them, even where a method shares one."""
    from thinwire.runtime.mesh import DIMS

    offenders = []
    for path in SRC.rglob("*.py"):
        if path.parent.name == "theory" and path.name.startswith("exp_"):
            continue
        found = _literals(path) & set(registry.names())
        if path == SRC / "runtime" / "mesh.py":
            found -= set(DIMS)
        for name in found:
            home = _home(registry.paths, name)
            if path == registry_file or path == home or home in path.parents:
                continue
            offenders.append(f"{path.relative_to(SRC)}: {name!r}")
    assert not offenders, offenders


def test_import_thinwire_is_light_and_exports_the_public_api() -> None:
    code = ("import sys, thinwire; print('torch' in sys.modules); "
            "print(all(hasattr(thinwire, n) for n in thinwire.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]
    from thinwire.strategies.ist.core import IST

    assert thinwire.IST is IST


def test_the_library_never_imports_the_command_line() -> None:
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC)
        if rel.parts[0] in ("commands", "cli.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith(("thinwire.commands", "thinwire.cli")), rel
