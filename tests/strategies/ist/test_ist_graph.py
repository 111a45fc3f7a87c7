"""Graph-derived IST adapters (thinwire.models.graph_adapter) beyond the invariants every adapter
passes in test_ist_invariants.py (the GRAPH_CASES there: lr-0 rounds bit for bit, untrained
blocks untouched, ledger = formula, n = 1 = plain training, at 2 and 4 gloo ranks):

- the derived plan equals the hand adapters' plans for thinwire's MLP, GPT and ResNet, up to the
  names of the groups;
- a subnet's forward equals the full model's forward restricted to the units held (every
  element of an unheld unit zeroed) with the inverted-dropout factors on the layers it feeds;
- a user's model trains under ``IST(model, opt)`` with no adapter (traced at the first training
  forward) and with ``example_input``; the full model's loss falls;
- one-line errors: a forward the tracer cannot follow names the module and the fixes, and
  ``shared=`` is the escape hatch; a model with nothing to cut is refused; a shared tensor ends
  at the mean of the workers' updates (with the derived plan).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from harness import run_workers
from ist_cases import (
    CASES,
    GRAPH_CASES,
    Conv1dNet,
    EncoderClassifier,
    ResidualCNN,
    ResNet18,
    ResNeXtNet,
    state,
    subnet_of,
    zeroed_unheld,
)
from torch import nn

from thinwire.errors import UsageError
from thinwire.models.adapter import ISTPlan, linear_stack
from thinwire.models.gpt import GPTAdapter
from thinwire.models.graph_adapter import derive_adapter
from thinwire.models.resnet import ResISTAdapter
from thinwire.runtime.comm import Comm
from thinwire.runtime.ledger import Ledger
from thinwire.strategies.ist.core import IST


def _canonical(plan: ISTPlan) -> tuple:
    """The plan with groups renamed by their first appearance among the tensors (a derived
    adapter names a group after the layer that makes it, a hand adapter after its role)."""
    rename: dict[str, str] = {}
    for t in plan.tensors:
        for c in t.cuts:
            rename.setdefault(c.group, f"g{len(rename)}")
        if t.unit is not None:
            rename.setdefault(t.unit[0], f"g{len(rename)}")
    groups = sorted((rename[g.name], g.size, g.kind) for g in plan.groups)
    tensors = sorted((t.name, t.shape, t.buffer, t.dtype,
                      tuple((rename[c.group], c.dim, c.per_unit, c.segments) for c in t.cuts),
                      None if t.unit is None else (rename[t.unit[0]], t.unit[1]))
                     for t in plan.tensors)
    scaled = sorted((m, rename[g]) for m, g in plan.scaled_inputs)
    return groups, tensors, scaled, plan.batch_normalised


@pytest.mark.parametrize("norm", ["none", "batch", "layer"])
def test_derived_plan_equals_the_mlp_adapter(norm: str) -> None:
    from thinwire.models import build_mlp

    model = build_mlp(12, (16, 12), 5, norm=norm, seed=0)
    derived = derive_adapter(model, torch.randn(4, 12))
    assert _canonical(derived.plan) == _canonical(linear_stack(model).plan)


def test_derived_plan_equals_the_gpt_adapter() -> None:
    """Heads: the q, k, v projections' widths are split into (heads, head_dim) by a view and
    meet in scaled_dot_product_attention, so a head (head_dim rows) is the unit, as in
    GPTAdapter; d_model stays whole (embeddings shared)."""
    model = CASES["gpt"].build()
    derived = derive_adapter(model, CASES["gpt"].batch(0, 0)[0])
    assert _canonical(derived.plan) == _canonical(GPTAdapter(model).plan)


@pytest.mark.parametrize("make,shape", [(ResidualCNN, (4, 1, 8, 8)), (ResNeXtNet, (4, 1, 8, 8)),
                                        (Conv1dNet, (4, 3, 6))])
def test_an_exported_conv_graph_is_cut_as_the_fx_graph(monkeypatch: pytest.MonkeyPatch,
                                                       make: type, shape: tuple) -> None:
    """torch.export's aten graph (the tracer of last resort) cuts convolutions, batch and
    group norms, pooling and flatten by the same rules as fx's module graph: the same plan
    (grouped convolutions' whole paths and BatchNorm's statistics scaling included)."""
    from thinwire.models.graph import tracing

    torch.manual_seed(0)
    model, x = make(), torch.randn(*shape)
    want = _canonical(derive_adapter(model, x).plan)

    def no_fx(*args: object) -> None:
        raise tracing._FxFailed("", None, "forced")

    monkeypatch.setattr(tracing, "_trace_fx", no_fx)
    assert tracing.trace(model, (x,), {}, ()).exported
    got = derive_adapter(model, x).plan
    assert any(t.cuts for t in got.tensors if ".weight" in t.name and "conv" in t.name)
    assert _canonical(got) == want


def test_derived_blocks_equal_resist() -> None:
    """residual="blocks": the shape-keeping residual blocks of each stage are its dealt units,
    everything else shared, as ResISTAdapter. The difference: ResIST's evaluation-time branch
    scaling needs a hook inside the block (thinwire's ResNet has one), so the derived adapter
    offers scale "none" only."""
    model = CASES["resnet"].build()
    derived = derive_adapter(model, CASES["resnet"].batch(0, 0)[0], residual="blocks")
    assert _canonical(derived.plan) == _canonical(ResISTAdapter(model).plan)
    assert derived.scales == ("none",)


def test_derived_residual_stream_stays_whole_by_default() -> None:
    """residual="whole" (the default): the skip's channel group (the stem's) is a residual
    stream, so it is shared: conv2 keeps all its output channels and only its input channels
    (conv1's, inside the branch) are cut; bn2 and the stem are whole; the channels after the
    skip (``wide``, not added to anything) are still cut."""
    model = ResidualCNN()
    plan = derive_adapter(model, torch.randn(2, 1, 8, 8)).plan
    cuts = {t.name: [(c.group, c.dim, c.per_unit) for c in t.cuts] for t in plan.tensors}
    assert cuts["conv2.weight"] == [("conv1", 1, 1)]
    assert cuts["bn2.running_mean"] == [] and cuts["stem.0.weight"] == []
    assert cuts["wide.weight"] == [("wide", 0, 4)]
    assert {g.name: g.size for g in plan.groups} == {"conv1": 8, "wide": 4}


def test_derived_channels_of_a_residual_cnn() -> None:
    """residual="channels": both sides of the skip share the stem's channel group (conv2's rows,
    bn2, conv1's and wide's input channels), cut; GroupNorm(4, 16) makes a unit of 4 channels;
    the head's rows (the model's output) are shared."""
    model = ResidualCNN()
    plan = derive_adapter(model, torch.randn(2, 1, 8, 8), residual="channels").plan
    cuts = {t.name: [(c.group, c.dim, c.per_unit) for c in t.cuts] for t in plan.tensors}
    assert cuts["conv2.weight"] == [("stem.0", 0, 1), ("conv1", 1, 1)]
    assert cuts["bn2.running_mean"] == [("stem.0", 0, 1)]
    assert cuts["wide.weight"] == [("wide", 0, 4), ("stem.0", 1, 1)]
    assert cuts["gn.weight"] == [("wide", 0, 4)]
    assert cuts["head.weight"] == [("wide", 1, 4)]
    assert cuts["head.bias"] == []
    assert {g.name: g.size for g in plan.groups} == {"stem.0": 8, "conv1": 8, "wide": 4}


def test_grouped_convolutions_are_cut_by_whole_groups() -> None:
    """ResNeXt's cardinality: a unit is one path of a grouped convolution, its input channels
    (the 1x1 before it: 4 rows of block1.conv1, 2 of block2.conv1) and its filters (8 rows of
    block1.conv2, which widens each path 2x; 2 of block2.conv2), the BatchNorms between and the
    1x1 after (columns); a filter's own input channels (dim 1) are never cut, the stream stays
    whole; a subnet's convolution runs ``groups`` = the paths it holds."""
    model = ResNeXtNet()
    adapter = derive_adapter(model, torch.randn(2, 1, 8, 8), min_units=2)
    plan = adapter.plan
    cuts = {t.name: [(c.group, c.dim, c.per_unit) for c in t.cuts] for t in plan.tensors}
    assert [(g.name, g.size) for g in plan.groups] == [("block1.conv1", 4), ("block2.conv1", 8)]
    assert sum(1 for c in cuts.values() if c) == 19  # 11 in block1, 8 in block2
    g1, g2 = "block1.conv1", "block2.conv1"
    assert cuts["block1.conv1.weight"] == [(g1, 0, 4)]
    assert cuts["block1.conv2.weight"] == [(g1, 0, 8)] and "block1.conv2.bias" not in cuts
    assert cuts["block1.bn2.running_var"] == [(g1, 0, 8)]
    assert cuts["block1.conv3.weight"] == [(g1, 1, 8)]
    assert cuts["block2.conv2.weight"] == cuts["block2.conv2.bias"] == [(g2, 0, 2)]
    assert cuts["block2.conv3.weight"] == [(g2, 1, 2)]
    assert cuts["stem.0.weight"] == cuts["block1.bn3.weight"] == cuts["head.weight"] == []
    assert plan.scaled_inputs == (("block1.conv3", g1), ("block2.conv3", g2))
    sub = subnet_of(model, adapter, {g1: np.array([0, 2, 3]), g2: np.array([1, 6])})
    assert (sub.block1.conv2.groups, sub.block1.conv2.in_channels,
            sub.block1.conv2.out_channels, sub.block1.bn2.num_features) == (3, 12, 24, 24)
    assert (sub.block2.conv2.groups, sub.block2.conv2.in_channels) == (2, 4)
    assert sub(torch.randn(2, 1, 8, 8)).shape == (2, 3)


