"""The experiment registry of the theory lab (Shulgin & Richtarik, ICML 2024, on quadratics).

An experiment is a name, a one-line help, its parameters as a frozen dataclass
(``thinwire.theory.params``) and a function ``run(out_dir, params)`` that writes its figures
into ``out_dir`` and returns an ``ExperimentResult`` (markdown table, figure paths, the numbers
it measured). An experiment registered without a parameter class takes only a seed:
``run(out_dir, seed)``. Steps of ``Experiment.parameters`` (the command line's options):
  1. ``--seed S`` stands for the experiment's ``seeds`` (or ``seed``) parameter;
  2. the options are turned into the experiment's parameters, validated (``params``).

This module imports no experiment: the built-in ones are gathered by
``thinwire.theory.experiments.default_registry``, which also imports every extension module.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError
from thinwire.theory import params as params_
from thinwire.theory.params import Parameters


@dataclass(frozen=True)
class ExperimentResult:
    """What one experiment produced: its table (markdown), figures and measured numbers."""

    name: str
    title: str
    table: str
    figures: tuple[Path, ...]
    numbers: Mapping[str, float] = field(default_factory=dict)
    summary: str = ""

    def markdown(self) -> str:
        """Title, plain-words summary and table: the text written to ``<name>.md``."""
        parts = [f"## {self.title}", ""]
        if self.summary:
            parts += [self.summary, ""]
        parts += [self.table, ""]
        return "\n".join(parts)

    def write(self, out_dir: Path) -> tuple[Path, Path]:
        """Write ``<name>.md`` and ``<name>.json`` (the numbers) into ``out_dir``."""
        md, js = out_dir / f"{self.name}.md", out_dir / f"{self.name}.json"
        md.write_text(self.markdown())
        payload = {
            "name": self.name,
            "figures": [p.name for p in self.figures],
            "numbers": dict(self.numbers),
        }
        js.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
        return md, js


ExperimentFn = Callable[[Path, Any], ExperimentResult]


@dataclass(frozen=True)
class Experiment:
    """A named experiment: ``run(out_dir, params) -> ExperimentResult``.

    ``params``: the experiment's parameter class; ``None`` for one that takes only a seed
    (``run(out_dir, seed)``). ``explicit_only``: too slow for ``--all`` (e.g. it launches worker
    processes); it runs only when named.
    """

    name: str
    help: str
    run: ExperimentFn
    explicit_only: bool = False
    params: type[Parameters] | None = None

    def option_names(self) -> tuple[str, ...]:
        """The options it takes besides ``--seed`` (underscored names)."""
        return params_.names(self.params) if self.params is not None else ()

    def parameters(self, given: Mapping[str, str], seed: int | None) -> Any:
        """Steps 1-2: its parameters from option texts, or the seed for a seed-only one."""
        if self.params is None:
            for name in given:
                raise UsageError(
                    f"{self.name} takes no {params_.flag(name)}; its only option is --seed"
                )
            return 0 if seed is None else seed
        given = dict(given)
        if seed is not None:  # step 1
            taken = self.option_names()
            if "seeds" in given or "seed" in given:
                raise UsageError("give --seed or --seeds, not both")
            given["seeds" if "seeds" in taken else "seed"] = str(seed)
        return params_.from_options(self.params, given)  # step 2

    def __call__(self, out_dir: Path, parameters: Any = None) -> ExperimentResult:
        """Run with ``parameters`` (its defaults when None)."""
        if parameters is None:
            parameters = self.params() if self.params is not None else 0
        return self.run(out_dir, parameters)


class Registry:
    """Experiments by name, in registration order."""

    def __init__(self) -> None:
        self._experiments: dict[str, Experiment] = {}

    def register(self, experiment: Experiment) -> None:
        if experiment.name in self._experiments:
            raise ValueError(f"experiment {experiment.name!r} is already registered")
        self._experiments[experiment.name] = experiment

    def names(self) -> list[str]:
        return list(self._experiments)

    def default_names(self) -> list[str]:
        """The experiments ``--all`` runs: every one not marked ``explicit_only``."""
        return [name for name, e in self._experiments.items() if not e.explicit_only]

    def get(self, name: str) -> Experiment:
        try:
            return self._experiments[name]
        except KeyError:
            known = ", ".join(self._experiments)
            raise UsageError(
                f"unknown experiment {name!r}; choose from {known} (see `thinwire theory --list`)"
            ) from None

    def __iter__(self) -> Iterator[Experiment]:
        return iter(self._experiments.values())

    def __len__(self) -> int:
        return len(self._experiments)
