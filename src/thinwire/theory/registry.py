"""The experiment registry of the theory lab (Shulgin & Richtarik, ICML 2024, on quadratics).

An experiment is a name, a one-line help and a function ``run(out_dir, seed)`` that writes its
figures into ``out_dir`` and returns an ``ExperimentResult`` (markdown table, figure paths, the
numbers it measured). Steps of ``default_registry``:
  1. build an empty ``Registry`` (no module-level state: each call gets its own);
  2. register the built-in experiments of ``thinwire.theory.experiments``;
  3. import every module named in ``extensions`` and call its ``register(registry)``, so an
     experiment living elsewhere (e.g. the torch "bridge to practice" run of
     ``thinwire.theory.exp_bridge``) joins by adding its module name to ``EXTENSION_MODULES``
     or by passing ``extensions``. A slow one sets ``explicit_only`` and stays out of ``--all``.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from thinwire.errors import UsageError

# Modules exposing ``register(registry: Registry) -> None``; an immutable list, not state.
EXTENSION_MODULES: tuple[str, ...] = ("thinwire.theory.exp_bridge",)


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


ExperimentFn = Callable[[Path, int], ExperimentResult]


@dataclass(frozen=True)
class Experiment:
    """A named experiment: ``run(out_dir, seed) -> ExperimentResult``.

    ``explicit_only``: too slow for ``--all`` (e.g. it launches worker processes); it runs only
    when named.
    """

    name: str
    help: str
    run: ExperimentFn
    explicit_only: bool = False


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


def default_registry(extensions: Sequence[str] = EXTENSION_MODULES) -> Registry:
    """Built-in experiments plus those of ``extensions`` (steps 1-3)."""
    from thinwire.theory import experiments

    registry = Registry()
    experiments.register(registry)
    for module in extensions:
        importlib.import_module(module).register(registry)
    return registry
