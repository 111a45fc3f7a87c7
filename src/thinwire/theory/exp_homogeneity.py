"""Experiment "homogeneous-vs-heterogeneous": Shulgin & Richtarik, ICML 2024 (arXiv 2306.16484).

Theorem 2's neighbourhood has a bias part h and a heterogeneity part sigma^2; identical workers
remove sigma^2 but not the bias. Steps (defaults of ``Params`` in brackets):
  1. one family of instances (n = 10 workers, q = 1 coordinate each, d = q n) from identical
     (h = 0) to independent (h = 1) workers, through the heterogeneity knob of
     ``make_quadratics`` at the levels ``heterogeneity`` (0, 0.25, 0.5, 0.75, 1);
  2. on each, IST with the scaled sketch and Rand-k CGD at gamma = f / theta, f = ``gamma``
     (0.5), K = ``iterations`` (3000), on the same Partitioner draws for every level;
  3. measure the plateau (mean of the last ``tail`` = 1000 iterations) and report it with the
     gradient dissimilarity sigma^2 at x*, IST's predicted bias floor and stationary error, and
     CGD's predicted stationary error (CGD is unbiased, so its floor is 0 at any h);
  4. plot the trajectories at the first and last level, and the plateaus against h.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from thinwire.theory.lab import Simulation, over_seeds, simulate
from thinwire.theory.methods import IST, RandKGD, draw_owners, initial_point
from thinwire.theory.params import Parameters, check_perm_q, check_size, option
from thinwire.theory.plots import Curve, HLine, Panel, error_figure, markdown_table
from thinwire.theory.problems import make_quadratics
from thinwire.theory.registry import ExperimentResult

NAME = "homogeneous-vs-heterogeneous"
TITLE = "Homogeneous vs heterogeneous workers"


@dataclass(frozen=True)
class Params(Parameters):
    """Parameters of "homogeneous-vs-heterogeneous" (defaults: docs/THEORY.md section 3)."""

    experiment = NAME

    n: int = option(10, "workers", low=2)
    q: int = option(1, "coordinates per worker of Perm-q (d = q n)", low=1)
    heterogeneity: tuple[float, ...] = option(
        (0.0, 0.25, 0.5, 0.75, 1.0),
        "levels h of the knob, 0 identical to 1 independent workers",
        low=0,
        high=1,
    )
    ridge: float = option(0.1, "ridge of L_i = A_i^T A_i / d + ridge I", above=0, high=100)
    gamma: float = option(
        0.5, "step as a fraction f of 1/theta (gamma = f / theta)", above=0, high=1
    )
    iterations: int = option(3000, "iterations K", low=2, high=100_000)
    tail: int = option(1000, "the plateau is the mean error of the last TAIL iterations", low=1)
    mc_rounds: int = option(
        20000, "Partitioner draws for Monte-Carlo moments", low=100, high=100_000
    )
    seeds: tuple[int, ...] = option((0,), "seeds of problem, x_0 and sketches", low=0)

    def check(self) -> None:
        check_perm_q(self, self.n, (self.q,))
        check_size(self, self.iterations, self.q * self.n, "--iterations")
        check_size(self, self.mc_rounds, self.q * self.n, "--mc-rounds")
        if self.tail > self.iterations:
            raise self.fail(
                f"--tail {self.tail} is longer than --iterations {self.iterations}; "
                "lower --tail or raise --iterations"
            )


Sims = dict[float, tuple[Simulation, Simulation]]


def _trajectories(sims: Sims, p: Params) -> Panel:
    curves, hlines = [], []
    levels = p.heterogeneity
    for j, h in enumerate(dict.fromkeys((levels[0], levels[-1]))):
        ist, cgd = sims[h]
        curves.append(Curve(f"IST scaled, h={h:g}", ist.errors[0], color=f"C{2 * j}"))
        curves.append(Curve(f"Rand-k CGD, h={h:g}", cgd.errors[0], color=f"C{2 * j + 1}"))
        hlines.append(HLine(f"IST bias floor, h={h:g}", ist.floor, color=f"C{2 * j}"))
    return Panel(f"gamma = {p.gamma:g} / theta", curves, hlines)


def _against_h(sims: Sims, p: Params) -> Panel:
    tail = p.tail
    h = np.array(p.heterogeneity)
    ist = [sims[v][0] for v in p.heterogeneity]
    cgd = [sims[v][1] for v in p.heterogeneity]
    curves = [
        Curve(
            "IST scaled: measured plateau",
            np.array([s.plateau(tail)[0] for s in ist]),
            x=h,
            style="o-",
            color="C0",
        ),
        Curve(
            "IST scaled: predicted bias floor",
            np.array([s.floor for s in ist]),
            x=h,
            style="x--",
            color="C0",
        ),
        Curve(
            "Rand-k CGD: measured plateau",
            np.array([s.plateau(tail)[0] for s in cgd]),
            x=h,
            style="o-",
            color="C1",
        ),
        Curve(
            "Rand-k CGD: predicted stationary",
            np.array([s.stationary[0] for s in cgd]),
            x=h,
            style="x:",
            color="C1",
        ),
    ]
    return Panel(
        "plateau against heterogeneity",
        curves,
        (),
        xlabel="heterogeneity knob h",
        ylabel=rf"mean of last {tail} $\|x_k - x^*\|^2_{{\bar L}}$",
        ymin=1e-32,  # CGD's predicted stationary error at h = 0 is exactly 0 (off the axis)
    )


def run(out_dir: Path, params: Params | None = None) -> ExperimentResult:
    """Steps 1-4 for every seed of ``params``; writes the figure."""
    p = params if params is not None else Params()
    return over_seeds(NAME, TITLE, p.seeds, lambda seed, stem: _run_seed(out_dir, p, seed, stem))


def _run_seed(out_dir: Path, p: Params, seed: int, stem: str) -> ExperimentResult:
    """Steps 1-4 for one seed; writes ``<stem>.png``."""
    K, tail, d = p.iterations, p.tail, p.q * p.n
    owners = draw_owners(d, p.n, seed, K)
    mc = None if p.q == 1 else draw_owners(d, p.n, seed + 1, p.mc_rounds)
    x0 = initial_point(d, seed)
    sims: Sims = {}
    rows: list[list[object]] = []
    numbers: dict[str, float] = {}
    for h in p.heterogeneity:  # step 1
        problem = make_quadratics(d, p.n, heterogeneity=h, ridge=p.ridge, seed=seed)
        ist, cgd = (
            simulate(problem, m, (p.gamma,), K, x0, seed, owners=owners, mc_owners=mc)
            for m in (IST("scaled"), RandKGD())
        )  # step 2
        sims[h] = (ist, cgd)
        sigma2 = problem.heterogeneity()
        rows.append(
            [
                h,
                sigma2,
                ist.floor,
                ist.stationary[0],
                ist.plateau(tail)[0],
                cgd.gammas[0],
                cgd.stationary[0],
                cgd.plateau(tail)[0],
            ]
        )  # step 3
        numbers.update(
            {
                f"h={h:g}/sigma2": sigma2,
                f"h={h:g}/ist_floor": ist.floor,
                f"h={h:g}/ist_plateau": float(ist.plateau(tail)[0]),
                f"h={h:g}/cgd_plateau": float(cgd.plateau(tail)[0]),
            }
        )
    fig = error_figure(
        out_dir / f"{stem}.png",
        [_trajectories(sims, p), _against_h(sims, p)],
        "identical workers remove sigma^2, not IST's bias",
    )  # step 4
    headers = [
        "h",
        "sigma^2 at x*",
        "IST bias floor",
        "IST predicted stationary",
        "IST plateau",
        "CGD gamma",
        "CGD predicted stationary",
        "CGD plateau",
    ]
    f = f"{p.gamma:g}"
    ist_step = f"gamma = {f} (its theta is 1)" if p.q == 1 else f"{f}/theta of its own condition"
    summary = (
        f"IST scaled runs at {ist_step}; Rand-k CGD at {f}/theta of its own "
        "condition. sigma^2 = (1/n) sum_i ||grad f_i(x*)||^2 in the L_bar^{-1} norm is 0 for identical "
        "workers (h = 0): CGD then converges to x* itself, while IST still stops at its bias floor."
    )
    return ExperimentResult(NAME, TITLE, markdown_table(headers, rows), (fig,), numbers, summary)
