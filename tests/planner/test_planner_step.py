"""Step-time model: published Megatron runs, the pipeline bubble, and the sync methods."""

from __future__ import annotations

import dataclasses

import pytest

from thinwire.planner.comm import Link, allreduce
from thinwire.planner.compute import layer_cost, logits_cost, matmul_efficiency
from thinwire.planner.methods import worker_params
from thinwire.planner.presets import load_cluster, load_model
from thinwire.planner.published import korthikanti_times, narayanan_table1
from thinwire.planner.specs import MLPSpec, TransformerSpec
from thinwire.planner.step import predict
from thinwire.planner.strategy import StrategySpec
from thinwire.planner.validation import all_runs, error, fit_compute_efficiency

A100 = load_cluster("a100-80gb")


@pytest.mark.parametrize("run", korthikanti_times() + narayanan_table1(), ids=lambda r: r.label)
def test_published_runs_within_ten_percent(run):
    assert abs(error(run, A100)) < 0.10


def test_mean_error_over_published_runs_is_calculon_class():
    errs = [abs(error(r, A100)) for r in all_runs()]
    assert sum(errs) / len(errs) < 0.045
    assert max(errs) < 0.08


def test_preset_compute_efficiency_is_the_fit():
    fit = fit_compute_efficiency(all_runs(), dataclasses.replace(A100, compute_efficiency=1.0))
    assert A100.compute_efficiency == pytest.approx(fit, abs=0.002)


def test_korthikanti_mfu_anchor_175b():
    run = korthikanti_times()[3]  # 175B SP + selective: MFU 51.4% (Korthikanti Table 5)
    assert run.label == "175B SP + selective"
    cluster = dataclasses.replace(A100, nodes=8)
    assert predict(run.model, cluster, run.strategy).mfu == pytest.approx(0.514, rel=0.05)


def test_matmul_efficiency_curve():
    curve = A100.matmul_efficiency
    assert matmul_efficiency(1.0, curve) == pytest.approx(0.6)
    assert matmul_efficiency(16.0, curve) == pytest.approx(0.9)
    assert matmul_efficiency(500.0, curve) == pytest.approx(0.99)
    assert matmul_efficiency(4.0, curve) == pytest.approx(0.75)  # halfway in log size
    assert matmul_efficiency(0.01, curve) < matmul_efficiency(0.5, curve) < 0.6


def _ideal_cluster(nodes: int):
    return dataclasses.replace(
        A100,
        nodes=nodes,
        intra_bandwidth=1e18,
        inter_bandwidth=1e18,
        intra_latency=0.0,
        inter_latency=0.0,
    )


def test_bubble_is_p_minus_1_over_v_m_of_the_pipeline():
    model = TransformerSpec("x", layers=32, hidden=4096, heads=32, seq=2048, vocab=51200)
    cluster = _ideal_cluster(4)
    s = StrategySpec(
        dp=1, tp=8, pp=4, micro_batches=16, recompute="selective", sequence_parallel=True
    )
    one = predict(model, cluster, s).breakdown
    two = predict(model, cluster, dataclasses.replace(s, interleave=2)).breakdown
    assert two.bubble == pytest.approx(one.bubble / 2, rel=1e-6)
    layer = layer_cost(model, cluster, 1, 8, True, "selective", "bf16")
    logits = logits_cost(model, cluster, 1, 8, True, "bf16")
    mean_stage = (32 * layer.total + logits.total) / 4  # one micro-batch, averaged over stages
    assert one.bubble == pytest.approx((4 - 1) * mean_stage, rel=1e-6)
    # the ideal time is m micro-batches on the slowest (last) stage
    assert one.compute + one.tp_comm == pytest.approx(
        16 * (8 * layer.total + logits.total), rel=1e-6
    )


def test_recompute_trades_time_for_memory():
    model = load_model("megatron-22b")
    cluster = load_cluster("a100-80gb", nodes=1)
    preds = {
        r: predict(model, cluster, StrategySpec(tp=8, micro_batch_size=4, recompute=r))
        for r in ("none", "selective", "full")
    }
    times = [preds[r].step_time for r in ("none", "selective", "full")]
    mems = [preds[r].memory.activations for r in ("none", "selective", "full")]
    assert times == sorted(times) and mems == sorted(mems, reverse=True)


