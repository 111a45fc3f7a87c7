"""The search returns only feasible plans, fastest first."""

from __future__ import annotations

import pytest

from thinwire.errors import UsageError
from thinwire.planner.presets import load_cluster, load_model
from thinwire.planner.search import candidates, divisors, search
from thinwire.planner.step import predict
from thinwire.planner.strategy import StrategySpec, check_strategy


def test_gpt3_175b_on_8_nodes_is_feasible_and_sorted():
    model, cluster = load_model("gpt3-175b"), load_cluster("a100-80gb", nodes=8)
    plans = search(model, cluster, StrategySpec(), 1536)
    assert len(plans) == 195  # the strategies of the search space that fit (docs/PLANNER.md)
    times = [p.step_time for p in plans]
    assert times == sorted(times)
    for p in plans:
        s = p.strategy
        check_strategy(model, cluster, s)  # raises if infeasible
        assert p.memory.total <= cluster.device_memory
        assert s.dp * s.tp * s.pp == cluster.devices
        assert s.tp <= cluster.devices_per_node
        assert s.global_batch() == 1536
    # a plan that does not fit never appears: plain data parallel needs ~3 TB per GPU; only
    # ZeRO-3 (~49 GB of model states per GPU) lets tp = pp = 1 in
    assert all(p.strategy.tp * p.strategy.pp > 1 or p.strategy.zero == 3 for p in plans)


def test_search_rejects_every_plan_when_nothing_fits():
    model, cluster = load_model("megatron-1t"), load_cluster("a100-80gb", nodes=1)
    assert search(model, cluster, StrategySpec(), 8) == []


def test_candidates_cover_the_published_175b_strategy():
    model, cluster = load_model("megatron-175b"), load_cluster("a100-80gb", nodes=8)
    strategies = {
        (s.tp, s.pp, s.interleave, s.recompute, s.sequence_parallel)
        for s in candidates(model, cluster, StrategySpec(), 64)
    }
    assert (8, 8, 3, "selective", True) in strategies
    # the best plan predicts no slower than the published configuration
    best = search(model, cluster, StrategySpec(), 64)[0]
    published = StrategySpec(
        tp=8, pp=8, micro_batches=64, interleave=3, recompute="selective", sequence_parallel=True
    )
    assert best.step_time <= predict(model, cluster, published).step_time


def test_mlp_search_is_pure_data_parallel():
    model, cluster = load_model("mlp-784-2048-2048-10"), load_cluster("cpu-10gbe", nodes=4)
    plans = search(model, cluster, StrategySpec(), 512)
    assert [p.strategy.micro_batch_size for p in plans] == [128, 64, 32, 16, 8, 4, 2, 1]
    assert all(p.strategy.dp == 4 and p.strategy.tp == 1 for p in plans)


def test_search_needs_a_batch_and_divisors():
    with pytest.raises(UsageError):
        search(load_model("gpt2-small"), load_cluster("h100"), StrategySpec(), 0)
    assert divisors(12) == [1, 2, 3, 4, 6, 12]
