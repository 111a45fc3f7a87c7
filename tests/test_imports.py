"""The layering of docs/ARCHITECTURE.md, enforced: no import cycle among thinwire's modules and
no forbidden edge of tools/never.json (the check of tools/imports.py), and the check itself
finds a planted cycle and a planted forbidden edge."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _tool():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("layering_check", REPO / "tools" / "imports.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


imports = _tool()

KNOWN_CYCLES: list[list[str]] = []
"""Cycles being cut elsewhere; each must still exist (delete its line once it is cut)."""


def test_no_import_cycles() -> None:
    found = imports.cycles(imports.graph())
    new = [c for c in found if c not in KNOWN_CYCLES]
    assert not new, "import cycles: " + "; ".join(" <-> ".join(c) for c in new)
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not gone, f"no longer a cycle, remove it from KNOWN_CYCLES: {gone}"


def test_no_forbidden_edges() -> None:
    g = imports.graph()
    rules = imports.load_rules()
    assert len(rules) >= 6 and all(src and dst and why for src, dst, why in rules)
    bad = [b for b in imports.breaches(g, rules) if not b.startswith("cycle:")]
    assert not bad, "\n".join(bad)


def test_the_graph_sees_every_module_and_function_level_imports() -> None:
    g = imports.graph()
    files = list((REPO / "src" / "thinwire").rglob("*.py"))
    assert len(g) == len(files)
    # commands/train.py imports the run layer inside its function; trainer.py at module level
    assert "thinwire.run" in g["thinwire.commands.train"]
    assert "thinwire.builders" in g["thinwire.trainer"]


def _plant(root: Path, files: dict[str, str]) -> Path:
    pkg = root / "thinwire"
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def test_the_check_finds_a_planted_cycle_and_forbidden_edge(tmp_path: Path) -> None:
    pkg = _plant(tmp_path, {
        "__init__.py": "",
        "a.py": "from thinwire import b\n",
        "b.py": "def f():\n    from . import a\n",   # relative, inside a function
        "models/__init__.py": "",
        "models/net.py": "import thinwire.strategies.dp as dp\n",
        "strategies/__init__.py": "",
        "strategies/dp.py": "from thinwire.models.net import x\n",
        "compression/__init__.py": "from ..strategies import dp\n",
    })
    g = imports.graph(pkg)
    assert g["thinwire.b"] == {"thinwire.a", "thinwire"}
    bad = imports.breaches(g, imports.load_rules())
    assert "cycle: thinwire.a <-> thinwire.b" in bad
    assert "cycle: thinwire.models.net <-> thinwire.strategies.dp" in bad
    assert ("never thinwire.models.net -> thinwire.strategies.dp (models are data to the "
            "methods)") in bad
    assert ("never thinwire.compression -> thinwire.strategies.dp (codecs know no method)"
            in bad)
    out = subprocess.run([sys.executable, str(REPO / "tools" / "imports.py"), "--rules",
                          str(REPO / "tools" / "never.json"), "--root", str(pkg)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and out.stdout.strip().endswith("5 breaches in 8 modules")
    clean = _plant(tmp_path / "clean", {"__init__.py": "", "a.py": "import thinwire\n"})
    out = subprocess.run([sys.executable, str(REPO / "tools" / "imports.py"), "--root",
                          str(clean)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "import graph clean (2 modules)" in out.stdout


NEUTRAL = {"thinwire.strategies", "thinwire.strategies.entry", "thinwire.strategies.traffic"}
"""The method-neutral modules of ``thinwire.strategies`` a planner module may import: the
registry (``METHODS``), the entry's vocabulary, and the shared Layout/Traffic/wire formulas."""


def planner_method_imports(g: dict[str, set[str]]) -> list[str]:
    """Edges from a planner module into a method's own module (anything of strategies beyond
    :data:`NEUTRAL`): the planner reads a method only through its registry entry."""
    return sorted(f"{a} -> {b}" for a in g if imports.part(a, ["thinwire.planner"])
                  for b in g[a] if imports.part(b, ["thinwire.strategies"]) and b not in NEUTRAL)


def test_the_planner_reads_methods_only_through_their_entries() -> None:
    g = imports.graph()
    assert any(imports.part(a, ["thinwire.planner"]) and "thinwire.strategies" in g[a]
               for a in g)  # it does read the registry
    bad = planner_method_imports(g)
    assert not bad, "planner imports a method's module: " + "; ".join(bad)


def test_the_planner_check_finds_a_planted_method_import(tmp_path: Path) -> None:
    pkg = _plant(tmp_path, {
        "__init__.py": "",
        "planner/__init__.py": "",
        "planner/a.py": "def f():\n    from thinwire.strategies.ist import pieces\n",
        "planner/b.py": "from thinwire.strategies import METHODS\n"
                        "from thinwire.strategies.traffic import Layout\n"
                        "from ..strategies.entry import MethodEntry\n",
        "planner/c.py": "from thinwire.strategies.base import ReplicatedStrategy\n",
        "strategies/__init__.py": "",
        "strategies/entry.py": "",
        "strategies/traffic.py": "",
        "strategies/base.py": "",
        "strategies/ist/__init__.py": "",
        "strategies/ist/pieces.py": "",
    })
    assert planner_method_imports(imports.graph(pkg)) == [
        "thinwire.planner.a -> thinwire.strategies.ist",
        "thinwire.planner.a -> thinwire.strategies.ist.pieces",
        "thinwire.planner.c -> thinwire.strategies.base"]


def test_the_entries_declare_what_the_planner_reads() -> None:
    """The entry's answers are the method's own: ``partitioned`` is the Strategy's class, the
    capabilities are the functions the method runs with, and a method has only those its
    entry's type names."""
    import importlib

    from thinwire.strategies import METHODS
    from thinwire.strategies.base import ReplicatedStrategy
    from thinwire.strategies.entry import Bucketed, Compressed, Rescalable, Staged
    from thinwire.strategies.traffic import Layout, ParamInfo

    for name, entry in METHODS.entries():
        module, _, cls = entry.strategy.partition(":")
        strategy = getattr(importlib.import_module(module), cls)
        assert entry.strategy_class() is strategy, name
        assert entry.partitioned() is (not issubclass(strategy, ReplicatedStrategy)), name
    assert not METHODS.get("dp").partitioned() and METHODS.get("ist").partitioned()
    from thinwire.strategies.data_parallel import Options, bucket_traffic
    from thinwire.strategies.memory import deal

    dp = METHODS.get("dp")
    assert isinstance(dp, Bucketed) and isinstance(dp, Compressed) and isinstance(dp, Rescalable)
    assert not isinstance(dp, Staged)
    sizes = [7, 300, 20, 300, 1]
    assert dp.owners(sizes, 3) == deal(sizes, 3)
    layout = Layout(tuple(ParamInfo(f"p{i}", (n,)) for i, n in enumerate(sizes)))
    assert dp.buckets(layout, "none", 4, 3) == bucket_traffic(layout, "none", 4, 3)
    coded = Options(compressor="topk:ratio=0.1")
    assert dp.codec(coded) == "topk:ratio=0.1" and dp.uncompressed(coded) == Options()
    assert dp.rescales(Options()) and not dp.rescales(coded)
