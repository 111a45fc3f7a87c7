"""The built-in experiments of the theory lab (Shulgin & Richtarik, ICML 2024, arXiv 2306.16484).

``register(registry)`` adds, in this order:
  1. interpolation               Theorem 1: linear convergence when every b_i = 0;
  2. heterogeneous               Theorem 2: a floor that does not vanish as gamma shrinks;
  3. homogeneous-vs-heterogeneous identical workers remove sigma^2 but not IST's bias;
  4. counterexample-2x2          the plain sketch breaks the condition when c > 2ab/(a+b).
Each module holds one experiment with ``run(out_dir, seed) -> ExperimentResult``.
"""

from __future__ import annotations

from thinwire.theory import (
    exp_counterexample,
    exp_heterogeneous,
    exp_homogeneity,
    exp_interpolation,
)
from thinwire.theory.registry import Experiment, Registry


def register(registry: Registry) -> None:
    """Add the four built-in experiments (steps 1-4)."""
    registry.register(
        Experiment(
            "interpolation",
            "b_i = 0: linear convergence of IST and GD (Theorem 1)",
            exp_interpolation.run,
        )
    )
    registry.register(
        Experiment(
            "heterogeneous",
            "b_i != 0: step-size sweep, the bias floor stays (Theorem 2)",
            exp_heterogeneous.run,
        )
    )
    registry.register(
        Experiment(
            "homogeneous-vs-heterogeneous",
            "heterogeneity knob from identical to independent workers",
            exp_homogeneity.run,
        )
    )
    registry.register(
        Experiment(
            "counterexample-2x2",
            "plain sketch breaks Theorem 1's condition at c > 2ab/(a+b)",
            exp_counterexample.run,
        )
    )
