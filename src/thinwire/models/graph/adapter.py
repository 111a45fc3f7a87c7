"""The derived adapter's model-side part: :class:`GraphAdapter` (``configure`` for a round,
the inverted-dropout scaling) and :func:`attention_forward`, ``nn.MultiheadAttention``'s forward
on cut tensors."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from thinwire.errors import UsageError
from thinwire.models.adapter import ISTAdapter, ISTPlan


@dataclass
class _Attention:
    heads: str
    head_dim: int
    held: int
    in_factor: float = 1.0
    head_factor: float = 1.0
    name: str = ""  # the module's, for its errors


def attention_forward(m: nn.MultiheadAttention, cut: _Attention, query: torch.Tensor,
                      key: torch.Tensor, value: torch.Tensor,
                      key_padding_mask: torch.Tensor | None = None, need_weights: bool = True,
                      attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                      is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``nn.MultiheadAttention``'s forward on cut tensors (a subnet's ``cut.held`` heads of
    ``cut.head_dim``): 1. q, k, v from the packed ``in_proj_weight`` (rows: the held heads' q,
    then their k, then their v); 2. per head, softmax(q k^T / sqrt(head_dim) + mask) with
    dropout in training, times v; 3. the heads concatenated, times ``cut.head_factor``
    (inverted dropout) and ``out_proj``. Masks as the module's: a 2-D ``attn_mask`` (or
    ``is_causal``) and a ``key_padding_mask`` [B, S], boolean (True: masked) or additive."""
    if not m.batch_first:
        query, key, value = (t.transpose(0, 1) for t in (query, key, value))
    if cut.in_factor != 1.0:
        query, key, value = (t * cut.in_factor for t in (query, key, value))
    b, lq, _ = query.shape
    s = key.shape[1]
    h, hd = cut.held, cut.head_dim
    w = m.in_proj_weight
    bias = m.in_proj_bias
    wq, wk, wv = w.chunk(3)
    bq, bk, bv = bias.chunk(3) if bias is not None else (None, None, None)
    q = F.linear(query, wq, bq).view(b, lq, h, hd).transpose(1, 2)
    k = F.linear(key, wk, bk).view(b, s, h, hd).transpose(1, 2)
    v = F.linear(value, wv, bv).view(b, s, h, hd).transpose(1, 2)
    scores = (q / math.sqrt(hd)) @ k.transpose(-2, -1)
    if attn_mask is None and is_causal:
        attn_mask = torch.ones(lq, s, dtype=torch.bool, device=q.device).triu(1)
    for mask in (attn_mask, None if key_padding_mask is None
                 else key_padding_mask[:, None, None, :]):
        if mask is None:
            continue
        if mask.dim() == 3:
            raise UsageError(f"IST cuts the heads of {cut.name or 'an attention'} "
                             f"({type(m).__name__}); its per-head 3-D attn_mask cannot follow "
                             f"the cut: pass a 2-D mask, or shared=({cut.name!r},) to keep it "
                             "whole")
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(mask, float("-inf"))
        else:
            scores = scores + mask.to(scores.dtype)
    weights = scores.softmax(-1)
    if m.training and m.dropout > 0:
        weights = F.dropout(weights, m.dropout)
    y = (weights @ v).transpose(1, 2).reshape(b, lq, h * hd)
    if cut.head_factor != 1.0:
        y = y * cut.head_factor
    y = F.linear(y, m.out_proj.weight, m.out_proj.bias)
    if not m.batch_first:
        y = y.transpose(0, 1)
    if not need_weights:
        return y, None
    return y, weights.mean(1) if average_attn_weights else weights


