"""GCN: registry build, the propagation rule, buffers, cut features, Cora accuracy, two DDP
ranks equal to one process."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from thinwire.data import DATASETS, Dataset, DataSource
from thinwire.data.graph import SBMOptions, make_sbm, node_dataset
from thinwire.data.task import task_for
from thinwire.errors import UsageError
from thinwire.models import MODELS
from thinwire.models.gcn import GCN
from thinwire.options import OptionError, build_options

ENTRY = MODELS.get("gcn")


def small_graph(seed: int = 0) -> Dataset:
    options = SBMOptions(nodes=600, communities=3, avg_degree=6.0, feature_dim=12,
                         train_per_class=10, val_nodes=50, test_nodes=200)
    g = make_sbm(options, seed)
    return node_dataset("sbm", features=g.features, labels=g.labels, edges=g.edges,
                        train_ids=g.train_ids, val_ids=g.val_ids, test_ids=g.test_ids,
                        num_classes=3, source=DataSource())


def build(dataset: Dataset, seed: int = 0, **options: Any) -> GCN:
    model = ENTRY.build(build_options(ENTRY.options, options, "model"), dataset, seed)
    assert isinstance(model, GCN)
    return model


def train(model: nn.Module, dataset: Dataset, steps: int) -> list[float]:
    task = task_for(dataset)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    losses = []
    for _ in range(steps):
        loss = task.loss(model(dataset.x_train), dataset.y_train)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_entry() -> None:
    assert ENTRY.name == "gcn" and ENTRY.data_kinds == ("node",)
    assert ENTRY.default_data == "cora"


def test_learns_and_keeps_the_graph_out_of_the_state() -> None:
    ds = small_graph()
    model = build(ds, hidden=16)
    assert [tuple(lin.weight.shape) for lin in model.layers] == [(16, 12), (3, 16)]
    assert set(model.state_dict()) == {"layers.0.weight", "layers.0.bias", "layers.1.weight",
                                       "layers.1.bias"}
    assert {n for n, _ in model.named_buffers()} == {"features", "adjacency"}
    assert model.adjacency.is_sparse and not model.features.requires_grad
    out = model(ds.x_test[:7])
    assert out.shape == (7, 3)
    losses = train(model, ds, 40)
    assert losses[-1] < 0.5 * losses[0], losses
    clone = copy.deepcopy(model)  # strategies may copy models: sparse buffers copy too
    assert torch.equal(clone(ds.x_test), model(ds.x_test))


def test_forward_is_the_kipf_welling_rule() -> None:
    ds = small_graph()
    model = build(ds, hidden=8, layers=3, norm="layer")
    a = ds.extra["adjacency"].to_dense()
    h = ds.extra["features"]
    with torch.no_grad():
        for i, lin in enumerate(model.layers):
            h = a @ h @ lin.weight.T + lin.bias
            if i < 2:
                h = torch.relu(torch.nn.functional.layer_norm(h, h.shape[-1:]))
        assert torch.allclose(model(ds.x_test), h[ds.x_test], atol=1e-5)


def test_same_seed_same_weights() -> None:
    ds = small_graph()
    a, b, c = build(ds, 5), build(ds, 5), build(ds, 6)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.layers[0].weight, c.layers[0].weight)


@pytest.mark.parametrize("norm", ["none", "layer"])
def test_a_subset_of_hidden_features_runs(norm: str) -> None:
    ds = small_graph()
    model = build(ds, hidden=16, layers=3, norm=norm)
    keep = [torch.tensor([0, 3, 5, 9, 15]), torch.tensor([1, 2, 8])]
    for i, idx in enumerate(keep):  # rows of layer i, columns of layer i + 1
        model.layers[i].weight.data = model.layers[i].weight.data[idx].clone()
        model.layers[i].bias.data = model.layers[i].bias.data[idx].clone()
        model.layers[i + 1].weight.data = model.layers[i + 1].weight.data[:, idx].clone()
    out = model(ds.x_train)
    assert out.shape == (30, 3)
    task_for(ds).loss(out, ds.y_train).backward()


def test_cora_accuracy(cora_dir: Path) -> None:
    data = DATASETS.get("cora")
    ds = data.load(DataSource(dir=str(cora_dir)), data.options(), 0)
    assert sum(p.numel() for p in ENTRY.build(ENTRY.options(), ds, 0).parameters()) == (
        1433 * 64 + 64 + 64 * 7 + 7)
    model = build(ds, hidden=16)  # Kipf & Welling's width (the default 64 scores alike)
    train(model, ds, 100)
    accuracy = task_for(ds).evaluate(model, ds.x_test, ds.y_test)["accuracy"]
    assert accuracy > 0.70, accuracy  # Kipf & Welling report 0.815


def test_wrong_dataset_kind_is_one_line() -> None:
    x = torch.randn(8, 5)
    flat = Dataset(name="flat", x_train=x, y_train=torch.zeros(8, dtype=torch.int64), x_test=x,
                   y_test=torch.zeros(8, dtype=torch.int64), num_classes=2)
    with pytest.raises(UsageError, match="gcn needs a graph") as exc:
        ENTRY.build(ENTRY.options(), flat, 0)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("values, name", [
    ({"norm": "batch"}, "model.norm"),
    ({"layers": 0}, "model.layers"),
    ({"hidden": 0}, "model.hidden"),
])
def test_options_are_validated(values: dict[str, Any], name: str) -> None:
    with pytest.raises(OptionError, match=name) as exc:
        build_options(ENTRY.options, values, "model")
    assert "\n" not in str(exc.value)


@pytest.mark.gpu
def test_runs_on_cuda_with_the_graph_moved() -> None:
    ds = small_graph()
    model = build(ds, hidden=16).cuda()
    assert model.features.is_cuda and model.adjacency.is_cuda
    losses = train(model, Dataset(
        name="sbm", x_train=ds.x_train.cuda(), y_train=ds.y_train.cuda(), x_test=ds.x_test,
        y_test=ds.y_test, num_classes=3, kind="node"), 20)
    assert losses[-1] < losses[0]


def _two_ranks(comm: Any, steps: int) -> dict[str, Any]:
    """One rank of DDP on a GCN, its half of the training nodes, the ledger's hook."""
    from thinwire.compression import ddp_hook

    ds = small_graph()
    model = build(ds, hidden=8)
    ddp = nn.parallel.DistributedDataParallel(model)
    state, hook = ddp_hook("none", comm=comm)
    ddp.register_comm_hook(state, hook)
    half = Dataset(name="sbm", x_train=ds.x_train[comm.rank::2], y_train=ds.y_train[comm.rank::2],
                   x_test=ds.x_test, y_test=ds.y_test, num_classes=3, kind="node")
    train(ddp, half, steps)
    return {"params": [p.detach().clone() for p in model.parameters()],
            "payload": state.comm.ledger.totals()["payload_bytes"]}


def test_two_ranks_of_ddp_equal_one_process_on_all_nodes() -> None:
    """World size 2, each rank on half the training nodes: the averaged gradients make both
    replicas equal one process's Adam on every node (a missing, partial or wrong exchange
    leaves them apart), and only the parameters' gradients cross the wire, never the graph."""
    from harness import run_workers

    steps = 3
    ranks = run_workers(_two_ranks, 2, steps)
    ds = small_graph()
    assert len(ds.x_train) % 2 == 0  # equal halves: the mean of their means is the full mean
    alone = build(ds, hidden=8)
    train(alone, ds, steps)
    numel = sum(p.numel() for p in alone.parameters())
    for r in ranks:
        for got, want in zip(r["params"], alone.parameters()):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
        assert r["payload"] == 4 * numel * steps
    moved = [float((a - b.detach()).abs().max()) for a, b in zip(ranks[0]["params"],
                                                          build(ds, hidden=8).parameters())]
    assert max(moved) > 1e-3  # it trained
