"""The planner's methods come from the registry: specs resolve to the method's own options, the
MLP's IST plan is built without a model, and bytes are the methods' traffic functions'
(checked against the byte counts of ist.md's digits simulation: n = 4, MLP 64-512-512-10, 2000
steps per worker: DP 9.0e8 floats sent per worker, local SGD (every 10) 9.0e7, IST (10 local
steps) 1.0e7 down and up)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import thinwire
from thinwire.errors import UsageError
from thinwire.models import build_mlp
from thinwire.models.adapter import linear_stack
from thinwire.models.mlp import mlp_plan
from thinwire.planner.methods import default_methods, layout_of, per_step, resolve
from thinwire.planner.specs import MLPSpec
from thinwire.strategies import METHODS
from thinwire.strategies.data_parallel import bucket_traffic
from thinwire.strategies.ist.method import Options, ist_traffic

DIGITS = MLPSpec("digits", (64, 512, 512, 10))
STEPS = 2000


@pytest.mark.parametrize("norm", ["batch", "layer", "none"])
@pytest.mark.parametrize("hidden", [(4, 3), (7,), (5, 6, 7), (512, 512)])
def test_mlp_plan_equals_the_adapter_of_the_built_model(norm, hidden):
    built = linear_stack(build_mlp(64, hidden, 10, norm=norm)).plan
    assert mlp_plan(64, hidden, 10, norm=norm) == built


def test_specs_resolve_to_the_methods_own_options():
    assert resolve("localsgd").options.period == 10
    assert resolve("localsgd:period=20").label == "localsgd(H=20)"
    topk = resolve("topk:ratio=0.01")  # a codec's name: compressed data parallelism
    assert topk.entry.name == "dp" and topk.codec == "topk:ratio=0.01"
    assert topk.without_codec().codec == "none"
    assert resolve("dp:compressor=powersgd:rank=2").codec == "powersgd:rank=2"
    # every method whose traffic is a function of the model's parameter layout; methods whose
    # traffic follows activation shapes (tensor and hybrid parallelism) give their own formulas
    priced = [n for n, e in list(METHODS.entries())[1:] if e.traffic is not None and e.planned]
    assert default_methods() == priced and {"localsgd", "diloco", "ist"} <= set(priced)
    for bad, needle in (("ring", "unknown method"), ("ist:local_steps=-1", "local_steps"),
                        ("localsgd:k=3", "unknown option")):
        with pytest.raises(UsageError, match=needle):
            resolve(bad)


def _floats_sent(spec: str) -> float:
    return per_step(DIGITS, spec, 4, 1, 1, "sgd").sent_mean * STEPS / 4


def test_dp_and_localsgd_bytes_match_the_ist_notes():
    assert _floats_sent("dp") == pytest.approx(9.0e8, rel=0.01)
    assert _floats_sent("localsgd") == pytest.approx(9.0e7, rel=0.01)
    dp = per_step(DIGITS, "dp", 4, 1, 1, "sgd")
    # DDP's buckets from step 1 on, in gradient-ready order: 1 MiB first, then the rest
    later = bucket_traffic(layout_of(DIGITS), "none", 4, 2)
    first = bucket_traffic(layout_of(DIGITS), "none", 4, 1)
    assert dp.payload_mean == later.payload[0] - first.payload[0] == 301_066 * 4
    assert dp.calls == (("all_reduce", 2.0, later.sent[0] - first.sent[0]),)


def test_ist_bytes_are_its_traffic_function_over_the_plan():
    """The published form (disjoint subnets, no state travelling) by hand; the default
    (overlap auto, Adam's moments dealt with their units) equal to the same function."""
    plan = mlp_plan(64, (512, 512), 10, norm="none")
    published = Options(overlap=1, optimizer_state="reset")
    run = ist_traffic(plan, published, 4, STEPS, 0)
    sub = 64 * 128 + 128 * 128 + 128 * 10 + 128 + 128 + 10
    assert run.payload[1] / 4 == pytest.approx(1.0e7, rel=0.05)  # a worker: down and up
    assert run.payload[1] == 200 * (2 * 4 * (sub - 10) + 40)  # the output bias is averaged
    ist = per_step(DIGITS, "ist:overlap=1,optimizer_state=reset", 4, 1, 1, "sgd")
    assert ist.payload_mean == pytest.approx(sum(run.payload) / 4 / STEPS)
    assert ist.sent_max == pytest.approx(run.sent[0] / STEPS)  # rank 0 sends 3 pieces a round
    assert dict((op, c) for op, c, _ in ist.calls) == {"all_reduce": 0.1, "p2p": 0.2}
    for optimizer, states in (("sgd", 0), ("adam", 2)):
        auto = ist_traffic(plan, Options(), 4, 20, 0, states)
        steady = ist_traffic(plan, Options(), 4, 30, 0, states)
        per = per_step(DIGITS, "ist", 4, 1, 1, optimizer)
        assert per.sent_max == pytest.approx((steady.sent[0] - auto.sent[0]) / 10)
        assert per.sent_max > (1 + states) * ist.sent_max  # the subnets are twice as wide


def test_a_method_cutting_units_needs_a_plan():
    from thinwire.planner.presets import load_model

    with pytest.raises(UsageError, match="MLP specs"):
        per_step(load_model("gpt2-small"), "ist", 4, 1, 1, "adam")


def test_no_method_name_in_the_planner_or_measure():
    """A method's name as a value (``if method == "ist"``) would mean these layers know it."""
    src = Path(thinwire.__file__).parent
    files = [*(src / "planner").rglob("*.py"), *(src / "measure").rglob("*.py"),
             src / "commands" / "plan.py"]
    for path in files:
        tree = ast.parse(path.read_text())
        docs = {id(n.body[0].value) for n in ast.walk(tree)
                if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))
                and n.body and isinstance(n.body[0], ast.Expr)}
        names = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                 and id(n) not in docs and isinstance(n.value, str)}
        assert not names & set(METHODS.names()), path