def _mlp_run(method: str, bandwidth: float, **kw):
    mlp = MLPSpec("m", (784, 2048, 2048, 10))
    cluster = dataclasses.replace(load_cluster("cpu-1gbe", nodes=8), inter_bandwidth=bandwidth)
    s = StrategySpec(dp=8, micro_batch_size=64, method=method, **kw)
    return mlp, predict(mlp, cluster, s)


PSI = 784 * 2048 + 2048 * 2048 + 2048 * 10 + 2048 + 2048 + 10


def test_local_sgd_divides_dp_traffic_and_time_by_h():
    _, dp = _mlp_run("", 125e6)
    _, local = _mlp_run("localsgd", 125e6)  # H = 10, the method's default
    assert dp.traffic.dp_payload == 4 * PSI
    assert local.traffic.dp_payload == pytest.approx(4 * PSI / 10)
    assert local.traffic.dp == pytest.approx(2 * 7 / 8 * 4 * PSI / 10)
    assert local.breakdown.dp_comm == pytest.approx(dp.breakdown.dp_comm / 10)
    assert local.breakdown.compute == pytest.approx(dp.breakdown.compute)
    _, h20 = _mlp_run("localsgd:period=20", 125e6)
    assert h20.traffic.dp_payload == pytest.approx(4 * PSI / 20)


def test_compression_only_where_it_pays():
    _, slow = _mlp_run("topk:ratio=0.01", 125e6)
    _, fast = _mlp_run("topk:ratio=0.01", 1e13)
    _, ddp_fast = _mlp_run("dp", 1e13)
    assert slow.compressed and slow.breakdown.codec == pytest.approx(4 * 4 * PSI / (50e9 * 0.9))
    assert not fast.compressed and fast.step_time == pytest.approx(ddp_fast.step_time)
    assert fast.breakdown.codec == 0.0 and fast.traffic.dp_payload == 4 * PSI


def test_ist_bytes_and_time_come_from_its_traffic_formula():
    """Central IST (K = 5), 8 workers, widths divisible by 8: every worker's subnet has S
    elements, S - 10 of them its own (the output bias is shared); rank 0 sends 7 pieces of
    S - 10 and gets them back each round; the shared bias (10 floats) is averaged by one
    all-reduce (ring: round(2 * 7/8 * 40) = 70 bytes sent). The published form: disjoint
    subnets, no optimizer state travelling."""
    published = "ist:local_steps=5,overlap=1,optimizer_state=reset"
    mlp, ist = _mlp_run(published, 125e6)
    sub = 784 * 256 + 256 * 256 + 256 * 10 + 256 + 256 + 10
    assert worker_params(mlp, 8, published) == sub
    piece = 4 * (sub - 10)
    assert ist.traffic.dp == pytest.approx((7 * piece + 70) / 5)  # rank 0's link
    # payload counts both directions: rank 0 14 pieces, each worker 2, all the bias's 40 bytes
    assert ist.traffic.dp_payload == pytest.approx(((14 * piece + 7 * 2 * piece) / 8 + 40) / 5)
    link = Link.of(125e6, 0.9, 50e-6)
    want = (2 * 7 * link.alpha + 2 * 7 * piece * link.beta + allreduce(40, 1, 8, link, link)) / 5
    assert ist.breakdown.dp_comm == pytest.approx(want)
    _, sharded = _mlp_run(published + ",deployment=sharded", 125e6)
    assert sharded.traffic.dp < ist.traffic.dp / 3  # no hot spot on rank 0
    assert sharded.breakdown.dp_comm < ist.breakdown.dp_comm


def test_plan_ist_defaults_are_the_methods_own():
    from thinwire.models.resnet import ResISTAdapter
    from thinwire.planner.methods import resolve
    from thinwire.strategies.ist.method import Options

    ist = resolve("ist")
    assert ist.options == Options() and ist.label == "ist(K=auto,central,auto,overlap=auto)"
    assert (ist.options.overlap, ist.options.optimizer_state) == (0, "auto")
    assert resolve("ist:overlap=1,optimizer_state=reset").label == "ist(K=auto,central)"
    # K = 0 is the model's own: 10 for a plain stack, ResIST's 50 for the ResNet
    assert ist.entry.sync_every_for(ist.options, None) == 10
    assert ist.entry.sync_every_for(ist.options, ResISTAdapter) == 50
    assert ist.entry.sync_every_for(Options(local_steps=7), ResISTAdapter) == 7
