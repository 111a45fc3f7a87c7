"""Small models of every IST adapter for the invariant tests (tests/strategies/ist/test_ist_invariants.py).

Each :class:`Case` builds a tiny model identically on every rank, its adapter, the batch of a
(rank, step) and the loss: the fully connected stack (Yuan et al.), the GPT (heads and FFN
neurons), the ResNet (ResIST's dealt blocks, a stage with fewer blocks than 4 workers so blocks
are shared by several), the GCN (GIST, two hidden layers so cross blocks exist) and a user's own
attention with a fused q|k|v projection and its own adapter (``per_unit`` > 1 with
``segments`` = 3). BatchNorm momentum is 0 in the ResNet case, so running statistics stay put
and bitwise claims hold for every floating-point tensor (the ResNet tests check the statistics
themselves).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from thinwire.data import DataSource
from thinwire.data.graph import SBMOptions, make_sbm, node_dataset
from thinwire.models import build_mlp
from thinwire.models.adapter import (
    Cut,
    ISTAdapter,
    ISTPlan,
    TensorPlan,
    UnitGroup,
    linear_stack,
)
from thinwire.models.gcn import GCN, GISTAdapter
from thinwire.models.gpt import GPT, GPTAdapter
from thinwire.models.resnet import ResISTAdapter, ResNet

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], nn.Module]
    adapter: Callable[[nn.Module], ISTAdapter]
    batch: Callable[[int, int], Batch]

    @staticmethod
    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _gen(rank: int, step: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * rank + step)


def _seeded(make: Callable[[], nn.Module]) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return make()


# --- the fully connected stack ------------------------------------------------------------------
def _mlp() -> nn.Module:
    return build_mlp(12, (16, 12), 5, norm="none", seed=0)


def _mlp_batch(rank: int, step: int) -> Batch:
    g = _gen(rank, step)
    return torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)


# --- the GPT ----------------------------------------------------------------------------------
def _gpt() -> nn.Module:
    return _seeded(lambda: GPT(11, 8, n_layer=2, n_head=4, d_model=16, d_ff=24))


def _tokens(rank: int, step: int) -> Batch:
    g = _gen(rank, step)
    return torch.randint(0, 11, (4, 8), generator=g), torch.randint(0, 11, (4, 8), generator=g)


# --- the ResNet -------------------------------------------------------------------------------
def _resnet() -> nn.Module:
    model = _seeded(lambda: ResNet((1, 8, 8), 3, widths=(4, 8), blocks=(3, 2)))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.momentum = 0.0
    return model


def _images(rank: int, step: int) -> Batch:
    g = _gen(rank, step)
    return torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 3, (6,), generator=g)


# --- the GCN ----------------------------------------------------------------------------------
@cache
def _graph() -> tuple[torch.Tensor, torch.Tensor]:
    options = SBMOptions(nodes=300, communities=3, avg_degree=6.0, feature_dim=12,
                         train_per_class=10, val_nodes=50, test_nodes=100)
    g = make_sbm(options, 0)
    ds = node_dataset("sbm", features=g.features, labels=g.labels, edges=g.edges,
                      train_ids=g.train_ids, val_ids=g.val_ids, test_ids=g.test_ids,
                      num_classes=3, source=DataSource())
    return ds.extra["features"], ds.extra["adjacency"]


def _gcn() -> nn.Module:
    features, adjacency = _graph()
    return _seeded(lambda: GCN(features, adjacency, 3, hidden=16, layers=3, norm="layer"))


def _nodes(rank: int, step: int) -> Batch:
    g = _gen(rank, step)
    return torch.randint(0, 300, (16,), generator=g), torch.randint(0, 3, (16,), generator=g)


# --- a user's own attention with a fused q|k|v projection --------------------------------------
class FusedAttention(nn.Module):
    """Token embedding, one causal attention whose q, k and v come from one Linear (rows: all
    heads' q, then all heads' k, then all heads' v), an output projection to the vocabulary."""

    def __init__(self, vocab: int = 7, d: int = 12, heads: int = 4, head_dim: int = 3) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * heads * head_dim)
        self.out = nn.Linear(heads * head_dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, n, _ = x.shape
        width = self.qkv.weight.shape[0] // 3
        q, k, v = (t.view(b, n, -1, self.head_dim).transpose(1, 2)
                   for t in self.qkv(x).split(width, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, width))


def fused_adapter(model: nn.Module) -> ISTAdapter:
    assert isinstance(model, FusedAttention)
    hd, heads = model.head_dim, model.out.weight.shape[1] // model.head_dim
    plan = ISTPlan(
        groups=(UnitGroup("heads", heads),),
        tensors=(TensorPlan("emb.weight", tuple(model.emb.weight.shape)),
                 TensorPlan("qkv.weight", tuple(model.qkv.weight.shape),
                            (Cut("heads", 0, per_unit=hd, segments=3),)),
                 TensorPlan("qkv.bias", tuple(model.qkv.bias.shape),
                            (Cut("heads", 0, per_unit=hd, segments=3),)),
                 TensorPlan("out.weight", tuple(model.out.weight.shape),
                            (Cut("heads", 1, per_unit=hd),)),
                 TensorPlan("out.bias", tuple(model.out.bias.shape))),
        scaled_inputs=(("out", "heads"),))
    return ISTAdapter(plan)


def _fused() -> nn.Module:
    return _seeded(FusedAttention)


def _fused_tokens(rank: int, step: int) -> Batch:
    g = _gen(rank, step)
    return torch.randint(0, 7, (3, 6), generator=g), torch.randint(0, 7, (3, 6), generator=g)


CASES: dict[str, Case] = {
    "mlp": Case("mlp", _mlp, linear_stack, _mlp_batch),
    "gpt": Case("gpt", _gpt, GPTAdapter, _tokens),
    "resnet": Case("resnet", _resnet, ResISTAdapter, _images),
    "gcn": Case("gcn", _gcn, GISTAdapter, _nodes),
    "fused": Case("fused", _fused, fused_adapter, _fused_tokens),
}


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def block_owner(t: TensorPlan, plan: ISTPlan, held: dict[str, tuple[np.ndarray, ...]]
                ) -> torch.Tensor:
    """For a cut tensor: per element, the worker whose units index it along every cut (-1 where
    the cuts name different workers: a cross block). Computed from the layout rule of
    :class:`~thinwire.models.adapter.Cut` alone (segment-major, per_unit elements per unit)."""
    owner = torch.full(t.shape, -2, dtype=torch.int64)
    for c in t.cuts:
        size = plan.group(c.group).size
        worker_of = np.empty(size, dtype=np.int64)
        for w, units in enumerate(held[c.group]):
            worker_of[units] = w
        along = torch.as_tensor(worker_of[(np.arange(t.shape[c.dim]) % (size * c.per_unit))
                                          // c.per_unit])
        view = [1] * len(t.shape)
        view[c.dim] = -1
        along = along.view(view).expand(t.shape)
        owner = torch.where(owner == -2, along, torch.where(owner == along, owner, -1))
    return owner


# --- models users write from stock torch modules, cut by the graph-derived adapter --------------
class ResidualCNN(nn.Module):
    """A small residual CNN: conv + BatchNorm stem, one residual block with an identity skip, a
    GroupNorm layer, global pooling and a Linear head."""

    def __init__(self, c: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, c, 3, padding=1, bias=False), nn.BatchNorm2d(c),
                                  nn.ReLU())
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.wide = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.gn = nn.GroupNorm(4, 2 * c)
        self.head = nn.Linear(2 * c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = F.relu(h + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(h))))))
        h = F.relu(self.gn(self.wide(h)))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