def test_a_grouped_convolution_on_a_whole_input_stays_whole() -> None:
    """A grouped convolution whose input channels are not cut (here the model's input) cannot
    hold a subset of its paths: it is shared, and the layers it feeds are cut as usual."""
    model = nn.Sequential(nn.Conv2d(4, 8, 3, groups=4), nn.ReLU(), nn.Conv2d(8, 6, 1),
                          nn.ReLU(), nn.Flatten(), nn.Linear(6 * 16, 2))
    plan = derive_adapter(model, torch.randn(2, 4, 6, 6)).plan
    cuts = {t.name: [(c.group, c.dim, c.per_unit) for c in t.cuts] for t in plan.tensors}
    assert cuts["0.weight"] == [] and cuts["2.weight"] == [("2", 0, 1)]
    assert cuts["5.weight"] == [("2", 1, 16)]


# --- a subnet's forward is the full model's restricted to the units held ------------------------
def _restricted(model: nn.Module, plan: ISTPlan, held: dict[str, np.ndarray],
                factors: dict[str, float]) -> nn.Module:
    """The full model with every element of an unheld unit zeroed, and the columns of each
    layer fed by a cut group multiplied by its factor (inverted dropout on its input)."""
    out, tensors = zeroed_unheld(model, plan, held)
    with torch.no_grad():
        for mod, group in plan.scaled_inputs:
            for t in plan.tensors:
                owner = t.name.rsplit(".", 1)[0]
                hit = (owner == mod or (t.name == f"{mod}.in_proj_weight"))
                for c in t.cuts:
                    if hit and c.group == group and c.dim >= 1:
                        tensors[t.name].mul_(factors[group])
    return out


