"""alpha-beta collective formulas (Thakur et al. 2005), written out by hand for small cases."""

from __future__ import annotations

import math

import pytest

from thinwire.planner.comm import (
    Link,
    all_gather,
    allreduce,
    dp_placement,
    p2p,
    pp_crosses_nodes,
    reduce_scatter,
    ring_all_gather_time,
    ring_all_reduce_time,
    ring_reduce_scatter_time,
    ring_wire_factor,
    tree_all_reduce_time,
)
from thinwire.planner.presets import load_cluster
from thinwire.planner.strategy import StrategySpec

LINK = Link(alpha=1e-5, beta=1e-9)  # 10 us, 1 GB/s


def test_ring_allreduce_formula():
    n, p = 8e6, 4
    want = 2 * 3 * 1e-5 + 2 * 3 / 4 * n * 1e-9 + 3 / 4 * n * 2e-10
    assert ring_all_reduce_time(n, p, LINK, gamma=2e-10) == pytest.approx(want)
    assert ring_all_reduce_time(n, 1, LINK) == 0.0


def test_reduce_scatter_and_all_gather_are_half_an_allreduce():
    n, p = 1e7, 8
    assert ring_reduce_scatter_time(n, p, LINK) == pytest.approx(7e-5 + 7 / 8 * n * 1e-9)
    assert ring_all_gather_time(n, p, LINK) == ring_reduce_scatter_time(n, p, LINK)
    assert 2 * ring_reduce_scatter_time(n, p, LINK) == pytest.approx(ring_all_reduce_time(n, p, LINK))


def test_tree_allreduce_and_p2p():
    assert tree_all_reduce_time(1e3, 8, LINK) == pytest.approx(2 * 3 * (1e-5 + 1e3 * 1e-9))
    assert tree_all_reduce_time(1e3, 5, LINK) == pytest.approx(
        2 * 3 * (1e-5 + 1e3 * 1e-9)
    )  # ceil(log2 5)
    assert p2p(5e6, LINK) == pytest.approx(1e-5 + 5e-3)


def test_tree_wins_small_messages_ring_wins_large():
    small, large = 1e2, 1e9
    assert tree_all_reduce_time(small, 64, LINK) < ring_all_reduce_time(small, 64, LINK)
    assert ring_all_reduce_time(large, 64, LINK) < tree_all_reduce_time(large, 64, LINK)
    assert allreduce(small, 1, 64, LINK, LINK) == tree_all_reduce_time(small, 64, LINK)
    assert allreduce(large, 1, 64, LINK, LINK) == ring_all_reduce_time(large, 64, LINK)


def test_hierarchical_allreduce_is_rs_intra_plus_ar_inter_plus_ag_intra():
    intra, inter = Link(1e-6, 1 / 200e9), Link(5e-6, 1 / 20e9)
    n, g, nodes = 4e9, 8, 16
    want = (
        ring_reduce_scatter_time(n, g, intra)
        + ring_all_reduce_time(n / g, nodes, inter)
        + ring_all_gather_time(n, g, intra)
    )
    assert allreduce(n, g, nodes, intra, inter) == pytest.approx(want)
    # cheaper than a flat ring over the slow links with every byte
    assert allreduce(n, g, nodes, intra, inter) < ring_all_reduce_time(n, g * nodes, inter)
    rs = reduce_scatter(n, g, nodes, intra, inter)
    assert rs == pytest.approx(
        ring_reduce_scatter_time(n, g, intra) + ring_reduce_scatter_time(n / g, nodes, inter)
    )
    assert all_gather(n, g, nodes, intra, inter) == pytest.approx(rs)


def test_wire_factor():
    assert ring_wire_factor(1) == 0
    assert ring_wire_factor(4) == pytest.approx(1.5)
    assert math.isclose(ring_wire_factor(1000), 2 * 999 / 1000)


def test_megatron_rank_placement():
    cluster = load_cluster("a100-80gb", nodes=8)
    assert dp_placement(cluster, StrategySpec(dp=64)) == (8, 8)
    assert dp_placement(cluster, StrategySpec(dp=8, tp=8)) == (1, 8)
    assert dp_placement(cluster, StrategySpec(dp=16, tp=4)) == (2, 8)
    assert dp_placement(cluster, StrategySpec(dp=2, tp=4, pp=8)) == (2, 1)
    assert pp_crosses_nodes(cluster, StrategySpec(dp=1, tp=8, pp=8))
    assert not pp_crosses_nodes(load_cluster("a100-80gb", nodes=1), StrategySpec(dp=1, tp=4, pp=2))
