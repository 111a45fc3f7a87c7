"""The layering check of docs/ARCHITECTURE.md: the import graph of ``src/thinwire`` (every
import, at module level or inside a function), its file cycles, and the forbidden edges between
parts listed in ``tools/never.json``.

    python3 tools/imports.py [--rules tools/never.json] [--root src/thinwire]

Exit 1 and one line per breach (the first five) when there is any; ``tests/test_imports.py``
runs the same functions in the suite. Steps:
  1. every ``*.py`` under the root is a module (``pkg/__init__.py`` is ``pkg``);
  2. each ``import a.b`` / ``from a.b import c`` (relative ones resolved against the package) is
     an edge to the longest existing module prefix of ``a.b`` and of ``a.b.c``;
  3. cycles are the strongly connected components of more than one module (Tarjan);
  4. a rule ``[sources, targets, why]`` is breached by an edge a -> b with a in a source part,
     b in a target part and b not itself in a source part (a part is a module and everything
     below it).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "src" / "thinwire"
RULES = REPO / "tools" / "never.json"


def module_of(path: Path, root: Path) -> str:
    """The dotted module name of file ``path`` under package directory ``root``."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (steps 1-2)."""
    files = {module_of(p, root): p for p in root.rglob("*.py")}
    top = root.name
    g: dict[str, set[str]] = {m: set() for m in files}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [base] + [f"{base}.{a.name}" for a in node.names]
            for n in names:
                while n and n not in files:
                    n = n.rpartition(".")[0]
                if n and n != mod and n.startswith(top):
                    g[mod].add(n)
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (step 3)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))
    try:
        for v in sorted(g):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def part(mod: str, prefixes: list[str]) -> bool:
    """``mod`` is one of ``prefixes`` or below one of them."""
    return any(mod == p or mod.startswith(p + ".") for p in prefixes)


def load_rules(path: Path = RULES) -> list[tuple[list[str], list[str], str]]:
    """The ``[sources, targets, why]`` rules of a JSON file."""
    return [(list(src), list(dst), str(why)) for src, dst, why in json.loads(path.read_text())]


def breaches(g: dict[str, set[str]], rules: list[tuple[list[str], list[str], str]]
             ) -> list[str]:
    """One line per cycle and per forbidden edge (steps 3-4)."""
    bad = ["cycle: " + " <-> ".join(c) for c in cycles(g)]
    for src, dst, why in rules:
        for a in sorted(g):
            for b in sorted(g[a]):
                if part(a, src) and part(b, dst) and not part(b, src):
                    bad.append(f"never {a} -> {b} ({why})")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/imports.py", description=__doc__.splitlines()[0])
    ap.add_argument("--rules", type=Path, default=None, help="JSON rules (default: none)")
    ap.add_argument("--root", type=Path, default=Path("src/thinwire"),
                    help="the package directory (default: src/thinwire)")
    args = ap.parse_args(argv)
    g = graph(args.root)
    bad = breaches(g, load_rules(args.rules) if args.rules else [])
    for line in bad[:5]:
        print(line)
    print(f"{len(bad)} breaches in {len(g)} modules" if bad else
          f"import graph clean ({len(g)} modules)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
