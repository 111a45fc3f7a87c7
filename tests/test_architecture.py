"""Structural claims of docs/ARCHITECTURE.md that a test can check (the import rules are
tests/test_imports.py's, the method-case table tests/test_method_cases.py's)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from thinwire.runtime.comm import Comm

SRC = Path(__file__).resolve().parents[1] / "src" / "thinwire"


def _imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module.split(".")[0])
    return out


def test_the_theory_lab_is_numpy_but_for_its_bridge() -> None:
    """"theory/: IST on quadratics (numpy); exp_bridge.py: ... the torch IST strategy"."""
    files = sorted((SRC / "theory").glob("*.py"))
    assert len(files) > 3
    torchy = [f.name for f in files if "torch" in _imports(f)]
    assert torchy == ["exp_bridge.py"], torchy


def test_a_one_rank_call_writes_no_ledger_entry() -> None:
    """"a LedgerEntry per collective call (none on a one-rank communicator ...)"."""
    comm = Comm.local()
    comm.all_reduce(torch.ones(3), tag="grad")
    comm.all_gather(torch.ones(2), tag="grad")
    comm.broadcast(torch.ones(2), tag="grad")
    assert comm.ledger.entries == []


def test_the_model_parallel_methods_step_in_the_template() -> None:
    """"step.py: SteppedStrategy: the one train-step template of tensor, pipeline, hybrid and
    slide": each of their Strategy classes inherits train_step from it, none overrides it."""
    import importlib

    from thinwire.strategies import METHODS
    from thinwire.strategies.step import SteppedStrategy

    stepped = []
    for name, entry in METHODS.entries():
        module, _, cls = entry.strategy.partition(":")
        strategy = getattr(importlib.import_module(module), cls)
        if issubclass(strategy, SteppedStrategy):
            assert strategy.train_step is SteppedStrategy.train_step, name
            stepped.append(name)
    assert len(stepped) == 4, stepped


def test_every_methods_strategy_is_named_for_what_it_is() -> None:
    """"strategies/: one module per method": its Strategy class is ``<Name>Strategy`` (the
    plain name belongs to the public object a user calls: IST, LocalSGD, DiLoCo, Pipeline)."""
    import importlib

    from thinwire.strategies import METHODS
    from thinwire.strategies.base import Strategy

    for name, entry in METHODS.entries():
        module, _, cls = entry.strategy.partition(":")
        assert issubclass(getattr(importlib.import_module(module), cls), Strategy), name
        assert cls.endswith("Strategy"), f"{name}: {cls}"


def test_a_file_over_400_lines_says_which_one_concept_it_is() -> None:
    """"no source file over 400 lines unless it is one concept, named in its docstring"."""
    long = []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 400:
            doc = ast.get_docstring(ast.parse(text)) or ""
            if "One concept, one file (over 400 lines): " not in doc:
                long.append(str(path.relative_to(SRC)))
    assert not long, f"over 400 lines without naming their one concept: {long}"


def test_no_function_is_over_60_lines() -> None:
    """"no function over 60 lines" (a docstring included)."""
    over = []
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > 60:
                    over.append(f"{path.relative_to(SRC)}:{node.name} ({length})")
    assert not over, over


def test_the_test_folders_mirror_the_source() -> None:
    """docs/TESTING.md: "tests/ mirrors src/thinwire/": every folder of tests/ names a package of
    src/thinwire at the same path, except reliability/ (the run-level promises of README's
    "Reliability", which cross every layer)."""
    tests = SRC.parents[1] / "tests"
    folders = [f for f in (p.relative_to(tests) for p in tests.rglob("*") if p.is_dir())
               if not any(x == "__pycache__" or x.startswith(".") for x in f.parts)]
    assert folders
    stray = [str(f) for f in folders
             if f.parts[0] != "reliability" and not (SRC / f / "__init__.py").is_file()]
    assert not stray, f"test folders without a package of src/thinwire: {stray}"