@pytest.mark.parametrize("name", ["g_mlp", "g_gpt", "g_cnn", "g_resnext", "g_encoder",
                                  "g_transformer"])
def test_subnet_forward_equals_the_restricted_full_model(name: str) -> None:
    """Tolerance: the subnet sums fewer terms in another order (float32 reassociation, ~1e-6
    here); a wrong cut, a missing factor or a head of the wrong width is off by O(1)."""
    case = GRAPH_CASES[name]
    model = case.build()
    adapter = case.adapter(model)
    rng = np.random.default_rng(0)
    held = {g.name: np.sort(rng.choice(g.size, max(1, g.size // 2), replace=False))
            for g in adapter.plan.groups}
    factors = {g.name: g.size / len(held[g.name]) for g in adapter.plan.groups}
    x, _ = case.batch(0, 0)
    sub = subnet_of(model, adapter, held)
    handles = adapter.install_scaling(
        sub, [(m, factors[g]) for m, g in adapter.plan.scaled_inputs])
    full = _restricted(model, adapter.plan, held, factors)
    sub.train()
    full.train()
    got, want = sub(x), full(x)
    for h in handles:
        h.remove()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
    assert not torch.allclose(want, model(x), rtol=1e-3, atol=1e-3)


# --- a user's loop with no adapter ---------------------------------------------------------------
def _user_loop(comm: Comm, kind: str) -> dict:
    torch.manual_seed(0)
    if kind == "cnn":
        model = ResidualCNN()
        batch = (torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(1)),
                 torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(2)))
        kwargs: dict = {}
    elif kind == "resnet18":
        model = ResNet18(4)
        batch = (torch.randn(8, 1, 32, 32, generator=torch.Generator().manual_seed(1)),
                 torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(2)))
        kwargs = {"example_input": batch[0]}
    else:
        model = EncoderClassifier()
        batch = (torch.randint(0, 9, (16, 6), generator=torch.Generator().manual_seed(1)),
                 torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(2)))
        kwargs = {"example_input": batch[0]}
    before = F.cross_entropy(model(batch[0]), batch[1]).item()  # eval before: model whole
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    ist = IST(model, opt, comm=Comm(ledger=Ledger(comm.rank)), local_steps=2, **kwargs)
    for _ in range(8):
        opt.zero_grad()
        F.cross_entropy(model(batch[0]), batch[1]).backward()
        opt.step()
    full = ist.full_model()
    after = None
    if full is not None:
        full.train()
        with torch.no_grad():
            after = F.cross_entropy(full(batch[0]), batch[1]).item()
    return {"before": before, "after": after, "groups": [g.name for g in ist.plan.groups]}