class ResNeXtBlock(nn.Module):
    """A ResNeXt bottleneck (Xie et al., CVPR 2017): 1x1 in, a grouped 3x3 (``groups`` paths of
    ``c_mid / groups`` channels, each widened ``expand`` times), 1x1 out, plus the identity.
    ``norm=False``: the grouped convolution has a bias and no BatchNorm after it (a bias before
    a BatchNorm gets no gradient)."""

    def __init__(self, c: int, c_mid: int, groups: int, expand: int = 1,
                 norm: bool = True) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c_mid, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_mid)
        self.conv2 = nn.Conv2d(c_mid, c_mid * expand, 3, padding=1, groups=groups, bias=not norm)
        self.bn2: nn.Module = nn.BatchNorm2d(c_mid * expand) if norm else nn.Identity()
        self.conv3 = nn.Conv2d(c_mid * expand, c, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return F.relu(x + self.bn3(self.conv3(h)))


class ResNeXtNet(nn.Module):
    """A stem, two ResNeXt blocks (4 paths of 4 channels widened to 8; 8 paths of 2, with a
    bias and no norm after them), a head."""

    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1, bias=False),
                                  nn.BatchNorm2d(16), nn.ReLU())
        self.block1 = ResNeXtBlock(16, 16, groups=4, expand=2)
        self.block2 = ResNeXtBlock(16, 16, groups=8, norm=False)
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block2(self.block1(self.stem(x)))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


