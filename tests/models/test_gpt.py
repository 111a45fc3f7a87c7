"""GPT: registry build, training signal, seeding, causality, cut heads and neurons."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from thinwire.data import DATASETS, Dataset, DataSource
from thinwire.data.task import task_for
from thinwire.errors import UsageError
from thinwire.models import MODELS
from thinwire.models.gpt import GPT, Block
from thinwire.options import OptionError, build_options

ENTRY = MODELS.get("gpt")
SMALL: dict[str, Any] = {"n_layer": 2, "n_head": 4, "d_model": 32}


def sequences(vocab: int = 11, seq_len: int = 16, n: int = 32, seed: int = 0) -> Dataset:
    """Token windows of a fixed random cycle: the next token is a function of the current one."""
    g = torch.Generator().manual_seed(seed)
    cycle = torch.randperm(vocab, generator=g)
    starts = torch.randint(0, vocab, (n, 1), generator=g)
    ids = cycle[(starts + torch.arange(seq_len + 1)) % vocab]
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return Dataset(name="cycle", x_train=x, y_train=y, x_test=x[:4], y_test=y[:4],
                   num_classes=vocab, kind="sequence")


def build(dataset: Dataset, seed: int = 0, **options: Any) -> GPT:
    model = ENTRY.build(build_options(ENTRY.options, {**SMALL, **options}, "model"), dataset,
                        seed)
    assert isinstance(model, GPT)
    return model


def train_steps(model: nn.Module, dataset: Dataset, steps: int, lr: float = 3e-3) -> list[float]:
    task = task_for(dataset)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = task.loss(model(dataset.x_train), dataset.y_train)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_entry() -> None:
    assert ENTRY.name == "gpt" and ENTRY.data_kinds == ("sequence",)
    assert ENTRY.default_data == "tinyshakespeare"


def test_builds_and_learns_a_tiny_batch() -> None:
    ds = sequences()
    model = build(ds)
    out = model(ds.x_train)
    assert out.shape == (32, 16, 11)
    losses = train_steps(model, ds, 30)
    assert losses[-1] < 0.5 * losses[0], losses


def test_default_size_on_tinyshakespeare(shakespeare_dir: Path) -> None:
    data = DATASETS.get("tinyshakespeare")
    ds = data.load(DataSource(dir=str(shakespeare_dir), limit_train=8, limit_test=2),
                   data.options(), 0)
    model = ENTRY.build(ENTRY.options(), ds, 0)
    assert sum(p.numel() for p in model.parameters()) == 421_632
    assert model.pos_emb.num_embeddings == 64 and model.head.out_features == 65
    losses = train_steps(model, ds, 5)
    assert losses[-1] < losses[0]


def test_same_seed_same_weights() -> None:
    ds = sequences()
    a, b, c = build(ds, 7), build(ds, 7), build(ds, 8)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(),
                                                 b.state_dict().values()))
    assert not torch.equal(a.blocks[0].attn.q.weight, c.blocks[0].attn.q.weight)


def test_build_leaves_the_global_rng_alone() -> None:
    ds = sequences()
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    build(ds, 7)
    assert torch.equal(torch.rand(3), expected)


def test_gpt2_init_scales_residual_projections() -> None:
    model = build(sequences(), d_model=256, n_layer=8, n_head=4)
    block = model.blocks[0]
    assert isinstance(block, Block)
    with torch.no_grad():
        assert abs(block.attn.q.weight.std().item() - 0.02) < 0.002
        assert abs(block.mlp.fc2.weight.std().item() - 0.02 / 4) < 0.0005  # 1/sqrt(2 x 8)
        assert block.attn.q.bias.abs().max().item() == 0.0


def test_causal() -> None:
    ds = sequences()
    model = build(ds).eval()
    x = ds.x_train[:2].clone()
    t = 9
    base = model(x)
    x[:, t] = (x[:, t] + 1) % 11
    changed = model(x)
    assert torch.allclose(base[:, :t], changed[:, :t], atol=1e-6, rtol=0)
    assert not torch.allclose(base[:, t], changed[:, t])


def test_shorter_sequences_and_too_long() -> None:
    ds = sequences()
    model = build(ds)
    assert model(ds.x_train[:, :5]).shape == (32, 5, 11)
    with pytest.raises(ValueError, match="context"):
        model(torch.zeros(1, 17, dtype=torch.int64))


def test_tied_embeddings_share_one_matrix() -> None:
    ds = sequences()
    tied, untied = build(ds, tie_embeddings=True), build(ds)
    assert tied.head.weight is tied.tok_emb.weight
    count = sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters())
    assert count == 11 * 32
    train_steps(tied, ds, 2)


def cut(model: GPT, heads: list[int], neurons: list[int]) -> None:
    """Keep only ``heads`` of every attention and ``neurons`` of every MLP (slicing ``.data``)."""
    for block in model.blocks:
        assert isinstance(block, Block)
        hd = block.attn.head_dim
        rows = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in heads])
        for lin in (block.attn.q, block.attn.k, block.attn.v):
            lin.weight.data = lin.weight.data[rows].clone()
            lin.bias.data = lin.bias.data[rows].clone()
        block.attn.proj.weight.data = block.attn.proj.weight.data[:, rows].clone()
        idx = torch.tensor(neurons)
        block.mlp.fc1.weight.data = block.mlp.fc1.weight.data[idx].clone()
        block.mlp.fc1.bias.data = block.mlp.fc1.bias.data[idx].clone()
        block.mlp.fc2.weight.data = block.mlp.fc2.weight.data[:, idx].clone()


def test_a_subset_of_heads_and_neurons_runs_and_equals_masking() -> None:
    ds = sequences()
    heads, neurons = [1, 3], list(range(0, 128, 3))
    full, sub = build(ds, 5), build(ds, 5)
    cut(sub, heads, neurons)
    assert sub.blocks[0].attn.q.weight.shape == (16, 32)
    assert sub.blocks[0].mlp.fc1.weight.shape == (len(neurons), 32)
    out = sub(ds.x_train)
    assert out.shape == (32, 16, 11)
    out.float().sum().backward()  # gradients flow through the cut model
    # the cut model equals the full one with the dropped heads' / neurons' outputs zeroed
    with torch.no_grad():
        for block in full.blocks:
            assert isinstance(block, Block)
            hd = block.attn.head_dim
            for h in set(range(4)) - set(heads):
                block.attn.proj.weight[:, h * hd:(h + 1) * hd] = 0
            drop = sorted(set(range(128)) - set(neurons))
            block.mlp.fc2.weight[:, drop] = 0
    assert torch.allclose(full(ds.x_train), out.detach(), atol=1e-5)


def test_wrong_dataset_kind_is_one_line() -> None:
    x = torch.randn(8, 1, 4, 4)
    images = Dataset(name="imgs", x_train=x, y_train=torch.zeros(8, dtype=torch.int64),
                     x_test=x, y_test=torch.zeros(8, dtype=torch.int64), num_classes=2)
    with pytest.raises(UsageError, match="gpt needs token sequences") as exc:
        ENTRY.build(ENTRY.options(), images, 0)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("values, name", [
    ({"d_model": 30, "n_head": 4}, "model.d_model"),
    ({"n_layer": 0}, "model.n_layer"),
    ({"dropout": 1.0}, "model.dropout"),
])
def test_options_are_validated(values: dict[str, Any], name: str) -> None:
    with pytest.raises(OptionError, match=name) as exc:
        build_options(ENTRY.options, values, "model")
    assert "\n" not in str(exc.value)


def test_dropout_trains_and_eval_is_deterministic() -> None:
    ds = sequences()
    model = build(ds, dropout=0.1)
    train_steps(model, ds, 2)
    model.eval()
    assert torch.equal(model(ds.x_test), model(ds.x_test))


@pytest.mark.gpu
def test_runs_on_cuda() -> None:
    ds = sequences()
    model = build(ds).cuda()
    out = model(ds.x_train.cuda())
    assert out.device.type == "cuda" and out.shape == (32, 16, 11)
    task_for(ds).loss(out, ds.y_train.cuda()).backward()