@pytest.mark.parametrize("kind,n", [("cnn", 2), ("encoder", 4), ("resnet18", 2)])
def test_user_models_train_with_no_adapter(kind: str, n: int) -> None:
    """Four rounds on one batch: the assembled model's loss falls (training-mode statistics:
    the BatchNorm running statistics of a few steps are not the point here)."""
    out = run_workers(_user_loop, n, kind)
    assert out[0]["after"] < out[0]["before"] - 0.05, out[0]
    assert out[0]["groups"] and all(o["groups"] == out[0]["groups"] for o in out)


def _shared_mean(comm: Comm) -> dict:
    model = copy.deepcopy(GRAPH_CASES["g_encoder"].build())
    x, y = GRAPH_CASES["g_encoder"].batch(0, 0)
    init = state(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 if comm.rank == 0 else 0.0)
    local: dict[str, torch.Tensor] = {}
    opt.register_step_post_hook(lambda *_: local.update(
        {k: v.detach().clone() for k, v in model.named_parameters()}))
    ist = IST(model, opt, comm=Comm(ledger=Ledger(comm.rank)), local_steps=1, example_input=x)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    full = ist.full_model()
    shared = [t.name for t in ist.plan.tensors if t.shared and not t.buffer]
    return {"init": init, "local": local, "full": None if full is None else state(full),
            "shared": shared}


def test_shared_tensors_of_a_derived_plan_move_by_the_mean_update() -> None:
    """The embedding, the LayerNorms and the head of the encoder are shared: with rank 1 frozen
    they end at init + half of rank 0's update (float32 rounding of the halving)."""
    out = run_workers(_shared_mean, 2)
    o = out[0]
    assert "emb.weight" in o["shared"] and "head.weight" in o["shared"]
    for name in o["shared"]:
        init, trained = o["init"][name], o["local"][name]
        want = init + (trained - init) / 2
        assert torch.allclose(o["full"][name], want, rtol=1e-6, atol=1e-7), name
    assert any(not torch.equal(o["local"][n], o["init"][n]) for n in o["shared"])


# --- errors ---------------------------------------------------------------------------------------
class _Gate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent: no tracer follows it
            return self.fc(x)
        return -self.fc(x)


