"""Every planted bug of tools/mutants.py still plants: its text occurs exactly once in its file
and its guarding tests exist (a refactor that moves the code otherwise turns the mutant
"stale" and the mutation table in docs/TESTING.md stops meaning anything)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _mutants():
    spec = importlib.util.spec_from_file_location("thinwire_mutants", ROOT / "tools" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.MUTANTS


@pytest.mark.parametrize("mutant", _mutants(), ids=lambda m: m.id)
def test_every_mutant_plants_once_and_names_existing_tests(mutant) -> None:
    text = (ROOT / "src" / "thinwire" / mutant.file).read_text()
    assert text.count(mutant.old) == 1, f"{mutant.id}: {mutant.old!r} in {mutant.file}"
    for t in mutant.tests:
        assert (ROOT / t.partition("::")[0]).exists(), f"{mutant.id}: no {t}"


def test_the_docs_list_every_planted_bug_and_count_them() -> None:
    """docs/TESTING.md's table has one row per mutant, and README's count is the table's."""
    import re

    ids = [m.id for m in _mutants()]
    rows = re.findall(r"^\| `([\w-]+)` \|", (ROOT / "docs" / "TESTING.md").read_text(), re.M)
    assert sorted(rows) == sorted(ids)
    count = re.search(r"(\d+) planted bugs \(`make mutants`\)", (ROOT / "README.md").read_text())
    assert count is not None and int(count.group(1)) == len(ids)
