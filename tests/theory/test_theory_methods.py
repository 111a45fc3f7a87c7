"""Methods of the theory lab: vectorised IST equals the literal algorithm; convergence."""

import numpy as np
import pytest

from thinwire.strategies.ist.partition import perm_sketch_blocks
from thinwire.theory.methods import (
    IST,
    SKETCHES,
    GradientDescent,
    RandKGD,
    initial_point,
    ist_step_reference,
    iterate,
)
from thinwire.theory.problems import make_quadratics, standard_instance


@pytest.mark.parametrize("sketch", SKETCHES)
@pytest.mark.parametrize("d,n", [(10, 10), (12, 4)])
def test_vectorised_ist_equals_literal_step(sketch, d, n):
    p = make_quadratics(d, n, seed=3)
    x = initial_point(d, 1)
    rounds = IST(sketch).rounds(p, 5, seed=11)
    for k in range(5):
        blocks = perm_sketch_blocks(d, n, 11, k)
        expected = ist_step_reference(p, x, blocks, sketch, gamma=0.3)
        got = x - 0.3 * (rounds.B[k] @ x - rounds.c[k])
        assert np.allclose(got, expected, rtol=1e-12, atol=1e-12)
        x = expected


def test_scaled_perm1_sketch_gives_identity_B():
    p = standard_instance()
    rounds = IST("scaled").rounds(p, 50, seed=0)
    assert np.allclose(rounds.B, np.eye(10))
    plain = IST("perm").rounds(p, 50, seed=0)
    assert not np.allclose(plain.B, np.eye(10))


def test_interpolation_scaled_sketch_converges_linearly():
    p = standard_instance(interpolation=True)
    xs = iterate(IST("scaled").rounds(p, 200, seed=0), initial_point(10, 0), [0.5])
    err = p.error(xs)[0]
    assert err[0] > 1.0
    assert err.min() < 1e-20
    assert np.flatnonzero(err < 1e-20)[0] <= 200


def test_gradient_descent_reaches_optimum():
    p = standard_instance()
    gamma = 1.0 / np.linalg.eigvalsh(p.L_bar)[-1]
    xs = iterate(GradientDescent().rounds(p, 1000, seed=0), initial_point(10, 0), [gamma])
    assert p.error(xs)[0, -1] < 1e-25
    assert np.allclose(xs[0, -1], p.x_star, atol=1e-10)


def test_randk_is_unbiased_and_ist_is_not():
    p = standard_instance()
    x = initial_point(10, 2)
    true_grad = p.L_bar @ x - p.b_bar
    r = RandKGD().rounds(p, 40000, seed=1)
    mean = (r.B @ x - r.c).mean(axis=0)
    assert np.linalg.norm(mean - true_grad) < 0.05 * np.linalg.norm(true_grad)
    s = IST("scaled").rounds(p, 40000, seed=1)
    ist_mean = (s.B @ x - s.c).mean(axis=0)
    assert np.linalg.norm(ist_mean - true_grad) > 0.2 * np.linalg.norm(true_grad)


def test_iterate_runs_several_step_sizes_at_once():
    p = standard_instance()
    r = IST("scaled").rounds(p, 30, seed=0)
    x0 = initial_point(10, 0)
    both = iterate(r, x0, [0.5, 0.1])
    alone = iterate(r, x0, [0.1])
    assert np.allclose(both[1], alone[0])


def test_precond_equals_scaled_on_identical_workers_only():
    homo = make_quadratics(10, 10, heterogeneity=0.0, seed=2)
    a, b = IST("precond").rounds(homo, 20, seed=0), IST("scaled").rounds(homo, 20, seed=0)
    assert np.allclose(a.B, b.B) and np.allclose(a.c, b.c)
    hetero = standard_instance()
    a, b = IST("precond").rounds(hetero, 20, seed=0), IST("scaled").rounds(hetero, 20, seed=0)
    assert not np.allclose(a.B, b.B)
