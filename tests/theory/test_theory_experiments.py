"""Each experiment from the command line with small parameters, and the parameters at work.

A parameter that were read but ignored would leave the numbers as they are: here each one
moves them the way the theory (Shulgin & Richtarik, ICML 2024) says it must.
"""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from thinwire.cli import main
from thinwire.theory.methods import IST, blocks_from_owners, draw_owners
from thinwire.theory.predictions import (
    bias_floor,
    fixed_point,
    paper_x_inf_scaled_perm1,
    sketch_moments,
    stationary_error,
)
from thinwire.theory.problems import make_quadratics, standard_instance

SRC = Path(__file__).resolve().parents[2] / "src" / "thinwire" / "theory"


def numbers(out: Path, name: str) -> dict[str, float]:
    return json.loads((out / f"{name}.json").read_text())["numbers"]


def run_cli(out: Path, *argv: str) -> None:
    assert main(["theory", *argv, "--out", str(out)]) == 0


def test_interpolation_small(tmp_path):
    run_cli(tmp_path, "interpolation", "--n", "4", "--d", "4,8", "--iterations", "60")
    md = (tmp_path / "interpolation.md").read_text()
    assert "| d=n=4 Perm-1 | IST scaled |" in md and "| d=8 n=4 Perm-2 | IST plain |" in md
    assert "error at k=60" in md
    assert (tmp_path / "interpolation.png").stat().st_size > 10_000


def test_interpolation_gamma_sets_the_scaled_perm1_rate(tmp_path):
    """Scaled Perm-1 has B = I and theta = 1: the error shrinks by (1 - gamma)^2 per step."""
    run_cli(tmp_path, "interpolation", "--q", "1", "--gamma", "0.3", "--iterations", "40")
    md = (tmp_path / "interpolation.md").read_text()
    row = next(line for line in md.splitlines() if "| IST scaled |" in line)
    cells = [c.strip() for c in row.strip("|").split("|")]
    gamma, predicted, measured = (float(c) for c in cells[4:7])
    assert gamma == pytest.approx(0.3) and "gamma = 0.3/theta" in md
    assert predicted == pytest.approx(0.49, rel=1e-3) and measured == pytest.approx(0.49, rel=1e-3)


def test_heterogeneous_n_moves_the_floor_as_predicted(tmp_path):
    """The reported floor is ||x_inf - x*||^2 with the paper's x_inf for the chosen n."""
    floors = {}
    for n in (4, 6):
        out = tmp_path / f"n{n}"
        run_cli(
            out,
            "heterogeneous",
            "--n",
            str(n),
            "--iterations",
            "300",
            "--tail",
            "100",
            "--gammas",
            "0.5,0.1",
        )
        p = make_quadratics(n, n, heterogeneity=1.0, seed=0)
        predicted = bias_floor(p, paper_x_inf_scaled_perm1(p))
        floors[n] = numbers(out, "heterogeneous")["IST scaled/floor"]
        assert floors[n] == pytest.approx(predicted, rel=1e-9)
        assert "plateau (last 100 of 300)" in (out / "heterogeneous.md").read_text()
    assert floors[4] != pytest.approx(floors[6], rel=1e-3)
    standard = standard_instance()
    assert floors[4] != pytest.approx(bias_floor(standard, paper_x_inf_scaled_perm1(standard)))


def test_heterogeneous_with_two_coordinates_per_worker(tmp_path):
    run_cli(
        tmp_path,
        "heterogeneous",
        "--n",
        "3",
        "--q",
        "2",
        "--iterations",
        "200",
        "--tail",
        "50",
        "--gammas",
        "0.5",
        "--mc-rounds",
        "500",
    )
    nums = numbers(tmp_path, "heterogeneous")
    assert nums["IST scaled/floor"] > 0 and nums["Rand-k CGD/floor"] < 1e-20
    md = (tmp_path / "heterogeneous.md").read_text()
    assert "paper's x_inf" not in md  # the closed form is for Perm-1 only
    p = make_quadratics(6, 3, seed=0)
    exact = fixed_point(sketch_moments(p, IST("scaled")))  # 6! = 720 permutations: exact
    assert nums["IST scaled/floor"] == pytest.approx(bias_floor(p, exact))


