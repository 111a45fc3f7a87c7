"""The built-in experiments of the theory lab (Shulgin & Richtarik, ICML 2024, arXiv 2306.16484).

``register(registry)`` adds, in this order:
  1. interpolation               Theorem 1: linear convergence when every b_i = 0;
  2. heterogeneous               Theorem 2: a floor that does not vanish as gamma shrinks;
  3. homogeneous-vs-heterogeneous identical workers remove sigma^2 but not IST's bias;
  4. counterexample-2x2          the plain sketch breaks the condition when c > 2ab/(a+b).
Each module holds one experiment: its ``Params`` (a frozen dataclass of parameters with defaults
and help) and ``run(out_dir, params) -> ExperimentResult``.

Steps of ``default_registry``:
  1. build an empty ``Registry`` (no module-level state: each call gets its own);
  2. register the built-in experiments above;
  3. import every module named in ``extensions`` and call its ``register(registry)``, so an
     experiment living elsewhere (e.g. the torch "bridge to practice" run of
     ``thinwire.theory.exp_bridge``) joins by adding its module name to ``EXTENSION_MODULES``
     or by passing ``extensions``. A slow one sets ``explicit_only`` and stays out of ``--all``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from thinwire.theory import (
    exp_counterexample,
    exp_heterogeneous,
    exp_homogeneity,
    exp_interpolation,
)
from thinwire.theory.registry import Experiment, Registry

# Modules exposing ``register(registry: Registry) -> None``; an immutable list, not state.
EXTENSION_MODULES: tuple[str, ...] = ("thinwire.theory.exp_bridge",)


def register(registry: Registry) -> None:
    """Add the four built-in experiments (steps 1-4 of the module docstring's list)."""
    for module, help_ in (
        (exp_interpolation, "b_i = 0: linear convergence of IST and GD (Theorem 1)"),
        (exp_heterogeneous, "b_i != 0: step-size sweep, the bias floor stays (Theorem 2)"),
        (exp_homogeneity, "heterogeneity knob from identical to independent workers"),
        (exp_counterexample, "plain sketch breaks Theorem 1's condition at c > 2ab/(a+b)"),
    ):
        registry.register(Experiment(module.NAME, help_, module.run, params=module.Params))


def default_registry(extensions: Sequence[str] = EXTENSION_MODULES) -> Registry:
    """Built-in experiments plus those of ``extensions`` (steps 1-3)."""
    registry = Registry()  # step 1
    register(registry)  # step 2
    for module in extensions:  # step 3
        importlib.import_module(module).register(registry)
    return registry
