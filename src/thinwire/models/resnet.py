"""A small residual network for grey images with switchable, rescalable residual blocks.

He, Zhang, Ren, Sun, "Deep Residual Learning for Image Recognition" (CVPR 2016), the basic-block
variant sized for 28x28 inputs (as their CIFAR networks: three stages, widths 16/32/64). Each
:class:`BasicBlock` carries two plain attributes for ResIST (Dun, Wolfe, Jermaine, Kyrillidis,
"ResIST: Layer-Wise Decomposition of ResNets for Distributed Training", UAI 2022), which deals
shape-preserving blocks to workers and rescales them at test time: ``enabled`` (a disabled block
is the identity) and ``branch_scale`` (the residual branch's multiplier).

Forward pass for images given flat [B, C*H*W] (reshaped to ``input_shape``) or as [B, C, H, W]:
  1. ``stem``: conv 3x3 (C -> widths[0]) + BatchNorm2d + ReLU;
  2. ``stages[s]`` for s = 0, 1, ...: ``blocks[s]`` BasicBlocks of width ``widths[s]``; the first
     block of every stage after the first halves the resolution (stride 2) and widens the
     channels, with a 1x1 conv + BatchNorm2d shortcut;
  3. global average pooling, then ``head`` (linear, widths[-1] -> classes).

A BasicBlock computes ``relu(shortcut(x) + branch_scale * branch(x))`` with ``branch(x) =
bn2(conv2(relu(bn1(conv1(x)))))`` when enabled, and returns ``x`` unchanged when disabled. Only
shape-preserving blocks (``downsample`` False) may be disabled; running a disabled downsampling
block raises. BatchNorm keeps running statistics (used in eval mode).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from thinwire.errors import UsageError
from thinwire.models.adapter import ISTAdapter, ISTPlan, TensorPlan, UnitGroup
from thinwire.models.registry import ModelEntry
from thinwire.options import check, opt

if TYPE_CHECKING:
    from thinwire.data.datasets import Dataset


def conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    """A 3x3 convolution with padding 1 and no bias (a BatchNorm follows)."""
    return nn.Conv2d(c_in, c_out, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 conv + BN layers with a residual shortcut (identity, or 1x1 conv + BN when the
    block changes the shape)."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = conv3x3(c_in, c_out, stride)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = conv3x3(c_out, c_out)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.downsample: bool = stride != 1 or c_in != c_out
        self.shortcut: nn.Module = nn.Identity()
        if self.downsample:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(c_out))
        self.enabled: bool = True
        self.branch_scale: float = 1.0

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        """The residual branch: bn2(conv2(relu(bn1(conv1(x)))))."""
        return self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.enabled:
            if self.downsample:
                raise RuntimeError(
                    f"a downsampling BasicBlock ({self.conv1.in_channels} -> "
                    f"{self.conv1.out_channels} channels, stride {self.conv1.stride[0]}) cannot be "
                    f"disabled: it changes the shape; disable only shape-preserving blocks")
            return x
        branch = self.branch(x)
        if self.branch_scale != 1.0:
            branch = branch * self.branch_scale
        return F.relu(self.shortcut(x) + branch)


class ResNet(nn.Module):
    """The residual network of the module docstring."""

    def __init__(self, input_shape: Sequence[int], num_classes: int, *,
                 widths: Sequence[int] = (16, 32, 64), blocks: Sequence[int] = (2, 2, 2)) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(f"input_shape must be (C, H, W), got {tuple(input_shape)}")
        if len(widths) != len(blocks) or not widths:
            raise ValueError("widths and blocks need one entry per stage")
        self.input_shape = tuple(int(s) for s in input_shape)
        self.stem = nn.Sequential(conv3x3(self.input_shape[0], widths[0]),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        stages = []
        c_in = widths[0]
        for s, (width, count) in enumerate(zip(widths, blocks)):
            stride = 1 if s == 0 else 2
            stage = [BasicBlock(c_in, width, stride)]
            stage += [BasicBlock(width, width) for _ in range(count - 1)]
            stages.append(nn.ModuleList(stage))
            c_in = width
        self.stages = nn.ModuleList(stages)
        self.head = nn.Linear(c_in, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [B, classes] (steps of the module docstring)."""
        if x.dim() != 4:
            x = x.reshape(x.shape[0], *self.input_shape)
        h = self.stem(x)
        for _, _, block in self.residual_blocks():
            h = block(h)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))

    def residual_blocks(self) -> list[tuple[int, int, BasicBlock]]:
        """(stage, index, block) of every block, in order."""
        out: list[tuple[int, int, BasicBlock]] = []
        for s, stage in enumerate(self.stages):
            assert isinstance(stage, nn.ModuleList)
            for i, block in enumerate(stage):
                assert isinstance(block, BasicBlock)
                out.append((s, i, block))
        return out