def test_homogeneity_levels_and_seeds(tmp_path):
    run_cli(
        tmp_path,
        "homogeneous-vs-heterogeneous",
        "--n",
        "4",
        "--heterogeneity",
        "0,1",
        "--iterations",
        "300",
        "--tail",
        "100",
        "--seeds",
        "0,1",
    )
    nums = numbers(tmp_path, "homogeneous-vs-heterogeneous")
    assert set(nums) == {
        f"seed={s}/h={h}/{k}"
        for s in (0, 1)
        for h in (0, 1)
        for k in ("sigma2", "ist_floor", "ist_plateau", "cgd_plateau")
    }
    for s in (0, 1):
        assert nums[f"seed={s}/h=0/sigma2"] < 1e-20 < nums[f"seed={s}/h=1/sigma2"]
        assert nums[f"seed={s}/h=0/ist_floor"] > 1e-3  # identical workers keep IST's bias
    assert nums["seed=0/h=1/ist_floor"] != nums["seed=1/h=1/ist_floor"]
    md = (tmp_path / "homogeneous-vs-heterogeneous.md").read_text()
    assert "### seed 0" in md and "### seed 1" in md
    for s in (0, 1):
        assert (tmp_path / f"homogeneous-vs-heterogeneous-seed{s}.png").exists()


def test_counterexample_a_b_move_the_threshold(tmp_path):
    run_cli(
        tmp_path,
        "counterexample-2x2",
        "--a",
        "2",
        "--b",
        "10",
        "--gamma",
        "0.02",
        "--iterations",
        "10",
        "--grid",
        "20",
    )
    nums = numbers(tmp_path, "counterexample-2x2")
    assert nums["threshold"] == pytest.approx(2 * 2 * 10 / 12)
    assert math.isfinite(nums["threshold (1 - 1e-6)/theta"])
    assert math.isinf(nums["threshold (1 + 1e-6)/theta"])
    assert "L = [[2, c], [c, 10]]" in (tmp_path / "counterexample-2x2.md").read_text()


def test_seed_flag_still_works_with_all_names(tmp_path):
    run_cli(tmp_path, "counterexample-2x2", "--seed", "3")
    assert (tmp_path / "counterexample-2x2.png").exists()


# --- what the speed-ups rely on ----------------------------------------------------------------
@pytest.mark.parametrize("sketch", ["perm", "scaled"])
def test_stationary_stability_test_agrees_with_the_spectral_radius(sketch):
    """inf exactly when rho(E[A (x) A]) >= 1, the test by eigenvalues the LU solve replaces."""
    p = make_quadratics(4, 4, seed=1)
    m = sketch_moments(p, IST(sketch))
    d = p.d
    eye = np.eye(d)
    for gamma in np.geomspace(0.01, 4.0, 25):
        EAA = (
            np.einsum("ab,ce->abce", eye, eye)
            - gamma * (np.einsum("ab,ce->abce", eye, m.EB) + np.einsum("ab,ce->abce", m.EB, eye))
            + gamma**2 * m.EBB
        )
        T = EAA.transpose(0, 2, 1, 3).reshape(d * d, d * d)
        rho = np.max(np.abs(np.linalg.eigvals(T)))
        if abs(rho - 1) < 1e-6:
            continue
        assert math.isinf(stationary_error(p, m, gamma)) == (rho > 1), (gamma, rho)


@pytest.mark.parametrize("d,n,seed", [(10, 10, 0), (20, 10, 1), (12, 4, 7), (6, 3, 2)])
def test_lab_draws_are_the_partitioners(d, n, seed):
    """The numpy Perm-q draws equal the torch strategy's Partitioner, round by round."""
    from thinwire.strategies.ist.partition import perm_sketch_blocks

    owners = draw_owners(d, n, seed, 30)
    for r in range(30):
        ours = blocks_from_owners(owners[r], n)
        theirs = perm_sketch_blocks(d, n, seed, r)
        assert all(np.array_equal(a, b) for a, b in zip(ours, theirs, strict=True))
    later = draw_owners(d, n, seed, 5, first_round=25)
    assert np.array_equal(later, owners[25:])


def test_the_lab_runs_without_torch_or_a_process_group(tmp_path):
    code = (
        "import sys; from thinwire.cli import main; "
        f"assert main(['theory', '--list']) == 0; "
        f"assert main(['theory', 'counterexample-2x2', '--grid', '10', '--out', {str(tmp_path)!r}]) == 0; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', "
        "'thinwire.runtime', 'thinwire.strategies'))]; "
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_no_import_cycle_in_the_theory_package():
    """Every import of a theory module (module level or in a function) points down the stack."""
    graph: dict[str, set[str]] = {}
    for path in SRC.glob("*.py"):
        mod = path.stem
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            for name in names:
                if name.startswith("thinwire.theory."):
                    target = name.split(".")[2]
                    if target != mod and (SRC / f"{target}.py").exists():
                        edges.add(target)
        graph[mod] = edges

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        for nxt in graph[start]:
            if nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})):
                return True
        return False

    cyclic = [m for m in graph if reaches(m, m, {m})]
    assert not cyclic, cyclic
    assert "experiments" not in graph["registry"]
