"""``thinwire theory``: reproduce Shulgin & Richtarik, ICML 2024 (arXiv 2306.16484) on quadratics.

  thinwire theory --list                       the experiments, their options and defaults
  thinwire theory NAME... [--out DIR] [OPTS]   run some experiments, e.g.
      thinwire theory heterogeneous --n 10 --q 1 --gammas 1,0.5,0.1,0.02 --seeds 0,1,2
  thinwire theory --all [--out DIR] [--seed S] run every experiment except the explicit-only ones
  thinwire theory bridge [--out DIR]           an explicit-only one: torch IST on worker processes

Each experiment takes the options of its parameter class (``thinwire.theory.params``); an
option that a selected experiment does not take is an error, never ignored. ``--seed S`` is
every experiment's seed (``--seeds S`` where it takes several).

Steps of ``run``:
  1. validate the seed, the experiment names and every experiment's options, before anything
     runs (bad input: ``UsageError``, one line, exit code 2);
  2. create the output directory;
  3. run each experiment: it writes its PNG figures, ``<name>.md`` (its table) and
     ``<name>.json`` (its numbers) into the directory, and its table is printed;
  4. with more than one experiment, write ``index.md`` gathering every table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError
from thinwire.theory import params as params_
from thinwire.theory.experiments import default_registry
from thinwire.theory.registry import Experiment, ExperimentResult, Registry


class StoreOption(argparse.Action):
    """Collect an experiment option's text into ``namespace.options`` (name -> text)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        options = dict(getattr(namespace, "options", None) or {})
        options[self.dest] = str(values)
        namespace.options = options


def add_arguments(parser: argparse.ArgumentParser, registry: Registry | None = None) -> None:
    registry = registry if registry is not None else default_registry()
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="experiments to run (see --list); explicit-only ones such as bridge (torch IST on "
        "local worker processes, ~2 min) run only when named",
    )
    parser.add_argument(
        "--list", action="store_true", help="list the experiments, their options and defaults"
    )
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
        default=None,
        help="seed of the problems and sketches of every experiment, an integer >= 0 (default: 0)",
    )
    group = parser.add_argument_group(
        "experiment options", "taken only by the experiments listed; see --list for each default"
    )
    takers: dict[str, list[str]] = {}
    for experiment in registry:
        for name in experiment.option_names():
            takers.setdefault(name, []).append(experiment.name)
    for name, who in takers.items():
        if name in ("seed",):
            continue  # the global --seed
        group.add_argument(
            params_.flag(name),
            dest=name,
            action=StoreOption,
            metavar="V",
            help=f"taken by {', '.join(who)}",
        )
    parser.set_defaults(options=None)


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
    if run_all and names:
        raise UsageError("give experiment names or --all, not both")
    if run_all:
        return registry.default_names()
    if not names:
        raise UsageError("name at least one experiment or pass --all; see `thinwire theory --list`")
    for name in names:
        registry.get(name)  # raises UsageError naming the known experiments
    return list(dict.fromkeys(names))


def plan(args: argparse.Namespace, registry: Registry) -> list[tuple[Experiment, Any]]:
    """Step 1: every selected experiment with its validated parameters."""
    seed = parse_seed(args.seed) if getattr(args, "seed", None) is not None else None
    names = selected(registry, list(args.names), args.all)
    given: dict[str, str] = dict(getattr(args, "options", None) or {})
    if args.all:
        for name in given:
            left_out = [n for n in names if name not in registry.get(n).option_names()]
            if left_out:
                takers = [n for n in names if n not in left_out]
                example = " ".join(takers) or "NAME"
                raise UsageError(
                    f"{params_.flag(name)} is not taken by {', '.join(left_out)}, which --all "
                    f"runs; name the experiments instead, e.g. `thinwire theory {example} "
                    f"{params_.flag(name)} {given[name]}`"
                )
    return [(registry.get(name), registry.get(name).parameters(given, seed)) for name in names]


def output_dir(text: str) -> Path:
    """Step 2."""
    out = Path(text)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {text} is a file; give a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(
            f"--out {text} cannot be created ({exc.strerror}); give another directory"
        ) from None
    return out


def print_listing(registry: Registry) -> None:
    width = max(len(name) for name in registry.names())
    for experiment in registry:
        mark = "  [explicit only: not in --all]" if experiment.explicit_only else ""
        print(f"{experiment.name:<{width}}  {experiment.help}{mark}")
        if experiment.params is None:
            print("    --seed V".ljust(28) + "seed (default: 0)")
        else:
            for line in params_.describe(experiment.params):
                print(f"    {line}")


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
    planned = plan(args, registry)  # step 1
    out = output_dir(args.out)  # step 2
    results = []
    for experiment, parameters in planned:  # step 3
        start = time.perf_counter()
        result = experiment(out, parameters)
        result.write(out)
        results.append(result)
        print(result.markdown())
        figures = ", ".join(str(p) for p in result.figures)
        print(f"[{experiment.name}: {time.perf_counter() - start:.1f} s; figures: {figures}]\n")
    if len(results) > 1:
        print(f"tables gathered in {write_index(out, results)}")
    return 0