class GraphAdapter(ISTAdapter):
    """The adapter :func:`~thinwire.models.graph.derive_adapter` builds (package docstring:
    ``configure`` and the scaling). ``blocks``: group -> module names of its residual blocks
    (``residual="blocks"``); ``widths``: (module, attribute) -> (group, channels per unit), an
    attribute a subnet sets to the width it holds (a depthwise convolution's ``groups``, an
    attention's ``num_heads``, transformers' ``Conv1D.nf``)."""

    def __init__(self, plan: ISTPlan, *, layer_norms: Mapping[str, tuple[str, int]],
                 group_norms: Mapping[str, tuple[str, int]],
                 batch_norms: Mapping[str, tuple[str, int]],
                 attentions: Mapping[str, tuple[str, int]],
                 blocks: Mapping[str, Sequence[str]], description: Sequence[str],
                 widths: Mapping[tuple[str, str], tuple[str, int]] | None = None) -> None:
        if batch_norms or group_norms or blocks:  # a convolutional model: state reset
            self.default_optimizer_state = "reset"
        super().__init__(plan)
        self.layer_norms = dict(layer_norms)    # module -> (group, channels per unit)
        self.group_norms = dict(group_norms)    # module -> (group, norm groups per unit)
        self.batch_norms = dict(batch_norms)    # module -> (group, channels per unit)
        self.attentions = dict(attentions)      # module -> (heads group, head_dim)
        self.blocks = {g: list(b) for g, b in blocks.items()}
        # (module, attribute) -> (group, channels per unit): set to the width a subnet holds
        self.widths = dict(widths or {})
        self.description = list(description)
        self.scales = (("batchnorm", "dropout", "none") if plan.batch_normalised else
                       ("none",) if self.blocks else ("dropout", "none"))
        self._cuts: dict[str, _Attention] = {}

    def configure(self, model: nn.Module, held: Mapping[str, np.ndarray] | None) -> None:
        modules = dict(model.named_modules())

        def units(group: str) -> int:
            return self.plan.group(group).size if held is None else len(held[group])

        for name, (group, per) in self.layer_norms.items():
            modules[name].normalized_shape = (units(group) * per,)  # type: ignore[assignment]
        for name, (group, per) in self.group_norms.items():
            modules[name].num_groups = units(group) * per  # type: ignore[assignment]
        for name, (group, per) in self.batch_norms.items():
            modules[name].num_features = units(group) * per  # type: ignore[assignment]
        for (name, attr), (group, per) in self.widths.items():
            setattr(modules[name], attr, units(group) * per)
        self._cuts = {}
        for name, (group, hd) in self.attentions.items():
            m = modules[name]
            m.__dict__.pop("forward", None)
            if held is not None and units(group) < self.plan.group(group).size:
                cut = _Attention(group, hd, units(group), name=name)
                self._cuts[name] = cut
                m.forward = functools.partial(attention_forward, m, cut)  # type: ignore[method-assign]
        for group, names in self.blocks.items():
            mine = None if held is None else {int(u) for u in held[group]}
            for u, name in enumerate(names):
                block = modules[name]
                block.__dict__.pop("forward", None)
                if mine is not None and u not in mine:
                    block.forward = _identity  # type: ignore[method-assign]

    def install_scaling(self, model: nn.Module, factors: Sequence[tuple[str, float]]
                        ) -> list[Any]:
        """Inverted dropout: a forward pre-hook on each layer fed by a cut group; the heads'
        factor of a cut attention inside :func:`attention_forward`."""
        hooked = []
        handles: list[Any] = []
        modules = dict(model.named_modules())
        for name, factor in factors:
            owner = name.rsplit(".", 1)[0]
            if name.endswith(".out_proj") and owner in self._cuts:
                self._cuts[owner].head_factor = factor
                handles.append(_Reset(self._cuts[owner], "head_factor"))
            elif name in self._cuts:
                self._cuts[name].in_factor = factor
                handles.append(_Reset(self._cuts[name], "in_factor"))
            elif isinstance(modules[name], nn.MultiheadAttention):  # query, key and value
                handles.append(modules[name].register_forward_pre_hook(
                    lambda _m, args, f=factor: (*(a * f for a in args[:3]), *args[3:])))
            else:
                hooked.append((name, factor))
        return handles + super().install_scaling(model, hooked)


@dataclass
class _Reset:
    """A handle that puts an attention's scaling factor back to 1 (``remove``)."""

    cut: _Attention
    attr: str

    def remove(self) -> None:
        setattr(self.cut, self.attr, 1.0)


def _identity(*args: Any, **kwargs: Any) -> Any:
    """A skipped block's forward: its stream, the first argument (a keyword one where it is
    passed by name, as ``hidden_states=``), unchanged."""
    if args:
        return args[0]
    return next(v for v in kwargs.values() if isinstance(v, torch.Tensor))


def _dtype(x: torch.Tensor) -> str:
    return str(x.dtype).replace("torch.", "")
