"""Memory options ([memory]: ZeRO-1/2/3, recomputation, offload) on 2 gloo ranks.

Each run trains a tiny MLP or GPT for a few steps and is held to:
1. plain data parallelism's losses (with the same codec, for ZeRO-1 with Top-k): ZeRO shards state and recomputation re-runs the same
   forward, neither changes the arithmetic of an update. The gradient mean of 2 ranks is
   (a + b) / 2 under DDP's all-reduce and FSDP2's reduce-scatter alike, a sum of two terms and
   an exact halving, so the losses agree to the last bit in practice; the tolerance (1e-6
   relative) only leaves room for a backend that orders a longer reduction differently;
2. the planner's prediction (:mod:`thinwire.planner.runs`): parameters, gradients, optimizer
   state and gathered parameters exactly, activations within 1% (the 5% the planner promises
   with room), the ledger's bytes exactly.
"""

from __future__ import annotations

import pytest
import torch
from harness import DATA, run_workers

from thinwire import config
from thinwire.errors import UsageError

STEPS = 4

MODELS = {
    "mlp": {"model.name": "mlp", "data.name": "digits", "model.hidden": "24,16",
            "model.norm": "batch"},
    "gpt": {"model.name": "gpt", "data.name": "tinyshakespeare", "model.n_layer": "2",
            "model.d_model": "16", "model.n_head": "2", "data.seq_len": "16",
            "data.limit_train": "4000", "data.limit_test": "200"},
}

OPTIONS = {
    "zero1": {"memory.zero": "1"},
    "zero2": {"memory.zero": "2"},
    "zero3": {"memory.zero": "3"},
    "block": {"memory.recompute": "block"},
    "selective": {"memory.recompute": "selective"},
    "zero3+block+offload": {"memory.zero": "3", "memory.recompute": "block",
                            "memory.offload": "params"},
    "zero1+topk": {"memory.zero": "1", "method.compressor": "topk:ratio=0.1"},
}
BASELINE = {"zero1+topk": "dp+topk"}
"""The plain run an option's losses must equal (default: dp without a codec)."""


def _overrides(model: str, extra: dict[str, str]) -> dict[str, str]:
    if model == "gpt":
        extra = {**extra, "data.dir": str(DATA / "tinyshakespeare")}
    return {"runtime.workers": "2", "train.steps": str(STEPS), "train.batch_size": "8",
            "train.optimizer": "adamw", "train.lr": "0.01", **MODELS[model], **extra}


def _train_all(comm, runs):  # type: ignore[no-untyped-def]
    """Every config of ``runs`` in turn on this process group, each with its own ledger."""
    from thinwire.builders import build_model, build_strategy, load_data, make_stream
    from thinwire.data.task import task_for
    from thinwire.planner.runs import predict_dp_run
    from thinwire.runtime.comm import Comm

    out = {}
    for name, over in runs.items():
        cfg = config.load(None, over)
        ds = load_data(cfg)
        model = build_model(cfg, ds)
        predicted = predict_dp_run(cfg, ds, build_model(cfg, ds))
        own = Comm()
        strategy = build_strategy(cfg, own, torch.device("cpu"), task_for(ds), model)
        stream = make_stream(cfg, ds, *strategy.data_shard())
        losses = [strategy.train_step(stream.batch(t), t) for t in range(cfg.train.steps)]
        mem = strategy.memory()
        totals = own.ledger.totals()
        strategy.eval_model()  # every rank takes part in a sharded model's assembly
        strategy.close()
        out[name] = (losses, mem, totals, predicted)
    return out


_RESULTS: dict[str, list[dict[str, object]]] = {}