@dataclass(frozen=True)
class Options:
    """``[model]`` options of the ResNet."""

    widths: tuple[int, ...] = opt((16, 32, 64), "channels of each stage, e.g. 16,32,64")
    blocks: tuple[int, ...] = opt((2, 2, 2), "basic blocks per stage, e.g. 2,2,2")

    def __post_init__(self) -> None:
        check(len(self.widths) >= 1, "model.widths", "give at least one stage width")
        check(all(w >= 1 for w in self.widths), "model.widths", "every width must be >= 1")
        check(len(self.blocks) == len(self.widths), "model.blocks",
              f"got {len(self.blocks)} entries for {len(self.widths)} stages; give one count per "
              f"entry of model.widths")
        check(all(b >= 1 for b in self.blocks), "model.blocks", "every count must be >= 1")


def build_resnet(options: Options, dataset: Dataset, seed: int) -> ResNet:
    """The ResNet for image ``dataset`` (``input_shape`` (C, H, W)) with weights drawn from
    ``seed`` (identical on every rank)."""
    if dataset.kind != "classification" or len(dataset.input_shape) != 3:
        raise UsageError(
            f"model resnet needs images with a (C, H, W) input_shape, but {dataset.name} is a "
            f"'{dataset.kind}' dataset with input shape {tuple(dataset.input_shape)}; pick an "
            f"image dataset such as fashion-mnist")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ResNet(dataset.input_shape, dataset.num_classes, widths=options.widths,
                      blocks=options.blocks)


class ResISTAdapter(ISTAdapter):
    """ResIST (Dun, Wolfe, Jermaine, Kyrillidis, UAI 2022): IST over a ResNet's depth.

    1. Units: in every stage, the residual blocks that do not downsample (``downsample`` False:
       same channels and resolution in and out, so the identity may replace them) form one
       ``dealt`` group ``stage.s``; a stage whose only block downsamples has none;
    2. each round every group is dealt round-robin over a fresh permutation
       (:func:`~thinwire.strategies.ist.partition.deal`): every subnet gets at least one block of
       every stage, every block goes to at least one subnet, and a block dealt to several
       subnets (a stage with fewer blocks than workers) is averaged over its holders;
    3. a block's tensors travel whole with it: both convolutions, both BatchNorms' weights and
       biases and their running statistics (``running_mean``, ``running_var``,
       ``num_batches_tracked``), so a block's statistics are the ones of the subnets it ran in;
    4. shared by every subnet and averaged over all ranks: the stem, the downsampling blocks
       (their statistics included) and the head;
    5. :meth:`configure` enables only the subnet's blocks (a disabled block is the identity);
    6. :meth:`configure_eval` (``scale = eval``, the default) multiplies each partitioned
       block's residual branch in the assembled model by p = 1 / min(S, n), for a stage of S
       partitioned blocks and n subnets: p is the share of subnets that ran the block in a
       round (size >= n: one of n; size < n: n / S of n), so, as with dropout's test-time
       rescaling and the paper's 1/S, the full model adds per stage the residual updates one
       subnet learned to add, not n times as many. ``none`` evaluates the assembled model
       unscaled.
    ``default_local_steps`` is the paper's 50.
    """

    scales = ("eval", "none")
    default_local_steps = 50
    default_optimizer_state = "reset"

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, ResNet):
            raise UsageError(f"ResISTAdapter cuts thinwire's ResNet, got {type(model).__name__}")
        self.units: dict[str, list[int]] = {}  # group -> stage index of each unit's block
        owner: dict[str, tuple[str, int]] = {}  # module prefix -> (group, unit)
        for s, stage in enumerate(model.stages):
            assert isinstance(stage, nn.ModuleList)
            cut = [i for i, b in enumerate(stage) if isinstance(b, BasicBlock) and not b.downsample]
            if cut:
                group = f"stage.{s}"
                self.units[group] = cut
                owner.update({f"stages.{s}.{i}.": (group, u) for u, i in enumerate(cut)})
        if not self.units:
            raise UsageError("ResIST needs a residual block that keeps its shape; this ResNet "
                             "has only downsampling blocks: use model.blocks of 2 or more")
        persistent = dict(model.state_dict(keep_vars=True))
        tensors = []
        named = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers()
                                              if n in persistent)]
        params = {n for n, _ in model.named_parameters()}
        for name, x in named:
            prefix = ".".join(name.split(".")[:3]) + "."
            tensors.append(TensorPlan(name, tuple(x.shape), unit=owner.get(prefix),
                                      buffer=name not in params,
                                      dtype=str(x.dtype).replace("torch.", "")))
        groups = tuple(UnitGroup(g, len(u), "dealt") for g, u in self.units.items())
        super().__init__(ISTPlan(groups=groups, tensors=tuple(tensors)))

    def _blocks(self, model: nn.Module) -> dict[str, list[BasicBlock]]:
        assert isinstance(model, ResNet)
        out: dict[str, list[BasicBlock]] = {}
        for group, cut in self.units.items():
            stage = model.stages[int(group.split(".")[1])]
            assert isinstance(stage, nn.ModuleList)
            out[group] = [stage[i] for i in cut]  # type: ignore[misc]
        return out

    def configure(self, model: nn.Module, held: Mapping[str, np.ndarray] | None) -> None:
        """Step 5; every branch at scale 1 while training."""
        for group, blocks in self._blocks(model).items():
            mine = None if held is None else {int(u) for u in held[group]}
            for u, block in enumerate(blocks):
                block.enabled = mine is None or u in mine
                block.branch_scale = 1.0

    def configure_eval(self, model: nn.Module, n: int) -> None:
        """Step 6: partitioned branches times 1 / min(S, n)."""
        for blocks in self._blocks(model).values():
            for block in blocks:
                block.branch_scale = 1.0 / min(len(blocks), n)


