"""Experiment "counterexample-2x2": Shulgin & Richtarik, ICML 2024 (arXiv 2306.16484).

Two identical workers, L = [[a, c], [c, b]], b_i = 0, Perm-1. The plain sketch C_i = 2 e_j e_j^T
gives the deterministic B = 2 diag(a, b), so W = L diag(a, b) + diag(a, b) L, whose determinant
4 a^2 b^2 - c^2 (a + b)^2 turns negative exactly when c > 2ab/(a+b). Then no theta satisfies
E[B L B] <= theta W, although L is still positive definite up to c = sqrt(ab). Steps
(defaults of ``Params`` in brackets):
  1. a (1), b (4): threshold 2ab/(a+b) = 1.6, positive definiteness lost at sqrt(ab) = 2;
  2. theta(c) on a grid of ``grid`` (200) values of c for the plain and the scaled sketch
     (scaled: B = I, theta = 1);
  3. the condition evaluated just below and just above the threshold;
  4. IST at step ``gamma`` (0.05) for ``iterations`` (25) from x_0 = the direction of W's
     smallest eigenvalue, for c below and above: above the
     threshold ||x_k||^2_L first grows (the L-norm is no longer a Lyapunov function), below it
     falls at every step. The iteration itself still converges: B is diagonal, so plain Perm-1
     IST decouples the coordinates here; what breaks is the guarantee, not this instance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from thinwire.theory.methods import IST, iterate
from thinwire.theory.params import Parameters, option
from thinwire.theory.plots import Curve, HLine, Panel, error_figure, markdown_table
from thinwire.theory.predictions import (
    sketch_moments,
    theorem1,
    two_by_two_check,
    two_by_two_threshold,
)
from thinwire.theory.problems import two_by_two
from thinwire.theory.registry import ExperimentResult

NAME = "counterexample-2x2"
TITLE = "The 2x2 counterexample"
MARGIN = 1.1  # the last case is c = 1.1 x threshold; L must stay positive definite there


@dataclass(frozen=True)
class Params(Parameters):
    """Parameters of "counterexample-2x2" (the defaults reproduce docs/THEORY.md section 4)."""

    experiment = NAME

    a: float = option(1.0, "first diagonal entry of L = [[a, c], [c, b]]", above=0, high=1e6)
    b: float = option(4.0, "second diagonal entry of L", above=0, high=1e6)
    gamma: float = option(0.05, "step size of the trajectories (absolute)", above=0)
    iterations: int = option(25, "iterations of the trajectories", low=1, high=100_000)
    grid: int = option(200, "values of c on the theta(c) curve", low=10, high=5000)
    seed: int = option(0, "seed of the Partitioner draws (any seed gives the same B)", low=0)

    def check(self) -> None:
        a, b = self.a, self.b
        cut = MARGIN * 2 * a * b / (a + b)
        if cut >= math.sqrt(a * b):
            raise self.fail(
                f"--a {a:g} and --b {b:g} are too close: {MARGIN:g} x 2ab/(a+b) = {cut:.4g} must "
                f"stay below sqrt(ab) = {math.sqrt(a * b):.4g}, where L stops being positive "
                "definite; make b/a at least 2.5 (or at most 0.4), e.g. --a 1 --b 4"
            )
        if self.gamma >= 1 / max(a, b):
            raise self.fail(
                f"--gamma {self.gamma:g} is at or beyond 1/max(a, b) = {1 / max(a, b):.4g}, where "
                f"plain IST itself diverges; use a --gamma below {1 / max(a, b):.4g}"
            )


def _theta(a: float, b: float, c: float, sketch: str) -> float:
    problem = two_by_two(a, b, c)
    return theorem1(problem, sketch_moments(problem, IST(sketch))).theta


def _theta_panel(p: Params, threshold: float) -> Panel:
    A, B = p.a, p.b
    cs = np.linspace(0.0, 0.995 * math.sqrt(A * B), p.grid)  # step 2
    curves = []
    for j, sketch in enumerate(("perm", "scaled")):
        th = np.array([_theta(A, B, c, sketch) for c in cs])
        curves.append(
            Curve(
                f"{IST(sketch).name}: theta",
                np.where(np.isfinite(th), th, np.nan),
                x=cs,
                color=f"C{j}",
            )
        )
    vlines = (
        HLine(f"2ab/(a+b) = {threshold:.3g}", threshold, color="r"),
        HLine(
            f"sqrt(ab) = {math.sqrt(A * B):.3g}: L not PD beyond",
            math.sqrt(A * B),
            color="k",
            style=":",
        ),
    )
    return Panel(
        f"smallest theta, a={A:g}, b={B:g} (gap = no theta exists)",
        curves,
        (),
        xlabel="off-diagonal c",
        ylabel="theta",
        vlines=vlines,
    )


def _trajectory(p: Params, c: float) -> tuple[np.ndarray, float]:
    """Step 4: errors from the worst direction, and the relative change of the first step."""
    problem = two_by_two(p.a, p.b, c)
    m = sketch_moments(problem, IST("perm"))
    L = problem.L_bar
    W = 0.5 * (L @ m.EB + m.EB.T @ L)
    v = np.linalg.eigh(W)[1][:, 0]
    x0 = v / math.sqrt(v @ L @ v)
    rounds = IST("perm").rounds(problem, p.iterations, p.seed)
    err = problem.error(iterate(rounds, x0, [p.gamma]))[0]
    return err, float((err[1] - err[0]) / err[0])


def run(out_dir: Path, params: Params | None = None) -> ExperimentResult:
    """Steps 1-4; deterministic (the seed draws the partitions, which all give the same B)."""
    p = params if params is not None else Params()
    A, B, GAMMA = p.a, p.b, p.gamma
    threshold = two_by_two_threshold(A, B)  # step 1
    rows: list[list[object]] = []
    numbers: dict[str, float] = {"threshold": threshold}
    cases = [
        ("0.9 x threshold", 0.9 * threshold),
        ("threshold (1 - 1e-6)", threshold * (1 - 1e-6)),
        ("threshold (1 + 1e-6)", threshold * (1 + 1e-6)),
        (f"{MARGIN:g} x threshold", MARGIN * threshold),
    ]
    curves = []
    below_rises = False
    for j, (label, c) in enumerate(cases):  # step 3
        check = two_by_two_check(A, B, c)
        err, first = _trajectory(p, c)
        monotone = bool(np.all(np.diff(err) <= 0))
        rows.append([label, c, check.lambda_min_W, check.theta,
                     "holds" if check.holds else "fails", _theta(A, B, c, "scaled"), first,
                     "yes" if monotone else "no"])
        numbers[f"{label}/theta"] = check.theta
        numbers[f"{label}/first_step_change"] = first
        below_rises = below_rises or (j == 1 and first > 0)
        if j in (0, 3):
            curves.append(Curve(f"c = {c:.3g} ({label})", err, color=f"C{j}"))
    traj = Panel(f"plain Perm-1 IST, gamma={GAMMA:g}, x_0 = W's worst direction", curves, ())
    fig = error_figure(
        out_dir / f"{NAME}.png",
        [_theta_panel(p, threshold), traj],
        f"2x2 counterexample: the plain sketch breaks Theorem 1's condition at c > 2ab/(a+b), a={A:g}, b={B:g}",
    )
    headers = ["c", "value", "lambda_min(W)", "theta (plain)", "condition", "theta (scaled)",
               "first-step change of ||x||^2_L", "error monotone"]
    summary = (
        f"L = [[{A:g}, c], [c, {B:g}]] on two identical workers, plain Perm-1 sketch; the threshold "
        f"2ab/(a+b) = {threshold:.6g} is computed, and theta is the smallest value with "
        "E[B L B] <= theta W (inf: none exists). The scaled sketch keeps theta = 1 for every c. "
        f"Just below the threshold theta is finite but huge, so the guarantee needs gamma < 2/theta; "
        f"at gamma = {GAMMA:g} the error there {'rises' if below_rises else 'does not rise'} in the "
        f"first step{' too' if below_rises else ''}. Plain IST still converges "
        "on this instance (B is diagonal): what the counterexample breaks is the L-norm descent "
        "that Theorem 1's proof relies on."
    )
    return ExperimentResult(NAME, TITLE, markdown_table(headers, rows), (fig,), numbers, summary)