def _results(model: str) -> list[dict[str, object]]:
    """Per rank: option -> (losses, measured memory, ledger totals, prediction); one spawn of
    two ranks per model runs plain dp and every option."""
    if model not in _RESULTS:
        runs = {"dp": _overrides(model, {}),
                "dp+topk": _overrides(model, {"method.compressor": "topk:ratio=0.1"})}
        runs.update({name: _overrides(model, extra) for name, extra in OPTIONS.items()
                     if not (model == "mlp" and name == "selective")})
        _RESULTS[model] = run_workers(_train_all, 2, runs, timeout=300)
    return _RESULTS[model]


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("model", list(MODELS))
def test_memory_option_trains_like_dp_and_matches_the_planner(model: str, option: str) -> None:
    if model == "mlp" and option == "selective":
        with pytest.raises(UsageError, match="declares no selective parts"):
            config.load(None, _overrides(model, OPTIONS[option]))
        return
    ranks = _results(model)
    results = [r[option] for r in ranks]
    losses = results[0][0]
    assert losses[-1] < losses[0]
    assert losses == pytest.approx(ranks[0][BASELINE.get(option, "dp")][0], rel=1e-6)
    mem_pred, traffic = results[0][3]
    measured = [r[1] for r in results]
    for key in ("params", "grads", "optimizer", "gathered"):
        assert max(getattr(m, key) for m in measured) == getattr(mem_pred, key), key
    acts = max(m.activations for m in measured)
    assert acts == pytest.approx(mem_pred.activations, rel=0.01)
    peak = max(m.peak for m in measured)
    assert peak == pytest.approx(mem_pred.peak, rel=0.05)
    for rank, (_, _, totals, _) in enumerate(results):
        assert totals["sent_bytes"] == traffic.sent[rank]
        assert totals["payload_bytes"] == traffic.payload[rank]


def test_sharding_and_recomputation_shrink_what_a_rank_holds() -> None:
    """The measured figures move the way the options say (the GPT runs above)."""
    ranks = _results("gpt")
    base, zero3, block = (ranks[0][k][1] for k in ("dp", "zero3", "block"))
    assert zero3.params <= base.params // 2 + 1024
    assert zero3.optimizer <= base.optimizer // 2 + 2048
    assert block.activations < base.activations / 3


@pytest.mark.parametrize(("extra", "message"), [
    ({"memory.offload": "params"}, "needs zero >= 2|add --memory.zero 2 or 3"),
    ({"memory.zero": "2", "method.compressor": "topk:ratio=0.1"}, "own reduce-scatter"),
    ({"method.name": "localsgd", "memory.zero": "1"}, "does not take it"),
    ({"method.name": "ist", "memory.recompute": "block"}, "does not take it"),
])
def test_forbidden_combinations_are_one_line_errors(extra: dict[str, str], message: str) -> None:
    over = {"model.name": "mlp", "data.name": "digits", "runtime.workers": "2", **extra}
    if "method.name" in extra:
        over["train.steps"] = "20"
    with pytest.raises(UsageError, match=message) as err:
        config.load(None, over)
    assert "\n" not in str(err.value)


def _meter_and_formula(model_name: str, over: dict[str, str], recompute: str) -> tuple[int, int]:
    """(bytes the ActivationMeter counts over one training forward pass and loss, the model
    entry's formula) for the config ``over``, as the strategy measures them."""
    from thinwire.builders import build_model, load_data, make_stream
    from thinwire.data.task import task_for
    from thinwire.models import MODELS as ENTRIES
    from thinwire.strategies.memory import ActivationMeter, apply_recompute

    cfg = config.load(None, {"train.batch_size": "8", **over})
    ds = load_data(cfg)
    model = build_model(cfg, ds)
    model.train()
    entry = ENTRIES.get(model_name)
    held = apply_recompute(model, entry.blocks) if recompute == "block" else []
    meter = ActivationMeter(held, model)
    x, y = make_stream(cfg, ds, 0, 1).batch(0)
    with meter.measure():
        loss = task_for(ds).loss(model(x), y)
    loss.backward()
    assert entry.activations is not None
    return meter.last, entry.activations(cfg.model.options, ds, 8, recompute)


@pytest.mark.parametrize("recompute", ["none", "block"])
@pytest.mark.parametrize("shape", [{"model.widths": "4,8", "model.blocks": "2,3"},
                                   {"model.widths": "4,6,8", "model.blocks": "1,1,2"}])