def activation_bytes(options: Options, dataset: Dataset, batch: int, recompute: str) -> int:
    """Bytes the forward pass and the cross-entropy loss keep for backward (fp32, training
    mode), from the shapes: B images of C x H x W, stage widths c_s, a stride-2 stage halving H
    and W (rounding up).

    1. The input, B C H W; 2. the stem: the convolution's output (BatchNorm's input) and the
    ReLU's output, 2 B c_0 H W, plus BatchNorm's saved mean and inverse std (2 c_0); 3. per
    basic block of width c at resolution h x w (its input is the previous output, already
    counted): conv1's and conv2's outputs (the BatchNorms' inputs), the inner ReLU's output
    (conv2's input) and the block's final ReLU output, 4 B c h w, plus 4 c of BatchNorm
    statistics; a downsampling block adds its 1x1 shortcut's output and statistics, B c h w + 2
    c; 4. ``block`` recompute: a checkpointed block keeps only its input, so each block adds its
    output (the next block's input) but the last, which the global average pool (a mean, saving
    no tensor) does not keep; 5. the head's input B c_last, the log-softmax output B x classes,
    the int64 targets and one scalar."""
    b = batch
    c0, h, w = (int(s) for s in dataset.input_shape)
    total = b * c0 * h * w + 2 * b * options.widths[0] * h * w + 2 * options.widths[0]
    c_in = options.widths[0]
    stages = list(zip(options.widths, options.blocks))
    for s, (c, count) in enumerate(stages):
        for i in range(count):
            if s > 0 and i == 0:
                h, w = (h - 1) // 2 + 1, (w - 1) // 2 + 1
            down = (s > 0 and i == 0) or c_in != c
            out = b * c * h * w
            if recompute == "block":
                last = s == len(stages) - 1 and i == count - 1
                total += 0 if last else out
            else:
                total += 4 * out + 4 * c + ((out + 2 * c) if down else 0)
            c_in = c
    total += b * c_in + b * dataset.num_classes + 1
    return 4 * total + 8 * b


MODEL = ModelEntry(
    name="resnet", summary="small ResNet with basic blocks (He et al. 2016) for grey images",
    build=build_resnet, data_kinds=("classification",), default_data="fashion-mnist",
    options=Options, blocks=(r"stages\.\d+\.\d+",), ist=ResISTAdapter,
    activations=activation_bytes)
