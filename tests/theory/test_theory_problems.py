"""Problem generators and Perm-q blocks of the theory lab (Shulgin & Richtarik, ICML 2024)."""

import numpy as np
import pytest

from thinwire.strategies.ist.partition import perm_sketch_blocks
from thinwire.theory.methods import draw_owners, owners_from_blocks
from thinwire.theory.problems import make_quadratics, standard_instance, two_by_two


def test_standard_instance_matches_its_definition():
    p = standard_instance()
    assert (p.n, p.d) == (10, 10)
    # L_i = A_i^T A_i / d + 0.1 I: every L_i - 0.1 I is PSD with rank <= d, so lambda_min(L_i) >= 0.1
    assert np.all(np.linalg.eigvalsh(p.L) >= 0.1 - 1e-12)
    assert np.allclose(p.L_bar @ p.x_star, p.b_bar)
    assert not p.interpolation


def test_seeded_and_reproducible():
    a, b, c = (
        make_quadratics(6, 3, seed=4),
        make_quadratics(6, 3, seed=4),
        make_quadratics(6, 3, seed=5),
    )
    assert np.array_equal(a.L, b.L) and np.array_equal(a.b, b.b)
    assert not np.allclose(a.L, c.L)


def test_heterogeneity_knob_ends():
    homo = make_quadratics(8, 4, heterogeneity=0.0, seed=1)
    assert np.allclose(homo.L, homo.L[0]) and np.allclose(homo.b, homo.b[0])
    assert homo.heterogeneity() < 1e-20
    hetero = make_quadratics(8, 4, heterogeneity=1.0, seed=1)
    assert not np.allclose(hetero.L, hetero.L[0])
    assert hetero.heterogeneity() > 0.1
    # separate knob for b: identical L_i, different b_i
    mixed = make_quadratics(8, 4, heterogeneity=0.0, b_heterogeneity=1.0, seed=1)
    assert np.allclose(mixed.L, mixed.L[0]) and not np.allclose(mixed.b, mixed.b[0])


def test_interpolation_has_zero_linear_terms():
    p = standard_instance(interpolation=True)
    assert np.all(p.b == 0) and p.interpolation
    assert np.allclose(p.x_star, 0)


@pytest.mark.parametrize(
    "kwargs", [{"heterogeneity": 1.5}, {"ridge": -1.0}, {"b_heterogeneity": -0.1}]
)
def test_bad_knobs_raise(kwargs):
    with pytest.raises(ValueError):
        make_quadratics(4, 2, **kwargs)


def test_two_by_two_shape():
    p = two_by_two(1.0, 4.0, 1.5)
    assert p.L.shape == (2, 2, 2) and np.allclose(p.L[1], [[1, 1.5], [1.5, 4]])


@pytest.mark.parametrize("d,n", [(10, 10), (20, 10), (12, 3), (8, 2)])
def test_perm_q_blocks_are_disjoint_and_cover(d, n):
    q = d // n
    for r in range(20):
        blocks = perm_sketch_blocks(d, n, 7, r)
        assert len(blocks) == n and all(len(b) == q for b in blocks)
        joined = np.concatenate(blocks)
        assert np.array_equal(np.sort(joined), np.arange(d))  # disjoint and covering
    owners = draw_owners(d, n, 7, 20)
    assert owners.shape == (20, d)
    assert np.all(np.stack([np.bincount(o, minlength=n) for o in owners]) == q)
    # the lab's owners are exactly the Partitioner's blocks
    assert np.array_equal(owners[3], owners_from_blocks(perm_sketch_blocks(d, n, 7, 3), d))


def test_owners_reject_uncovered_blocks_and_uneven_d():
    with pytest.raises(ValueError):
        owners_from_blocks([np.array([0, 1]), np.array([2])], 4)
    with pytest.raises(ValueError):
        draw_owners(10, 4, 0, 1)
