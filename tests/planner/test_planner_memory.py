"""Memory formulas pinned to published points (Korthikanti et al. 2022 Fig. 1; ZeRO paper;
Narayanan et al. 2021 Table 1 parameter counts; the IST subnet fractions of ist.md), the fused
attention kernel and the logits."""

from __future__ import annotations

import dataclasses

import pytest

from thinwire.planner.memory import (
    GIB,
    ParamBytes,
    activation_bytes,
    layer_activation_units,
    logits_bytes,
    memory_breakdown,
    param_bytes,
    transformer_params_per_device,
    zero_model_states,
)
from thinwire.planner.methods import worker_params
from thinwire.planner.presets import load_cluster, load_model
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
        got = layer_activation_units(model, t, sp, rec, "materialized") * unit
        assert got == pytest.approx(want)
    assert layer_activation_units(model, 1, False, "none", "materialized") == pytest.approx(
        34 + 5 * a * s / h
    )


def test_fused_attention_drops_the_score_term_only():
    model = TransformerSpec("x", layers=4, hidden=1024, heads=16, seq=512, vocab=1000)
    for t, sp in ((1, False), (4, False), (4, True)):
        fused = layer_activation_units(model, t, sp, "none", "fused")
        selective = layer_activation_units(model, t, sp, "selective", "materialized")
        assert fused == pytest.approx(selective)
        gap = layer_activation_units(model, t, sp, "none", "materialized") - fused
        assert gap == pytest.approx(5 * 16 * 512 / 1024 / t)  # 5as/(ht)
    assert layer_activation_units(model, 4, True, "full", "fused") == 0.5  # 2/t either way
    one = StrategySpec(micro_batch_size=2)
    gpt = load_model("gpt2-small")
    mat = memory_breakdown(gpt, A100, dataclasses.replace(one, attention="materialized"))
    fused = memory_breakdown(gpt, A100, one)
    s, a, L = 1024, 12, 12
    assert mat.activations - fused.activations == pytest.approx(5 * a * s * s * 2 * L)


def test_logits_are_bsv_in_the_compute_dtype_plus_an_fp32_copy():
    """... and the inputs of the final LayerNorm and the output layer, 2 b s h (/t with SP)."""
    gpt = load_model("gpt2-small")
    s = StrategySpec(micro_batch_size=4, tp=2, dtype="bf16")
    head = 2 * 4 * 1024 * 768 * 2
    assert logits_bytes(gpt, s, 2.0) == 4 * 1024 * 50257 / 2 * (2 + 4) + head
    sp = dataclasses.replace(s, sequence_parallel=True)
    assert logits_bytes(gpt, sp, 2.0) == 4 * 1024 * 50257 / 2 * (2 + 4) + head / 2
    mem = memory_breakdown(gpt, load_cluster("h100"), dataclasses.replace(s, dp=4))
    assert mem.logits == 4 * 1024 * 50257 / 2 * 6 + head
    assert mem.total == pytest.approx(mem.model_states + mem.activations + mem.logits)
    # in a pipeline the last stage holds one micro-batch of its layers and the logits, the
    # first min(m, p): with a small model and a large vocabulary the last one holds more
    piped = StrategySpec(pp=4, micro_batches=8, micro_batch_size=1, dp=2)
    last = memory_breakdown(gpt, load_cluster("h100"), piped)
    per_layer = layer_activation_units(gpt, 1, False, "none") * 1024 * 768
    assert last.activations == pytest.approx(per_layer * 12 / 4)
    assert last.logits == 1024 * 50257 * (2 + 4) + 2 * 1024 * 768 * 2
    wide = load_model("megatron-22b")
    first = memory_breakdown(wide, A100, dataclasses.replace(piped, tp=8, dp=1))
    assert first.logits == 0.0 and first.activations == pytest.approx(
        layer_activation_units(wide, 8, False, "none") * 2048 * 6144 * 48 / 4 * 4
    )


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
    assert worker_params(mlp, 4) / mlp.params == pytest.approx(0.087, abs=0.0005)
    assert worker_params(mlp, 8) / mlp.params == pytest.approx(0.030, abs=0.0005)
    # d*h/n + (L-1) h^2/n^2 + h*C/n + its biases + the shared output bias, for n = 4
    assert worker_params(mlp, 4) == 64 * 128 + 128 * 128 + 128 * 10 + (128 + 128 + 10)
    # batch norm: no biases, a BatchNorm weight and bias per hidden neuron, nothing shared
    batch = MLPSpec("digits", (64, 512, 512, 10), norm="batch")
    assert batch.params == 64 * 512 + 512 * 512 + 512 * 10 + 2 * 1024
    assert worker_params(batch, 4) == 64 * 128 + 128 * 128 + 128 * 10 + 2 * 256
    # widths not divisible by n: round 0's groups, the mean over workers
    odd = MLPSpec("odd", (64, 33, 30, 10))
    sizes = [(17, 15), (16, 15)]  # Partitioner round 0: (33, 30) over 2 workers
    want = [64 * a + a * b + b * 10 + a + b + 10 for a, b in sizes]
    assert worker_params(odd, 2) == sum(want) / 2


