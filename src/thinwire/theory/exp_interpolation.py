"""Experiment "interpolation": Theorem 1 of Shulgin & Richtarik, ICML 2024 (arXiv 2306.16484).

With every b_i = 0 (all f_i minimised at x* = 0) IST converges linearly when
E[B L_bar B] <= theta W and gamma <= 1/theta. Steps:
  1. two instances: the standard one (d = n = 10, Perm-1) and d = 20, n = 10 (Perm-2);
  2. every method runs at gamma = 1/(2 theta), half the largest step its condition allows,
     from the same x_0 and, for the IST variants, on the same Partitioner draws;
  3. the predicted contraction rho (``descent_rate``) is drawn as a dotted line
     rho^k ||x_0||^2_{L_bar}; it is exact for the scaled Perm-1 sketch, where B = I;
  4. the table lists theta, gamma, predicted and measured per-step factors, the first iteration
     below 1e-20 and the error after K iterations.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from thinwire.theory.lab import first_below, simulate
from thinwire.theory.methods import (
    IST,
    GradientDescent,
    Method,
    RandKGD,
    draw_owners,
    initial_point,
)
from thinwire.theory.plots import Curve, Panel, error_figure, markdown_table
from thinwire.theory.predictions import descent_rate
from thinwire.theory.problems import Quadratics, make_quadratics, standard_instance
from thinwire.theory.registry import ExperimentResult

ITERATIONS = 300
LEVEL = 1e-20
MC_ROUNDS = 6000


def _methods() -> tuple[Method, ...]:
    return (GradientDescent(), IST("scaled"), IST("precond"), IST("perm"), RandKGD())


def _instance_rows(
    label: str, problem: Quadratics, seed: int
) -> tuple[Panel, list[list[object]], dict[str, float]]:
    """Steps 2-4 on one instance."""
    x0 = initial_point(problem.d, seed)
    owners = draw_owners(problem.d, problem.n, seed, ITERATIONS)
    mc = None if problem.d == problem.n else draw_owners(problem.d, problem.n, seed + 1, MC_ROUNDS)
    curves, rows, numbers = [], [], {}
    ks = np.arange(ITERATIONS + 1)
    for j, method in enumerate(_methods()):
        sim = simulate(problem, method, (0.5,), ITERATIONS, x0, seed, owners=owners, mc_owners=mc)
        gamma, err = sim.gammas[0], sim.errors[0]
        rho = descent_rate(problem, sim.moments, gamma)
        hit = first_below(err, LEVEL)
        measured = (
            (err[hit] / err[0]) ** (1 / hit) if hit else (err[-1] / err[0]) ** (1 / ITERATIONS)
        )
        color = f"C{j}"
        curves.append(Curve(f"{sim.method} (gamma={gamma:.3g})", err, color=color))
        curves.append(Curve(f"predicted rate {rho:.3g}", err[0] * rho**ks, style=":", color=color))
        rows.append(
            [
                label,
                sim.method,
                sim.check.theta,
                sim.check.how,
                gamma,
                rho,
                measured,
                hit if hit is not None else f"> {ITERATIONS}",
                err[-1],
            ]
        )
        numbers[f"{label}/{sim.method}/final"] = float(err[-1])
        numbers[f"{label}/{sim.method}/theta"] = sim.check.theta
    panel = Panel(f"{label}, seed {seed}: error and predicted rate (dotted)", curves, ymin=1e-40)
    return panel, rows, numbers


def run(out_dir: Path, seed: int) -> ExperimentResult:
    """Step 1, then steps 2-4 on each instance; writes ``interpolation.png``."""
    instances = (
        ("d=n=10 Perm-1", standard_instance(interpolation=True, seed=seed)),
        ("d=20 n=10 Perm-2", make_quadratics(20, 10, interpolation=True, seed=seed)),
    )
    panels, rows, numbers = [], [], {}
    for label, problem in instances:
        panel, r, nums = _instance_rows(label, problem, seed)
        panels.append(panel)
        rows += r
        numbers.update(nums)
    fig = error_figure(
        out_dir / "interpolation.png", panels, "Theorem 1: linear convergence when all b_i = 0"
    )
    headers = [
        "instance",
        "method",
        "theta",
        "theta from",
        "gamma = 1/(2 theta)",
        "predicted rho",
        "measured rho",
        f"first k with error < {LEVEL:g}",
        f"error at k={ITERATIONS}",
    ]
    summary = (
        "Every method runs at half the largest step Theorem 1's condition allows. The predicted "
        "rho is the per-step factor of the bound E||x_k - x*||^2 <= rho^k ||x_0 - x*||^2 (all in the "
        "L_bar norm); it is exact for the scaled Perm-1 sketch, for which B = I. Rand-k CGD is not "
        "covered by the paper's theorem; its theta and rho come from the same one-step inequality."
    )
    return ExperimentResult(
        "interpolation",
        "Interpolation: linear convergence (Theorem 1)",
        markdown_table(headers, rows),
        (fig,),
        numbers,
        summary,
    )