def test_resnet_activation_formula_equals_the_measured_bytes(shape: dict[str, str],
                                                             recompute: str) -> None:
    """The ResNet's activation formula is exact (to the byte) against the saved tensors of a
    real forward pass, with and without block recomputation: the planner's memory of ResIST
    and DP runs rests on it."""
    measured, formula = _meter_and_formula(
        "resnet", {"model.name": "resnet", "data.name": "digits", **shape}, recompute)
    assert measured == formula


@pytest.mark.parametrize("recompute", ["none", "block"])
@pytest.mark.parametrize("shape", [{"model.hidden": "16", "model.layers": "2"},
                                   {"model.hidden": "8", "model.layers": "3",
                                    "model.norm": "layer", "model.dropout": "0.5"}])
def test_gcn_activation_formula_equals_the_measured_bytes(shape: dict[str, str], recompute: str,
                                                          cora_dir) -> None:  # type: ignore[no-untyped-def]
    """The GCN's activation formula against a real forward pass on Cora, to the byte (CPU:
    dropout masks are fp32 there), with and without recomputing each graph convolution."""
    measured, formula = _meter_and_formula(
        "gcn", {"model.name": "gcn", "data.name": "cora", "data.dir": str(cora_dir), **shape},
        recompute)
    assert measured == formula


def test_gcn_memory_options_train_like_dp_and_match_the_planner(cora_dir) -> None:  # type: ignore[no-untyped-def]
    """ZeRO-3 and block recomputation on the GCN: each layer is a module call, so FSDP2
    gathers its parameters and the checkpoint wraps it (a layer computed from bare weights
    broke ZeRO-3 and made recomputation a silent no-op). Losses equal plain DP's, the planner's
    states and ledger bytes are exact, activations within 1%."""
    base = {"runtime.workers": "2", "train.steps": "3", "train.batch_size": "8",
            "train.optimizer": "adamw", "train.lr": "0.01", "model.name": "gcn",
            "data.name": "cora", "data.dir": str(cora_dir), "model.hidden": "16"}
    runs = {"dp": base, "zero3": {**base, "memory.zero": "3"},
            "block": {**base, "memory.recompute": "block"}}
    ranks = run_workers(_train_all, 2, runs, timeout=240)
    for name in ("zero3", "block"):
        losses, _, _, (mem_pred, traffic) = ranks[0][name]
        assert losses == pytest.approx(ranks[0]["dp"][0], rel=1e-6)
        measured = [r[name][1] for r in ranks]
        for key in ("params", "grads", "optimizer", "gathered"):
            assert max(getattr(m, key) for m in measured) == getattr(mem_pred, key), (name, key)
        assert max(m.activations for m in measured) == pytest.approx(mem_pred.activations,
                                                                     rel=0.01)
        for rank, r in enumerate(ranks):
            assert r[name][2]["sent_bytes"] == traffic.sent[rank]


def test_recomputed_blocks_fold_a_batch_into_batchnorm_statistics_once() -> None:
    """A checkpointed ResNet block re-runs its forward pass in backward; its BatchNorms'
    running statistics must still see each batch once: after two training steps the model's
    whole state (running mean, variance and batch count included) equals the run without
    recomputation, bit for bit (the same arithmetic in the same order)."""
    from thinwire.models.resnet import ResNet
    from thinwire.strategies.memory import apply_recompute

    def trained(recompute: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = ResNet((1, 8, 8), 10, widths=(4, 8), blocks=(2, 1))
        if recompute:
            apply_recompute(model, (r"stages\.\d+\.\d+",))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        for _ in range(2):
            x, y = torch.randn(6, 64, generator=g), torch.randint(0, 10, (6,), generator=g)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return {k: v.clone() for k, v in model.state_dict().items()}

    plain, recomputed = trained(False), trained(True)
    assert plain.keys() == recomputed.keys()
    for k in plain:
        assert torch.equal(plain[k], recomputed[k]), k