class _Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.gate = _Gate()
        self.hidden = nn.Linear(8, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.hidden(self.gate(self.inp(x)))))


def test_untraceable_module_is_one_line_naming_it_and_shared_is_the_escape_hatch() -> None:
    model = _Gated()
    with pytest.raises(UsageError) as e:
        derive_adapter(model, torch.randn(3, 4))
    msg = str(e.value)
    assert "\n" not in msg and "gate (_Gate)" in msg and "shared=('gate',)" in msg
    plan = derive_adapter(model, torch.randn(3, 4), shared=("gate",)).plan
    cuts = {t.name: [c.group for c in t.cuts] for t in plan.tensors}
    assert cuts["gate.fc.weight"] == [] and cuts["inp.weight"] == []  # touches the shared gate
    assert cuts["hidden.weight"] == ["hidden"] and cuts["out.weight"] == ["hidden"]


def test_shared_reaches_inside_a_transformer_layer() -> None:
    """An nn.TransformerEncoder is one traced node cut by its rule: ``shared`` naming a layer's
    self_attn keeps that layer's heads whole (its FFN neurons still cut), naming linear1 keeps
    its FFN whole (its heads still cut), naming the layer keeps both, for that layer alone."""
    x = torch.randint(0, 9, (3, 6))

    def cuts(shared: tuple[str, ...]) -> dict[str, list[str]]:
        plan = derive_adapter(EncoderClassifier(), x, shared=shared).plan
        return {t.name: [c.group for c in t.cuts] for t in plan.tensors}

    every = cuts(())
    for i in (0, 1):
        assert every[f"encoder.layers.{i}.self_attn.in_proj_weight"] != []
        assert every[f"encoder.layers.{i}.linear1.weight"] != []
    heads_whole = cuts(("encoder.layers.0.self_attn",))
    assert heads_whole["encoder.layers.0.self_attn.in_proj_weight"] == []
    assert heads_whole["encoder.layers.0.self_attn.out_proj.weight"] == []
    assert heads_whole["encoder.layers.0.linear1.weight"] != []
    assert heads_whole["encoder.layers.1.self_attn.in_proj_weight"] != []
    ffn_whole = cuts(("encoder.layers.0.linear1",))
    assert ffn_whole["encoder.layers.0.linear1.weight"] == []
    assert ffn_whole["encoder.layers.0.linear2.weight"] == []
    assert ffn_whole["encoder.layers.0.self_attn.in_proj_weight"] != []
    layer_whole = cuts(("encoder.layers.0",))
    assert all(v == [] for k, v in layer_whole.items() if k.startswith("encoder.layers.0."))
    assert layer_whole["encoder.layers.1.linear1.weight"] != []


def test_shared_keeps_a_module_whole_where_the_meta_tracer_traces() -> None:
    """thinwire's GPT traces through fx's meta tracer (its forward reads a shape); naming a
    block's attention in ``shared`` keeps that module one node (the modules its forward calls,
    run to learn its output, are not recorded): its q, k, v and proj are not cut, the other
    block's heads and both FFNs still are."""
    from thinwire.models.gpt import GPT
    x = torch.randint(0, 65, (2, 16))
    plan = derive_adapter(GPT(65, 16, n_layer=2, n_head=4, d_model=32), x,
                          shared=("blocks.0.attn",)).plan
    cuts = {t.name: [c.group for c in t.cuts] for t in plan.tensors}
    for p in ("q", "k", "v", "proj"):
        assert cuts[f"blocks.0.attn.{p}.weight"] == [], p
        assert cuts[f"blocks.1.attn.{p}.weight"] != [], p
    assert cuts["blocks.0.mlp.fc1.weight"] != [] and cuts["blocks.1.mlp.fc1.weight"] != []


def test_a_model_with_nothing_to_cut_is_refused_and_bad_options_are_one_line() -> None:
    with pytest.raises(UsageError, match="no unit to cut"):
        derive_adapter(nn.Sequential(nn.Linear(4, 3)), torch.randn(2, 4))
    with pytest.raises(UsageError, match="residual"):
        derive_adapter(ResidualCNN(), torch.randn(2, 1, 8, 8), residual="depth")
    with pytest.raises(UsageError, match="not submodules"):
        derive_adapter(ResidualCNN(), torch.randn(2, 1, 8, 8), shared=("nope",))


