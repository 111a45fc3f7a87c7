"""``thinwire theory``: reproduce Shulgin & Richtarik, ICML 2024 (arXiv 2306.16484) on quadratics.

  thinwire theory --list                    the experiments and what each shows
  thinwire theory NAME... [--out DIR]       run some experiments
  thinwire theory --all [--out DIR]         run every experiment except the explicit-only ones
  thinwire theory bridge [--out DIR]        an explicit-only one: torch IST on worker processes

Steps of ``run``:
  1. validate the seed and the experiment names (bad input: ``UsageError``, exit code 2);
  2. create the output directory;
  3. run each experiment: it writes its PNG figures, ``<name>.md`` (its table) and
     ``<name>.json`` (its numbers) into the directory, and its table is printed;
  4. with more than one experiment, write ``index.md`` gathering every table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from thinwire.errors import UsageError
from thinwire.theory.registry import ExperimentResult, Registry, default_registry


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="experiments to run (see --list); explicit-only ones such as bridge (torch IST on "
        "local worker processes, ~2 min) run only when named",
    )
    parser.add_argument("--list", action="store_true", help="list the experiments and exit")
    parser.add_argument(
        "--all",
        action="store_true",
        help="run every experiment except the explicit-only ones (marked in --list)",
    )
    parser.add_argument(
        "--out",
        default="runs/theory",
        help="directory for figures and tables (default: runs/theory)",
    )
    parser.add_argument(
        "--seed",
        default="0",
        help="seed of the problems and sketches, an integer >= 0 (default: 0)",
    )


def parse_seed(text: str) -> int:
    """Step 1: an integer >= 0."""
    try:
        seed = int(text)
    except (TypeError, ValueError):
        raise UsageError(f"--seed must be an integer >= 0, got {text!r}; e.g. --seed 0") from None
    if seed < 0:
        raise UsageError(f"--seed must be an integer >= 0, got {seed}; e.g. --seed 0")
    return seed


def selected(registry: Registry, names: list[str], run_all: bool) -> list[str]:
    """Step 1: the experiments to run, in the order given (with --all: all but explicit-only)."""
    if run_all:
        return registry.default_names()
    if not names:
        raise UsageError("name at least one experiment or pass --all; see `thinwire theory --list`")
    for name in names:
        registry.get(name)  # raises UsageError naming the known experiments
    return list(dict.fromkeys(names))


def output_dir(text: str) -> Path:
    """Step 2."""
    out = Path(text)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {text} is a file; give a directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def print_listing(registry: Registry) -> None:
    width = max(len(name) for name in registry.names())
    for experiment in registry:
        mark = "  [explicit only: not in --all]" if experiment.explicit_only else ""
        print(f"{experiment.name:<{width}}  {experiment.help}{mark}")


def write_index(out: Path, results: list[ExperimentResult]) -> Path:
    """Step 4."""
    path = out / "index.md"
    head = "<!-- written by `thinwire theory`; every number below was measured by that run -->\n\n"
    path.write_text(head + "\n".join(r.markdown() for r in results))
    return path


def run(args: argparse.Namespace, registry: Registry | None = None) -> int:
    registry = registry if registry is not None else default_registry()
    if args.list:
        print_listing(registry)
        return 0
    seed = parse_seed(args.seed)  # step 1
    names = selected(registry, list(args.names), args.all)
    out = output_dir(args.out)  # step 2
    results = []
    for name in names:  # step 3
        start = time.perf_counter()
        result = registry.get(name).run(out, seed)
        result.write(out)
        results.append(result)
        print(result.markdown())
        figures = ", ".join(str(p) for p in result.figures)
        print(f"[{name}: {time.perf_counter() - start:.1f} s; figures: {figures}]\n")
    if len(results) > 1:
        print(f"tables gathered in {write_index(out, results)}")
    return 0
