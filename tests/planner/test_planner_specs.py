"""Specs, presets and TOML loading: validation errors name the field and the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from thinwire.errors import UsageError
from thinwire.planner.presets import list_presets, load_cluster, load_model, model_spec_from_module
from thinwire.planner.specs import ClusterSpec, CountedSpec, MLPSpec, TransformerSpec
from thinwire.planner.strategy import StrategySpec, check_strategy


def test_every_preset_loads():
    clusters = list_presets("cluster")
    assert {"a100-80gb", "h100", "h200", "cpu-1gbe", "cpu-10gbe", "cpu-100gbe"} <= set(clusters)
    for name in clusters:
        c = load_cluster(name)
        assert c.devices == c.nodes * c.devices_per_node and c.peak(c.default_dtype) >= 1e12
    models = list_presets("model")
    assert {
        "gpt3-175b",
        "megatron-22b",
        "megatron-1t",
        "gpt2-small",
        "mlp-784-2048-2048-10",
    } <= set(models)
    published = {  # parameters in billions, as the models are named (GPT-2 sizes: OpenAI)
        "gpt2-small": 0.124, "gpt2-medium": 0.355, "gpt2-large": 0.774, "gpt2-xl": 1.558,
        "gpt3-175b": 175, "megatron-175b": 175, "megatron-22b": 22, "megatron-530b": 530,
        "megatron-1t": 1008, "mlp-784-2048-2048-10": 0.0058,
        "xmlp-amazon-670k": 0.1038,  # SLIDE's 135909-128-670091 with biases
    }
    for name in models:
        assert load_model(name).params / 1e9 == pytest.approx(published[name], rel=0.01)


def test_presets_carry_the_right_numbers():
    gpt3 = load_model("gpt3-175b")
    assert isinstance(gpt3, TransformerSpec) and gpt3.params / 1e9 == pytest.approx(174.6, abs=0.1)
    a100 = load_cluster("a100-80gb", nodes=8)
    assert a100.devices == 64 and a100.peak("bf16") == 312e12
    assert load_cluster("cpu-1gbit").name == "cpu-1gbe"  # alias
    assert load_cluster("cpu-1gbe").inter_bandwidth == 125e6
    mlp = load_model("mlp-784-2048-2048-10")
    assert isinstance(mlp, MLPSpec) and mlp.widths == (784, 2048, 2048, 10)
    assert load_model("mlp-64-512-512-10").params == 301_066  # built from the name
    from thinwire.models import build_mlp

    for norm in ("batch", "layer", "none"):  # thinwire's MLP, counted without building it
        built = sum(p.numel() for p in build_mlp(64, (512, 512), 10, norm=norm).parameters())
        assert MLPSpec("m", (64, 512, 512, 10), norm=norm).params == built


def test_toml_files(tmp_path):
    good = tmp_path / "tiny.toml"
    good.write_text(
        'kind = "transformer"\nname = "tiny"\nlayers = 2\nhidden = 64\nheads = 4\n'
        "seq = 32\nvocab = 100\n"
    )
    assert load_model(str(good)).layers == 2
    typo = tmp_path / "typo.toml"
    typo.write_text('name = "t"\nlayers = 2\nhiden = 64\nheads = 4\nseq = 32\nvocab = 100\n')
    with pytest.raises(UsageError, match="hiden"):
        load_model(str(typo))
    broken = tmp_path / "broken.toml"
    broken.write_text("layers = [\n")
    with pytest.raises(UsageError, match="cannot read"):
        load_model(str(broken))
    with pytest.raises(UsageError, match="does not exist"):
        load_cluster(str(tmp_path / "missing.toml"))
    with pytest.raises(UsageError, match="unknown --cluster"):
        load_cluster("a100-40gb")


def test_validation_messages_name_the_field():
    with pytest.raises(UsageError, match="heads"):
        TransformerSpec("x", layers=2, hidden=100, heads=3, seq=8, vocab=10)
    with pytest.raises(UsageError, match="widths"):
        MLPSpec("x", (10, 2))
    with pytest.raises(UsageError, match="recompute"):
        StrategySpec(recompute="some")
    with pytest.raises(UsageError, match="interleave"):
        StrategySpec(interleave=2)
    with pytest.raises(UsageError, match="micro_batches"):
        StrategySpec(pp=4, interleave=2, micro_batches=6)
    with pytest.raises(UsageError, match="zero"):
        StrategySpec(zero=4)
    with pytest.raises(UsageError, match="matmul_efficiency"):
        ClusterSpec(
            "c",
            1,
            1e9,
            {"fp32": 1e12},
            1e9,
            1e9,
            1e9,
            default_dtype="fp32",
            matmul_efficiency=((1.0, 1.5),),
        )


def test_check_strategy_rejects_impossible_degrees():
    model, cluster = load_model("gpt3-175b"), load_cluster("a100-80gb", nodes=8)
    check_strategy(model, cluster, StrategySpec(dp=1, tp=8, pp=8))
    bad = [
        (StrategySpec(dp=2, tp=8, pp=8), "devices"),
        (StrategySpec(dp=4, tp=16, pp=1), "inside a node"),
        (StrategySpec(dp=1, tp=8, pp=8, interleave=5, micro_batches=8), "divide model.layers"),
        (StrategySpec(dp=64, method="ist"), "MLP specs"),  # no IST plan of a transformer
    ]
    for s, msg in bad:
        with pytest.raises(UsageError, match=msg):
            check_strategy(model, cluster, s)
    mlp, cpu = load_model("mlp-784-2048-2048-10"), load_cluster("cpu-1gbe", nodes=8)
    check_strategy(mlp, cpu, StrategySpec(dp=8, method="ist"))
    with pytest.raises(UsageError, match="not a transformer"):
        check_strategy(mlp, load_cluster("a100-80gb"), StrategySpec(dp=4, tp=2))
    with pytest.raises(UsageError, match="tp 1"):
        check_strategy(mlp, load_cluster("a100-80gb"), StrategySpec(dp=4, tp=2, method="ist"))
    tiny = load_model("mlp-64-4-10")
    with pytest.raises(UsageError, match="widths >= 8"):
        check_strategy(tiny, cpu, StrategySpec(dp=8, method="ist"))


def test_spec_from_torch_module():
    from torch import nn

    mlp = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    spec = model_spec_from_module(mlp, "net")
    assert isinstance(spec, MLPSpec) and spec.widths == (784, 256, 10)
    assert spec.params == sum(p.numel() for p in mlp.parameters())
    other = nn.Sequential(nn.Linear(8, 4), nn.Linear(8, 2))  # not a chain
    counted = model_spec_from_module(other, "other")
    assert isinstance(counted, CountedSpec) and counted.flops_per_sample == 6 * (32 + 16)


def test_planner_import_does_not_import_torch():
    code = "import sys, thinwire.planner, thinwire.commands.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
