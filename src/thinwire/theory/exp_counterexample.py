"""Experiment "counterexample-2x2": Shulgin & Richtarik, ICML 2024 (arXiv 2306.16484).

Two identical workers, L = [[a, c], [c, b]], b_i = 0, Perm-1. The plain sketch C_i = 2 e_j e_j^T
gives the deterministic B = 2 diag(a, b), so W = L diag(a, b) + diag(a, b) L, whose determinant
4 a^2 b^2 - c^2 (a + b)^2 turns negative exactly when c > 2ab/(a+b). Then no theta satisfies
E[B L B] <= theta W, although L is still positive definite up to c = sqrt(ab). Steps:
  1. a = 1, b = 4: threshold 2ab/(a+b) = 1.6, positive definiteness lost at sqrt(ab) = 2;
  2. theta(c) on a grid of c for the plain and the scaled sketch (scaled: B = I, theta = 1);
  3. the condition evaluated just below and just above the threshold;
  4. IST from x_0 = the direction of W's smallest eigenvalue, for c below and above: above the
     threshold ||x_k||^2_L first grows (the L-norm is no longer a Lyapunov function), below it
     falls at every step. The iteration itself still converges: B is diagonal, so plain Perm-1
     IST decouples the coordinates here; what breaks is the guarantee, not this instance.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from thinwire.theory.methods import IST, iterate
from thinwire.theory.plots import Curve, HLine, Panel, error_figure, markdown_table
from thinwire.theory.predictions import (
    sketch_moments,
    theorem1,
    two_by_two_check,
    two_by_two_threshold,
)
from thinwire.theory.problems import two_by_two
from thinwire.theory.registry import ExperimentResult

A, B = 1.0, 4.0
GAMMA = 0.05
ITERATIONS = 25


def _theta(c: float, sketch: str) -> float:
    problem = two_by_two(A, B, c)
    return theorem1(problem, sketch_moments(problem, IST(sketch))).theta


def _theta_panel(threshold: float) -> Panel:
    cs = np.linspace(0.0, 0.995 * math.sqrt(A * B), 200)  # step 2
    curves = []
    for j, sketch in enumerate(("perm", "scaled")):
        th = np.array([_theta(c, sketch) for c in cs])
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


def _trajectory(c: float) -> tuple[np.ndarray, float]:
    """Step 4: errors from the worst direction, and the relative change of the first step."""
    problem = two_by_two(A, B, c)
    m = sketch_moments(problem, IST("perm"))
    L = problem.L_bar
    W = 0.5 * (L @ m.EB + m.EB.T @ L)
    v = np.linalg.eigh(W)[1][:, 0]
    x0 = v / math.sqrt(v @ L @ v)
    rounds = IST("perm").rounds(problem, ITERATIONS, 0)
    err = problem.error(iterate(rounds, x0, [GAMMA]))[0]
    return err, float((err[1] - err[0]) / err[0])


def run(out_dir: Path, seed: int) -> ExperimentResult:
    """Steps 1-4; deterministic (the seed is not used: both Perm-1 partitions give the same B)."""
    threshold = two_by_two_threshold(A, B)  # step 1
    rows: list[list[object]] = []
    numbers: dict[str, float] = {"threshold": threshold}
    cases = [
        ("0.9 x threshold", 0.9 * threshold),
        ("threshold (1 - 1e-6)", threshold * (1 - 1e-6)),
        ("threshold (1 + 1e-6)", threshold * (1 + 1e-6)),
        ("1.1 x threshold", 1.1 * threshold),
    ]
    curves = []
    for j, (label, c) in enumerate(cases):  # step 3
        check = two_by_two_check(A, B, c)
        err, first = _trajectory(c)
        monotone = bool(np.all(np.diff(err) <= 0))
        rows.append(
            [
                label,
                c,
                check.lambda_min_W,
                check.theta,
                "holds" if check.holds else "fails",
                _theta(c, "scaled"),
                first,
                "yes" if monotone else "no",
            ]
        )
        numbers[f"{label}/theta"] = check.theta
        numbers[f"{label}/first_step_change"] = first
        if j in (0, 3):
            curves.append(Curve(f"c = {c:.3g} ({label})", err, color=f"C{j}"))
    traj = Panel(f"plain Perm-1 IST, gamma={GAMMA:g}, x_0 = W's worst direction", curves, ())
    fig = error_figure(
        out_dir / "counterexample-2x2.png",
        [_theta_panel(threshold), traj],
        f"2x2 counterexample: the plain sketch breaks Theorem 1's condition at c > 2ab/(a+b), a={A:g}, b={B:g}",
    )
    headers = [
        "c",
        "value",
        "lambda_min(W)",
        "theta (plain)",
        "condition",
        "theta (scaled)",
        "first-step change of ||x||^2_L",
        "error monotone",
    ]
    summary = (
        f"L = [[{A:g}, c], [c, {B:g}]] on two identical workers, plain Perm-1 sketch; the threshold "
        f"2ab/(a+b) = {threshold:.6g} is computed, and theta is the smallest value with "
        "E[B L B] <= theta W (inf: none exists). The scaled sketch keeps theta = 1 for every c. "
        f"Just below the threshold theta is finite but huge, so the guarantee needs gamma < 2/theta; "
        f"at gamma = {GAMMA:g} the error there rises in the first step too. Plain IST still converges "
        "on this instance (B is diagonal): what the counterexample breaks is the L-norm descent "
        "that Theorem 1's proof relies on."
    )
    return ExperimentResult(
        "counterexample-2x2",
        "The 2x2 counterexample",
        markdown_table(headers, rows),
        (fig,),
        numbers,
        summary,
    )
