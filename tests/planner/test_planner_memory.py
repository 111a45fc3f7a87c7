"""Memory formulas pinned to published points (Korthikanti et al. 2022 Fig. 1; ZeRO paper;
Narayanan et al. 2021 Table 1 parameter counts; the IST subnet fractions of ist.md)."""

from __future__ import annotations

import dataclasses

import pytest

from thinwire.planner.memory import (
    GIB,
    ParamBytes,
    activation_bytes,
    ist_subnet_params,
    layer_activation_units,
    memory_breakdown,
    param_bytes,
    transformer_params_per_device,
    zero_model_states,
)
from thinwire.planner.presets import load_cluster
from thinwire.planner.published import korthikanti_memory, narayanan_table1
from thinwire.planner.specs import MLPSpec, TransformerSpec
from thinwire.planner.strategy import StrategySpec

A100 = load_cluster("a100-80gb")


@pytest.mark.parametrize("point", korthikanti_memory(), ids=lambda p: p.label)
def test_korthikanti_fig1_activations_and_states_within_one_percent(point):
    acts = memory_breakdown(point.model, A100, point.strategy).activations / GIB
    states = transformer_params_per_device(point.model, point.strategy, embeddings=False) * 18 / GIB
    assert acts == pytest.approx(point.activations_gib, rel=0.01)
    assert states == pytest.approx(point.model_states_gib, rel=0.01)
    # the formulas reproduce the figure to its printed precision
    assert abs(acts - point.activations_gib) < 0.006


def test_megatron_accounting_is_18_bytes_and_zero_is_16():
    assert param_bytes(StrategySpec(dtype="bf16"), A100).total == 18
    assert param_bytes(StrategySpec(dtype="bf16", accounting="zero"), A100).total == 16
    assert param_bytes(StrategySpec(dtype="fp32"), A100).total == 16  # w 4 + g 4 + m, v 8
    assert param_bytes(StrategySpec(dtype="fp32", optimizer="sgd"), A100).total == 8


@pytest.mark.parametrize("stage,gb", [(0, 120.0), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_example(stage, gb):
    got = sum(zero_model_states(7.5e9, 64, stage, ParamBytes(2.0, 2.0, 12.0))) / 1e9
    assert got == pytest.approx(gb, abs=0.05)  # the paper rounds to 3 digits


def test_activation_table_rows_for_a_config_outside_the_figure():
    model = TransformerSpec("x", layers=4, hidden=1024, heads=16, seq=512, vocab=1000)
    s, b, h, a, t = 512, 2, 1024, 16, 4
    unit = s * b * h
    rows = {
        ("none", False): unit * (10 + 24 / t + 5 * a * s / (h * t)),
        ("none", True): unit / t * (34 + 5 * a * s / h),
        ("selective", True): 34 * unit / t,
        ("selective", False): unit * (10 + 24 / t),
        ("full", False): 2 * unit,
    }
    for (rec, sp), want in rows.items():
        assert layer_activation_units(model, t, sp, rec) * unit == pytest.approx(want)
    assert layer_activation_units(model, 1, False, "none") == pytest.approx(34 + 5 * a * s / h)


def test_1f1b_in_flight_and_interleaving_factor():
    model = TransformerSpec("x", layers=8, hidden=256, heads=4, seq=128, vocab=100)
    base = StrategySpec(dp=1, tp=1, pp=4, micro_batches=2)
    per_layer = layer_activation_units(model, 1, False, "none") * 128 * 256
    # m < p: the first stage holds m micro-batches of L/p layers
    assert activation_bytes(model, base) == pytest.approx(per_layer * 2 * 2)
    full = dataclasses.replace(base, micro_batches=8)
    assert activation_bytes(model, full) == pytest.approx(per_layer * 8)  # L layers' worth
    inter = dataclasses.replace(full, interleave=2)
    assert activation_bytes(model, inter) == pytest.approx(per_layer * 8 * (1 + 3 / 8))


@pytest.mark.parametrize("run", narayanan_table1(), ids=lambda r: r.label)
def test_parameter_counts_match_narayanan_table1(run):
    published = float(run.label.rstrip("B"))
    assert run.model.params / 1e9 == pytest.approx(published, abs=0.051)


def test_ist_subnet_fractions_from_ist_notes():
    mlp = MLPSpec("digits", (64, 512, 512, 10))
    assert mlp.params == 301_066
    assert ist_subnet_params(mlp, 4) / mlp.params == pytest.approx(0.087, abs=0.0005)
    assert ist_subnet_params(mlp, 8) / mlp.params == pytest.approx(0.030, abs=0.0005)
    # d*h/n + (L-1) h^2/n^2 + h*C/n + vectors, written out for n = 4
    assert ist_subnet_params(mlp, 4) == 64 * 128 + 128 * 128 + 128 * 10 + (128 + 128 + 10)


def test_ist_memory_scales_with_the_subnet():
    mlp = MLPSpec("m", (784, 2048, 2048, 10))
    cpu = load_cluster("cpu-1gbe", nodes=8)
    dp = memory_breakdown(mlp, cpu, StrategySpec(dp=8))
    ist = memory_breakdown(mlp, cpu, StrategySpec(dp=8, method="ist"))
    ratio = ist_subnet_params(mlp, 8) / mlp.params
    assert ist.model_states == pytest.approx(dp.model_states * ratio)
    assert ist.activations < dp.activations


def test_zero_and_offload_reduce_device_memory():
    model = TransformerSpec("x", layers=24, hidden=2048, heads=16, seq=1024, vocab=50000)
    cluster = load_cluster("a100-80gb", nodes=1)
    states = [
        memory_breakdown(model, cluster, StrategySpec(dp=8, zero=z)).model_states for z in range(4)
    ]
    assert states == sorted(states, reverse=True) and states[0] > 7 * states[3]
    off = memory_breakdown(model, cluster, StrategySpec(dp=8, offload=True))
    assert off.optimizer == 0 and off.weights > 0