def _adapted(name: str):  # noqa: ANN202
    """A tiny registry model of the IST test cases, counted with its adapter's plan."""
    import sys

    from thinwire.planner.presets import model_spec_from_module

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies" / "ist"))
    from ist_cases import CASES

    model = CASES[name].build()
    return model_spec_from_module(model, name, adapter=CASES[name].adapter(model))


@pytest.mark.parametrize("name", ["gpt", "resnet", "gcn"])
def test_ist_is_priced_from_the_adapters_traffic_function(name):
    """The planner's IST bytes per step for a GPT, a ResNet or a GCN are the steady-state
    difference of ``ist_traffic`` on the adapter's plan (what every rank's ledger equals,
    tests/strategies/ist/test_ist_invariants.py), not a formula of their own."""
    spec = _adapted(name)
    plan = spec.ist
    assert plan is not None and layout_of(spec).ist == plan
    o = Options(local_steps=2)
    got = per_step(spec, "ist:local_steps=2", 4, 1, 1, "sgd")
    one, two = (ist_traffic(plan, o, 4, s, 0) for s in (2, 4))
    assert got.sent_mean == pytest.approx(sum(b - a for a, b in zip(one.sent, two.sent)) / 8)
    assert got.sent_max == pytest.approx(max(b - a for a, b in zip(one.sent, two.sent)) / 2)
    assert got.sent_max > 0


def test_a_workers_gpt_subnet_is_counted_from_the_adapter():
    """GPT of the IST cases (vocabulary 11, context 8, 2 blocks of 4 heads of 4, d_model 16,
    FFN 24) at n = 4: a worker holds one head (its q, k, v rows and biases, its proj columns)
    and 6 FFN neurons per block, plus everything shared."""
    from thinwire.planner.methods import worker_params

    spec = _adapted("gpt")
    d, hd, f, vocab, ctx = 16, 4, 6, 11, 8
    block = 3 * (hd * d + hd) + d * hd + (f * d + f) + d * f   # cut, one worker's share
    block_shared = 4 * d + d + d                               # two LayerNorms, proj/fc2 biases
    shared = vocab * d + ctx * d + 2 * d + d * vocab           # embeddings, ln_f, head
    assert worker_params(spec, 4) == 2 * (block + block_shared) + shared
    assert worker_params(spec, 1) == spec.params


@pytest.mark.parametrize("name", ["gpt", "gcn"])
def test_ist_step_on_an_adapted_module_computes_a_workers_share(name):
    """A module counted with its adapter: IST's step is predicted (not refused), its compute
    the worker's share of the full model's, and an unadapted count is still refused."""
    import dataclasses

    from thinwire.errors import UsageError
    from thinwire.planner.methods import worker_params
    from thinwire.planner.presets import load_cluster
    from thinwire.planner.step import predict
    from thinwire.planner.strategy import StrategySpec

    spec = _adapted(name)
    cluster = load_cluster("cpu-1gbe").with_devices(4)
    dp = predict(spec, cluster, StrategySpec(dp=4, micro_batch_size=8, dtype="fp32"))
    ist = predict(spec, cluster, StrategySpec(dp=4, micro_batch_size=8, dtype="fp32",
                                              method="ist"))
    share = worker_params(spec, 4, "ist") / spec.params
    assert 0 < share < 1 and worker_params(spec, 4, "ist:overlap=1") / spec.params < share
    assert ist.breakdown.compute == pytest.approx(share * dp.breakdown.compute, rel=1e-6)
    with pytest.raises(UsageError, match="cuts the model into units"):
        predict(dataclasses.replace(spec, ist=None), cluster,
                StrategySpec(dp=4, micro_batch_size=8, dtype="fp32", method="ist"))


def test_ist_overlap_multiplies_a_subnets_cut_units_in_the_planner():
    """MLP 64-512-512-10 over 4 workers: a disjoint subnet holds 128 units of each hidden
    layer, 64*128 + 128*128 + 128*10 weights and 128 + 128 biases plus the shared output bias;
    with overlap 2 (each unit held by two workers) it holds 256 of each: the planner's
    parameters and widths of a worker follow the spec's overlap, and overlap 0 (the default)
    resolves to max(1, 4 // 2) = 2."""
    from thinwire.planner.methods import worker_params, worker_widths

    def subnet(h: int) -> int:
        return 64 * h + h * h + h * 10 + h + h + 10

    assert worker_params(DIGITS, 4, "ist:overlap=1") == subnet(128)
    assert worker_params(DIGITS, 4, "ist") == subnet(256)
    assert worker_params(DIGITS, 4, "ist:overlap=2") == subnet(256)
    assert worker_params(DIGITS, 4, "ist:overlap=0") == subnet(256)
    assert worker_params(DIGITS, 4, "ist:overlap=4") == DIGITS.params
    assert worker_widths(DIGITS, 4, "ist:overlap=2") == (64.0, 256.0, 256.0, 10.0)