def test_ist_memory_scales_with_the_subnet():
    mlp = MLPSpec("m", (784, 2048, 2048, 10))
    cpu = load_cluster("cpu-1gbe", nodes=8)
    dp = memory_breakdown(mlp, cpu, StrategySpec(dp=8, micro_batch_size=32))
    # the published form (disjoint subnets): a worker holds 2048/8 units of each hidden layer
    published = "ist:overlap=1,optimizer_state=reset"
    ist = memory_breakdown(mlp, cpu, StrategySpec(dp=8, micro_batch_size=32, method=published))
    ratio = worker_params(mlp, 8, published) / mlp.params
    assert ist.model_states == pytest.approx(dp.model_states * ratio)
    # input, then pre- and post-activation of 2048/8-wide hidden layers and the 10 outputs
    assert ist.activations == (784 + 2 * (256 + 256 + 10)) * 32 * 4
    assert dp.activations == (784 + 2 * (2048 + 2048 + 10)) * 32 * 4
    # the default (overlap auto: each unit on 8 // 2 = 4 workers): 2048 * 4/8 units a layer
    auto = memory_breakdown(mlp, cpu, StrategySpec(dp=8, micro_batch_size=32, method="ist"))
    ratio = worker_params(mlp, 8, "ist") / mlp.params
    assert auto.model_states == pytest.approx(dp.model_states * ratio)
    assert auto.activations == (784 + 2 * (1024 + 1024 + 10)) * 32 * 4


def test_zero_and_offload_reduce_device_memory():
    model = TransformerSpec("x", layers=24, hidden=2048, heads=16, seq=1024, vocab=50000)
    cluster = load_cluster("a100-80gb", nodes=1)
    states = [
        memory_breakdown(model, cluster, StrategySpec(dp=8, zero=z)).model_states for z in range(4)
    ]
    assert states == sorted(states, reverse=True) and states[0] > 7 * states[3]
    off = memory_breakdown(model, cluster, StrategySpec(dp=8, offload=True))
    assert off.optimizer == 0 and off.weights == states[0] * 2 / 18  # bf16 weights of 18 B


def test_activations_scale_with_the_dtype_and_drop_the_masks_without_dropout():
    """Table 2's 34 s*b*h bytes are 16 tensors of 2 bytes and 2 one-byte masks: fp32 keeps
    16 x 4 + 2 = 66 per s*b*h with dropout, 64 without; materialized scores add a*s/h x
    (2 elem softmax + 1 mask + 2 elem dropout output) with dropout, 2 elem without."""
    import dataclasses

    from thinwire.planner.memory import _per_layer
    from thinwire.planner.specs import TransformerSpec
    from thinwire.planner.strategy import StrategySpec

    m = TransformerSpec(name="t", layers=2, hidden=64, heads=4, seq=32, vocab=50)
    sbh = 32 * 2 * 64
    fused = StrategySpec(dp=1, micro_batch_size=2, dtype="fp32")
    assert _per_layer(m, fused, 2.0) == 34 * sbh  # the paper's 16-bit figure, unchanged
    assert _per_layer(m, fused, 4.0) == 66 * sbh
    no_drop = dataclasses.replace(m, dropout=False)
    assert _per_layer(no_drop, fused, 4.0) == 64 * sbh
    mat = dataclasses.replace(fused, attention="materialized")
    r = 4 * 32 / 64  # a*s/h
    assert _per_layer(m, mat, 2.0) == pytest.approx((34 + 5 * r) * sbh)
    assert _per_layer(m, mat, 4.0) == pytest.approx((66 + r * (4 + 1 + 4)) * sbh)
    assert _per_layer(no_drop, mat, 4.0) == pytest.approx((64 + r * 4) * sbh)
