"""Experiment "interpolation": Theorem 1 of Shulgin & Richtarik, ICML 2024 (arXiv 2306.16484).

With every b_i = 0 (all f_i minimised at x* = 0) IST converges linearly when
E[B L_bar B] <= theta W and gamma <= 1/theta. Steps (defaults of ``Params`` in brackets):
  1. one instance per q in ``q`` (1, 2): d = q n with n = 10 workers, Perm-q; q = 1 is the
     standard instance (d = n = 10);
  2. every method runs at gamma = f / theta, f = ``gamma`` (0.5: half the largest step its
     condition allows), from the same x_0 and, for the IST variants, on the same Partitioner
     draws; moments by Monte-Carlo over ``mc_rounds`` (6000) draws when not exact;
  3. the predicted contraction rho (``descent_rate``) is drawn as a dotted line
     rho^k ||x_0||^2_{L_bar}; it is exact for the scaled Perm-1 sketch, where B = I;
  4. the table lists theta, gamma, predicted and measured per-step factors, the first iteration
     below 1e-20 and the error after K iterations.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from thinwire.theory.lab import first_below, over_seeds, simulate
from thinwire.theory.methods import (
    IST,
    GradientDescent,
    Method,
    RandKGD,
    draw_owners,
    initial_point,
)
from thinwire.theory.params import Parameters, check_perm_q, check_size, option
from thinwire.theory.plots import Curve, Panel, error_figure, markdown_table
from thinwire.theory.predictions import descent_rate
from thinwire.theory.problems import Quadratics, make_quadratics
from thinwire.theory.registry import ExperimentResult

NAME = "interpolation"
TITLE = "Interpolation: linear convergence (Theorem 1)"


@dataclass(frozen=True)
class Params(Parameters):
    """Parameters of "interpolation" (the defaults reproduce docs/THEORY.md section 1)."""

    experiment = NAME

    n: int = option(10, "workers", low=2, example="--n 10")
    q: tuple[int, ...] = option(
        (1, 2), "coordinates per worker, one instance each (d = q n)", low=1
    )
    heterogeneity: float = option(
        1.0, "mixing of the L_i: 0 identical, 1 independent", low=0, high=1
    )
    ridge: float = option(0.1, "ridge of L_i = A_i^T A_i / d + ridge I", above=0, high=100)
    gamma: float = option(
        0.5, "step as a fraction f of 1/theta (gamma = f / theta)", above=0, high=1
    )
    iterations: int = option(300, "iterations K", low=1, high=100_000)
    level: float = option(1e-20, "error level whose first crossing is reported", above=0, high=1)
    mc_rounds: int = option(
        6000, "Partitioner draws for Monte-Carlo moments", low=100, high=100_000
    )
    seeds: tuple[int, ...] = option((0,), "seeds of problem, x_0 and sketches", low=0)

    def check(self) -> None:
        check_perm_q(self, self.n, self.q)
        for q in self.q:
            check_size(self, self.iterations, q * self.n, "--iterations")
            check_size(self, self.mc_rounds, q * self.n, "--mc-rounds")


def instance_label(n: int, q: int) -> str:
    """The instance's name in the table: "d=n=10 Perm-1", "d=20 n=10 Perm-2"."""
    return f"d=n={n} Perm-1" if q == 1 else f"d={q * n} n={n} Perm-{q}"


def _methods() -> tuple[Method, ...]:
    return (GradientDescent(), IST("scaled"), IST("precond"), IST("perm"), RandKGD())


def _instance_rows(
    label: str, problem: Quadratics, seed: int, p: Params
) -> tuple[Panel, list[list[object]], dict[str, float]]:
    """Steps 2-4 on one instance."""
    K = p.iterations
    x0 = initial_point(problem.d, seed)
    owners = draw_owners(problem.d, problem.n, seed, K)
    mc = (
        None if problem.d == problem.n else draw_owners(problem.d, problem.n, seed + 1, p.mc_rounds)
    )
    curves, rows, numbers = [], [], {}
    ks = np.arange(K + 1)
    for j, method in enumerate(_methods()):
        sim = simulate(problem, method, (p.gamma,), K, x0, seed, owners=owners, mc_owners=mc)
        gamma, err = sim.gammas[0], sim.errors[0]
        rho = descent_rate(problem, sim.moments, gamma)
        hit = first_below(err, p.level)
        measured = (err[hit] / err[0]) ** (1 / hit) if hit else (err[-1] / err[0]) ** (1 / K)
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
                hit if hit is not None else f"> {K}",
                err[-1],
            ]
        )
        numbers[f"{label}/{sim.method}/final"] = float(err[-1])
        numbers[f"{label}/{sim.method}/theta"] = sim.check.theta
    panel = Panel(f"{label}, seed {seed}: error and predicted rate (dotted)", curves, ymin=1e-40)
    return panel, rows, numbers


def run(out_dir: Path, params: Params | None = None) -> ExperimentResult:
    """Every seed of ``params``: step 1, then steps 2-4 on each instance; writes the figure."""
    p = params if params is not None else Params()
    return over_seeds(NAME, TITLE, p.seeds, lambda seed, stem: _run_seed(out_dir, p, seed, stem))


def _run_seed(out_dir: Path, p: Params, seed: int, stem: str) -> ExperimentResult:
    """Step 1, then steps 2-4 on each instance; writes ``<stem>.png``."""
    panels, rows, numbers = [], [], {}
    for q in p.q:  # step 1
        problem = make_quadratics(
            q * p.n,
            p.n,
            heterogeneity=p.heterogeneity,
            interpolation=True,
            ridge=p.ridge,
            seed=seed,
        )
        panel, r, nums = _instance_rows(instance_label(p.n, q), problem, seed, p)
        panels.append(panel)
        rows += r
        numbers.update(nums)
    fig = error_figure(
        out_dir / f"{stem}.png", panels, "Theorem 1: linear convergence when all b_i = 0"
    )
    gamma_head = "gamma = 1/(2 theta)" if p.gamma == 0.5 else f"gamma = {p.gamma:g}/theta"
    headers = [
        "instance",
        "method",
        "theta",
        "theta from",
        gamma_head,
        "predicted rho",
        "measured rho",
        f"first k with error < {p.level:g}",
        f"error at k={p.iterations}",
    ]
    step = "half" if p.gamma == 0.5 else f"{p.gamma:g} times"
    summary = (
        f"Every method runs at {step} the largest step Theorem 1's condition allows. The predicted "
        "rho is the per-step factor of the bound E||x_k - x*||^2 <= rho^k ||x_0 - x*||^2 (all in the "
        "L_bar norm); it is exact for the scaled Perm-1 sketch, for which B = I. Rand-k CGD is not "
        "covered by the paper's theorem; its theta and rho come from the same one-step inequality."
    )
    return ExperimentResult(
        NAME,
        TITLE,
        markdown_table(headers, rows),
        (fig,),
        numbers,
        summary,
    )