class Conv1dNet(nn.Module):
    """A Conv1d feature extractor over sequences of 3 channels, then a Linear chain."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm1d(8)
        self.fc1 = nn.Linear(8 * 6, 12)
        self.ln = nn.LayerNorm(12)
        self.fc2 = nn.Linear(12, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn(self.conv(x)))
        return self.fc2(F.relu(self.ln(self.fc1(h.flatten(1)))))


class EncoderClassifier(nn.Module):
    """Token embedding + learned positions, an nn.TransformerEncoder, mean pooling, a head."""

    def __init__(self, vocab: int = 9, d: int = 16, heads: int = 4, ff: int = 24,
                 layers: int = 2, context: int = 6, classes: int = 3) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(context, d) * 0.1)
        layer = nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.emb(idx) + self.pos)
        return self.head(h.mean(1))


class CharTransformer(nn.Module):
    """A character LM on nn.Transformer (encoder-decoder; the decoder reads the shifted
    sequence with a causal mask, the encoder the same context)."""

    def __init__(self, vocab: int = 11, d: int = 16, heads: int = 4, ff: int = 24,
                 context: int = 8) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.core = nn.Transformer(d, heads, 1, 1, ff, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context),
                             persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = self.pos(torch.arange(idx.shape[1], device=idx.device))
        h = self.emb(idx) + pos
        mask = self.mask[:idx.shape[1], :idx.shape[1]]
        return self.head(self.core(h, h, src_mask=mask, tgt_mask=mask))


class TorchBasicBlock(nn.Module):
    """torchvision's BasicBlock, written from torch modules."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                            nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    """torchvision's resnet18 layout (stem, four stages of two BasicBlocks, pooling, fc) at a
    width of our choosing."""

    def __init__(self, width: int = 4, classes: int = 3, in_channels: int = 1) -> None:
        super().__init__()
        w = [width, 2 * width, 4 * width, 8 * width]
        self.conv1 = nn.Conv2d(in_channels, w[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(w[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        c = w[0]
        for i, width_i in enumerate(w):
            stride = 1 if i == 0 else 2
            layer = nn.Sequential(TorchBasicBlock(c, width_i, stride),
                                  TorchBasicBlock(width_i, width_i))
            setattr(self, f"layer{i + 1}", layer)
            c = width_i
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def _momentum_zero(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.momentum = 0.0
    return model


def _cnn_images(rank: int, step: int) -> Batch:
    g = _gen(rank, step)
    return torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 3, (6,), generator=g)


def _seq3(rank: int, step: int) -> Batch:
    g = _gen(rank, step)
    return torch.randn(5, 3, 6, generator=g), torch.randint(0, 4, (5,), generator=g)


def _cls_tokens(rank: int, step: int) -> Batch:
    g = _gen(rank, step)
    return torch.randint(0, 9, (4, 6), generator=g), torch.randint(0, 3, (4,), generator=g)


def _r18_images(rank: int, step: int) -> Batch:
    g = _gen(rank, step)
    return torch.randn(4, 1, 32, 32, generator=g), torch.randint(0, 3, (4,), generator=g)


def derived(make_batch: Callable[[int, int], Batch], **options: object
            ) -> Callable[[nn.Module], ISTAdapter]:
    """The graph-derived adapter, traced with the case's own first batch."""
    from thinwire.models.graph_adapter import derive_adapter

    return lambda model: derive_adapter(model, make_batch(0, 0)[0], min_units=4, **options)


