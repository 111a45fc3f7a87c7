"""Predictions of the theory lab against runs and against each other."""

import math

import numpy as np
import pytest

from thinwire.theory.methods import IST, RandKGD, draw_owners, initial_point, iterate
from thinwire.theory.predictions import (
    all_owners,
    bias_floor,
    fixed_point,
    moments_from_rounds,
    paper_x_inf_scaled_perm1,
    perm1_moments,
    randk_moments,
    sketch_moments,
    stationary_error,
    theorem1,
    two_by_two_check,
    two_by_two_threshold,
)
from thinwire.theory.problems import make_quadratics, standard_instance


@pytest.fixture(scope="module")
def small_step_run():
    """Scaled IST on the standard instance at gamma = 0.02, long enough to be stationary."""
    p = standard_instance()
    K = 6000
    xs = iterate(IST("scaled").rounds(p, K, seed=0), initial_point(10, 0), [0.02])[0]
    return p, xs


def test_paper_closed_form_is_the_fixed_point_of_the_expected_update():
    p = standard_instance()
    x_inf = fixed_point(sketch_moments(p, IST("scaled")))
    assert np.allclose(x_inf, paper_x_inf_scaled_perm1(p), rtol=1e-12, atol=1e-14)
    assert p.error(x_inf) > 0.1  # and it is not x*


@pytest.mark.parametrize("sketch", ["perm", "scaled", "precond"])
def test_perm1_closed_form_moments_equal_enumeration(sketch):
    p = make_quadratics(5, 5, seed=2)
    exact = perm1_moments(p, sketch)
    enum = moments_from_rounds(IST(sketch).affine(p, all_owners(5, 5)), "enum")
    for field in ("EB", "Ec", "EBB", "EBc", "Ecc"):
        assert np.allclose(getattr(exact, field), getattr(enum, field), rtol=1e-12, atol=1e-12), (
            field
        )


def test_monte_carlo_moments_from_partitioner_approach_enumeration():
    p = make_quadratics(6, 3, seed=2)  # Perm-2: 720 permutations
    enum = sketch_moments(p, IST("perm"))
    assert enum.how.startswith("exact")
    mc = moments_from_rounds(IST("perm").affine(p, draw_owners(6, 3, 5, 4000)), "mc")
    scale = np.abs(enum.EBB).max()
    assert np.abs(mc.EBB - enum.EBB).max() < 0.05 * scale
    assert np.abs(mc.EB - enum.EB).max() < 0.05 * np.abs(enum.EB).max()


def test_randk_exact_moments_match_monte_carlo():
    p = make_quadratics(6, 3, seed=2)
    exact = randk_moments(p, 2)
    mc = moments_from_rounds(RandKGD(k=2).rounds(p, 60000, seed=3), "mc")
    assert np.abs(mc.EBB - exact.EBB).max() < 0.03 * np.abs(exact.EBB).max()
    assert np.abs(mc.Ecc - exact.Ecc).max() < 0.03 * np.abs(exact.Ecc).max()
    assert np.allclose(fixed_point(exact), p.x_star)  # unbiased: limit point is x*


def test_heterogeneous_plateau_sits_on_the_predicted_floor(small_step_run):
    p, xs = small_step_run
    floor = bias_floor(p, paper_x_inf_scaled_perm1(p))
    plateau = p.error(xs[-3000:]).mean()
    assert 0.8 * floor <= plateau <= 1.25 * floor


def test_plateau_does_not_vanish_as_gamma_shrinks():
    p = standard_instance()
    m = sketch_moments(p, IST("scaled"))
    floor = bias_floor(p, fixed_point(m))
    preds = [stationary_error(p, m, g) for g in (1.0, 0.1, 0.01, 0.001)]
    assert all(a > b for a, b in zip(preds, preds[1:]))  # decreasing in gamma ...
    assert preds[-1] == pytest.approx(floor, rel=0.01)  # ... towards the floor, not zero
    xs = iterate(IST("scaled").rounds(p, 3000, seed=1), initial_point(10, 1), [0.5])[0]
    # and the predicted stationary error matches a run at a large step
    assert p.error(xs[-2000:]).mean() == pytest.approx(stationary_error(p, m, 0.5), rel=0.1)


def test_averaged_iterate_is_closer_to_x_inf_than_to_x_star(small_step_run):
    p, xs = small_step_run
    avg = xs[3000:].mean(axis=0)
    x_inf = paper_x_inf_scaled_perm1(p)
    assert p.error(avg, x_inf) < 0.05 * p.error(avg)


def test_scaled_sketch_has_theta_one_and_plain_does_not():
    p = standard_instance()
    assert theorem1(p, sketch_moments(p, IST("scaled"))).theta == pytest.approx(1.0, abs=1e-9)
    assert theorem1(p, sketch_moments(p, IST("perm"))).theta > 2.0


@pytest.mark.parametrize("a,b", [(1.0, 4.0), (2.0, 3.0), (0.5, 10.0)])
def test_two_by_two_condition_flips_at_threshold(a, b):
    t = two_by_two_threshold(a, b)
    assert t == pytest.approx(2 * a * b / (a + b))
    below, above = two_by_two_check(a, b, t * (1 - 1e-6)), two_by_two_check(a, b, t * (1 + 1e-6))
    assert below.holds and math.isfinite(below.theta) and below.lambda_min_W > 0
    assert not above.holds and above.lambda_min_W < 0
    assert two_by_two_check(a, b, 0.5 * t).theta < below.theta  # theta blows up towards t
