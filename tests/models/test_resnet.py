"""ResNet: registry build, training signal, seeding, switchable and rescalable blocks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from thinwire.data import Dataset
from thinwire.data.task import task_for
from thinwire.errors import UsageError
from thinwire.models import MODELS
from thinwire.models.resnet import BasicBlock, ResNet
from thinwire.options import OptionError, build_options

ENTRY = MODELS.get("resnet")
SMALL: dict[str, Any] = {"widths": (4, 8), "blocks": (2, 2)}


def images(n: int = 16, seed: int = 0) -> Dataset:
    """Flat 28x28 grey images, as Fashion-MNIST is stored, with 3 classes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 784, generator=g)
    y = torch.arange(n) % 3
    return Dataset(name="fake-images", x_train=x, y_train=y, x_test=x[:4], y_test=y[:4],
                   num_classes=3, input_shape=(1, 28, 28))


def build(dataset: Dataset, seed: int = 0, **options: Any) -> ResNet:
    model = ENTRY.build(build_options(ENTRY.options, {**SMALL, **options}, "model"), dataset,
                        seed)
    assert isinstance(model, ResNet)
    return model


def test_entry_and_default_structure() -> None:
    assert ENTRY.name == "resnet" and ENTRY.default_data == "fashion-mnist"
    assert ENTRY.data_kinds == ("classification",)
    model = ENTRY.build(ENTRY.options(), images(), 0)
    assert isinstance(model, ResNet)
    assert [len(stage) for stage in model.stages] == [2, 2, 2]
    assert [b.downsample for _, _, b in model.residual_blocks()] == [
        False, False, True, False, True, False]
    assert sum(p.numel() for p in model.parameters()) == 174_515
    assert model(images().x_train[:2]).shape == (2, 3)


def test_learns_a_tiny_batch() -> None:
    ds = images()
    model = build(ds)
    task = task_for(ds)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(15):
        loss = task.loss(model(ds.x_train), ds.y_train)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert float(model.stem[1].running_mean.abs().sum()) > 0  # running statistics kept
    model.eval()  # eval uses running statistics: an image's logits do not depend on its batch
    assert torch.allclose(model(ds.x_test)[:1], model(ds.x_test[:1]), atol=1e-5)


def test_same_seed_same_weights() -> None:
    ds = images()
    a, b, c = build(ds, 3), build(ds, 3), build(ds, 4)
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(),
                                                 b.state_dict().values()))
    assert not torch.equal(a.stem[0].weight, c.stem[0].weight)


def test_disabled_block_is_identity() -> None:
    ds = images()
    model = build(ds).eval()
    block = model.stages[1][1]
    assert isinstance(block, BasicBlock) and not block.downsample
    h = torch.randn(2, 8, 14, 14)
    block.enabled = False
    assert block(h) is h
    # the whole model with the block disabled equals the model that skips it
    with torch.no_grad():
        x = ds.x_test.reshape(-1, 1, 28, 28)
        out = model(ds.x_test)
        h = model.stem(x)
        for s, i, b in model.residual_blocks():
            if (s, i) != (1, 1):
                h = b(h)
        manual = model.head(F.adaptive_avg_pool2d(h, 1).flatten(1))
    assert torch.equal(out, manual)


def test_branch_scale_multiplies_the_branch() -> None:
    model = build(images()).eval()
    block = model.stages[0][1]
    assert isinstance(block, BasicBlock)
    h = torch.relu(torch.randn(2, 4, 28, 28))
    with torch.no_grad():
        expected = torch.relu(h + 0.25 * block.branch(h))
        block.branch_scale = 0.25
        assert torch.allclose(block(h), expected)
        block.branch_scale = 0.0  # a zero branch on a non-negative input: identity
        assert torch.equal(block(h), h)


def test_disabling_a_downsampling_block_raises() -> None:
    ds = images()
    model = build(ds)
    block = model.stages[1][0]
    assert isinstance(block, BasicBlock) and block.downsample
    block.enabled = False
    with pytest.raises(RuntimeError, match="cannot be disabled"):
        model(ds.x_test)


def test_non_image_dataset_is_one_line() -> None:
    flat = Dataset(name="flat", x_train=torch.randn(4, 32), y_train=torch.zeros(4, dtype=torch.int64),
                   x_test=torch.randn(2, 32), y_test=torch.zeros(2, dtype=torch.int64),
                   num_classes=2)
    with pytest.raises(UsageError, match=r"\(C, H, W\)") as exc:
        ENTRY.build(ENTRY.options(), flat, 0)
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("values, name", [
    ({"widths": "16,32", "blocks": "2,2,2"}, "model.blocks"),
    ({"widths": "16,0"}, "model.widths"),
])
def test_options_are_validated(values: dict[str, Any], name: str) -> None:
    with pytest.raises(OptionError, match=name) as exc:
        build_options(ENTRY.options, values, "model")
    assert "\n" not in str(exc.value)


@pytest.mark.gpu
def test_runs_on_cuda() -> None:
    ds = images()
    model = build(ds).cuda()
    out = model(ds.x_train.cuda())
    assert out.device.type == "cuda" and out.shape == (16, 3)
    task_for(ds).loss(out, ds.y_train.cuda()).backward()
