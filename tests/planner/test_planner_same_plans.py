"""The configurations both Megatron papers measured: found by their dimensions, converted to
seconds by Narayanan's Eq. 3, and the planner's difference between them (d only)."""

from __future__ import annotations

import pytest

from thinwire.planner.presets import load_cluster
from thinwire.planner.published import narayanan_table1
from thinwire.planner.validation import predicted_metric, same_plans, seconds_of


def test_the_two_shared_configurations_and_their_gap():
    plans = same_plans(load_cluster("a100-80gb"))
    assert [p.label.split()[0] for p in plans] == ["530B", "1T"]
    for p in plans:
        measured = p.seconds[1] / p.seconds[0] - 1
        predicted = p.predicted[1] / p.predicted[0] - 1
        assert measured > 0.08 and 0 <= predicted < 0.01


def test_seconds_of_inverts_the_tflops_of_eq3():
    cluster = load_cluster("a100-80gb")
    run = narayanan_table1()[-1]
    tflops = predicted_metric(run, cluster)
    import dataclasses

    from thinwire.planner.step import predict

    nodes = run.strategy.devices // cluster.devices_per_node
    step = predict(run.model, dataclasses.replace(cluster, nodes=nodes), run.strategy).step_time
    assert seconds_of(run, tflops) == pytest.approx(step, rel=1e-9)