class _FixedHeads(nn.Module):
    """Attention whose forward hard-codes its head count in a view."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.proj = nn.Linear(8, 6)
        self.out = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, 2, 4).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, 8)
        return self.out(F.relu(self.proj(y)))


def test_a_forward_that_fixes_a_cut_width_is_caught_at_derivation() -> None:
    with pytest.raises(UsageError, match="fixes a width") as e:
        derive_adapter(_FixedHeads(), torch.randn(2, 5, 8))
    assert "\n" not in str(e.value)
    plan = derive_adapter(_FixedHeads(), torch.randn(2, 5, 8), shared=("q",)).plan
    assert all(not t.cuts for t in plan.tensors if t.name.startswith(("q.", "k.", "v.")))
    assert [g.name for g in plan.groups] == ["proj"]


def test_the_module_that_fixes_a_width_is_named() -> None:
    """The subnet check names the innermost module whose forward failed, and the fixes."""
    with pytest.raises(UsageError) as e:
        derive_adapter(nn.Sequential(_FixedHeads()), torch.randn(2, 5, 8))
    msg = str(e.value)
    assert "\n" not in msg and "the forward of 0 (_FixedHeads) fails" in msg
    assert "shared=('0',)" in msg and "register a rule" in msg


def test_an_example_that_does_not_run_names_the_module_and_the_op() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(6, 2))
    with pytest.raises(UsageError) as e:
        derive_adapter(model, torch.randn(3, 4))
    msg = str(e.value)
    assert "\n" not in msg and "2 (Linear) failed (mat1 and mat2" in msg
    assert "pass the model's own input batch" in msg


class _Masked(nn.Module):
    """A forward with a keyword argument: ``model(x, scale=s)``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        return self.fc2(h if scale is None else h * scale)


def test_keyword_example_inputs_reach_the_tracer() -> None:
    """A dict of keyword arguments, or ``example_kwargs`` beside the positional ones, is traced
    as the loop calls the model: a per-sample scale leaves the hidden neurons cut; a
    per-channel one, a user's tensor over the cut channels, keeps them whole (so the keyword
    was traced, not left at its default). A keyword the forward does not take, or one given
    twice, is one line naming it and the fix."""
    model, x, s = _Masked(), torch.randn(3, 4), torch.rand(3, 1)
    plan = derive_adapter(model, x).plan
    assert [(g.name, g.size) for g in plan.groups] == [("fc1", 8)]
    assert derive_adapter(model, {"x": x, "scale": s}).plan == plan
    assert derive_adapter(model, x, example_kwargs={"scale": s}).plan == plan
    with pytest.raises(UsageError, match="no unit to cut"):
        derive_adapter(model, x, example_kwargs={"scale": torch.rand(1, 8)})
    with pytest.raises(UsageError) as e:
        derive_adapter(model, {"x": x, "scales": s})
    assert "\n" not in str(e.value) and "keywords ['scales'] are not arguments of " \
        "_Masked.forward(x, scale)" in str(e.value)
    with pytest.raises(UsageError, match="given twice"):
        derive_adapter(model, {"x": x, "scale": s}, example_kwargs={"scale": s})


class _HeadMasked(nn.Module):
    """nn.MultiheadAttention called with a per-head (3-D) mask."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        mask = torch.zeros(x.shape[0] * 2, x.shape[1], x.shape[1])
        return self.head(self.attn(h, h, h, attn_mask=mask)[0].mean(1))


def test_a_per_head_mask_on_cut_heads_is_refused_naming_the_attention() -> None:
    with pytest.raises(UsageError) as e:
        derive_adapter(_HeadMasked(), torch.randn(3, 5, 4))
    msg = str(e.value)
    assert "\n" not in msg and "heads of attn (MultiheadAttention)" in msg
    assert "shared=('attn',)" in msg
    plan = derive_adapter(_HeadMasked(), torch.randn(3, 5, 4), shared=("attn",)).plan
    assert [g.name for g in plan.groups] == ["head.0"]