GRAPH_CASES: dict[str, Case] = {
    "g_mlp": Case("g_mlp", _mlp, derived(_mlp_batch), _mlp_batch),
    "g_gpt": Case("g_gpt", _gpt, derived(_tokens), _tokens),
    "g_cnn": Case("g_cnn", lambda: _momentum_zero(_seeded(ResidualCNN)), derived(_cnn_images),
                  _cnn_images),
    "g_cnn_blocks": Case("g_cnn_blocks", lambda: _momentum_zero(_seeded(lambda: ResNet18(2))),
                         derived(_r18_images, residual="blocks"), _r18_images),
    "g_resnext": Case("g_resnext", lambda: _momentum_zero(_seeded(ResNeXtNet)),
                      derived(_cnn_images), _cnn_images),
    "g_conv1d": Case("g_conv1d", lambda: _momentum_zero(_seeded(Conv1dNet)), derived(_seq3),
                     _seq3),
    "g_encoder": Case("g_encoder", lambda: _seeded(EncoderClassifier), derived(_cls_tokens),
                      _cls_tokens),
    "g_encoder_cut": Case("g_encoder_cut", lambda: _seeded(EncoderClassifier),
                          derived(_cls_tokens, embeddings="cut"), _cls_tokens),
    "g_transformer": Case("g_transformer", lambda: _seeded(CharTransformer), derived(_tokens),
                          _tokens),
}
CASES.update(GRAPH_CASES)


def subnet_of(model: nn.Module, adapter: Any, held: dict[str, np.ndarray]) -> nn.Module:
    """A copy of ``model`` cut to the units ``held`` (every cut tensor's elements of those
    units, as a worker's subnet holds them), configured by the adapter."""
    import copy

    from thinwire.strategies.ist.elements import element_index

    sub = copy.deepcopy(model)
    tensors = {**dict(sub.named_parameters()), **dict(sub.named_buffers())}
    with torch.no_grad():
        for t in adapter.plan.tensors:
            x = tensors[t.name].data
            for c in t.cuts:
                size = adapter.plan.group(c.group).size
                x = x.index_select(c.dim, element_index(c, size, torch.as_tensor(held[c.group])))
            tensors[t.name].data = x.clone()
    adapter.configure(sub, held)
    return sub


def zeroed_unheld(model: nn.Module, plan: Any, held: dict[str, np.ndarray]
                  ) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A copy of ``model`` with every element of an unheld unit zeroed (running variances
    kept: a zero channel then normalises to zero), and the copy's tensors by name. A residual
    block's parameters travel whole with it (``t.unit``): an unheld block's are all zeroed,
    which makes a block whose branch ends in a norm or a projection the identity."""
    import copy

    from thinwire.strategies.ist.elements import element_index

    out = copy.deepcopy(model)
    tensors = {**dict(out.named_parameters()), **dict(out.named_buffers())}
    with torch.no_grad():
        for t in plan.tensors:
            x = tensors[t.name]
            for c in t.cuts:
                keep = element_index(c, plan.group(c.group).size, torch.as_tensor(held[c.group]))
                mask = torch.zeros(x.shape[c.dim], dtype=torch.bool)
                mask[keep] = True
                view = [1] * x.dim()
                view[c.dim] = -1
                if not t.buffer or "running_mean" in t.name:
                    x.mul_(mask.view(view).to(x.dtype))
            if t.unit is not None and not t.buffer and t.unit[1] not in set(
                    held[t.unit[0]].tolist()):
                x.zero_()
    return out, tensors
