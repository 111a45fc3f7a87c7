"""Memory and bytes of thinwire's own runs under the ``[memory]`` options, from the shapes.

The prediction the runs are held to (tests and ``benchmarks/memory_options.py``): per rank, the
most loaded rank of each figure, as :class:`thinwire.strategies.base.MemoryReport` measures it.

States (fp32, ``s`` optimizer tensors per parameter: AdamW 2, SGD with momentum 1, plain SGD 0;
Rajbhandari et al. 2020 Sec. 5 with ZeRO's partitions as torch lays them out):
  1. ``zero = 0``: parameters P, gradients P (DDP's buckets, which the gradients are views of),
     optimizer s P.
  2. ``zero = 1``: as 0, but the optimizer state of the parameters the rank owns
     (dp's ``owners``, its entry being :class:`~thinwire.strategies.entry.Bucketed`;
      :func:`thinwire.strategies.memory.deal`: whole parameters, largest first to the least
     loaded rank), s max_r P_r.
  3. ``zero = 2 | 3`` (FSDP2): every parameter sharded on dim 0 as ``torch.chunk``: rank r holds
     rows [r c, (r + 1) c) of c = ceil(d_0 / n); parameters, gradients and s optimizer tensors
     of that shard. Gathered at the end of the forward pass: ``2`` every group's all-gather
     output, n c (rest) per parameter (padded); ``3`` none (every group, the root included,
     reshards after its forward in torch >= 2.10).
  4. ``offload = params`` moves the states to the host; on a CPU run the host is the device,
     the figures do not change.
Activations: the model entry's ``activations`` formula from its shapes.

Bytes (the ledger's totals; :mod:`thinwire.runtime.comm` wire estimates):
  - ``zero = 0``: DDP's buckets (dp's ``buckets``,
    :func:`thinwire.strategies.data_parallel.bucket_traffic`);
  - ``zero = 1``: the same, plus every step one broadcast per owning rank of its parameters;
  - ``zero = 2``: every step, per FSDP group (each block, then the root's own parameters), one
    all-gather of the rank's padded shard and one reduce-scatter of the padded full gradient;
    ``zero = 3`` gathers each group twice (forward and backward).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from thinwire.strategies.entry import Bucketed
    from thinwire.strategies.traffic import Layout, ParamInfo, Traffic


def _dp() -> Bucketed:
    """Data parallelism's entry: the registered method that is
    :class:`~thinwire.strategies.entry.Bucketed` (``buckets``, ``owners``)."""
    from thinwire.planner.methods import bucketed

    return bucketed()


@dataclass(frozen=True)
class RunMemory:
    """Predicted bytes per rank (each the most loaded rank's)."""

    params: int
    grads: int
    optimizer: int
    activations: int
    gathered: int

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.gathered

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer,
                "activations": self.activations, "gathered": self.gathered, "peak": self.peak}


def optimizer_tensors(optimizer: str, momentum: float) -> int:
    """State tensors per parameter: AdamW 2 (exp_avg, exp_avg_sq), SGD 1 with momentum, else 0."""
    return 2 if optimizer == "adamw" else (1 if momentum else 0)


def shard_numel(p: ParamInfo, n: int, r: int) -> int:
    """Elements of rank r's FSDP2 shard of ``p`` (dim 0 chunked as ``torch.chunk``)."""
    d0 = p.shape[0] if p.shape else 1
    rest = p.numel // d0 if d0 else 0
    c = math.ceil(d0 / n)
    return max(0, min(c, d0 - r * c)) * rest


def padded_shard_numel(p: ParamInfo, n: int) -> int:
    """Elements every rank hands to FSDP2's all-gather for ``p`` (the chunk, padded)."""
    d0 = p.shape[0] if p.shape else 1
    return math.ceil(d0 / n) * (p.numel // d0 if d0 else 0)


def fsdp_groups(layout: Layout, blocks: Sequence[str]) -> list[list[ParamInfo]]:
    """Parameters per FSDP2 group: each block's (the first block whose name prefixes the
    parameter's), in block order, then the root's own (the rest); empty groups dropped."""
    rx = [re.compile(p) for p in blocks]
    names: list[str] = []
    owner: dict[str, str] = {}
    for p in layout.params:
        parts = p.name.split(".")
        for k in range(1, len(parts)):
            prefix = ".".join(parts[:k])
            if any(r.fullmatch(prefix) for r in rx):
                if prefix not in names:
                    names.append(prefix)
                owner[p.name] = prefix
                break
    groups = [[p for p in layout.params if owner.get(p.name) == g] for g in names]
    root = [p for p in layout.params if p.name not in owner]
    return [g for g in [*groups, root] if g]


def run_memory(layout: Layout, *, zero: int, workers: int, states: int, activations: int,
               blocks: Sequence[str] = ()) -> RunMemory:
    """Bytes per rank of a ``dp`` run (module docstring, steps 1-4)."""
    n = workers
    sizes = [p.numel * p.itemsize for p in layout.params]
    total = sum(sizes)
    if n <= 1 or zero == 0:
        return RunMemory(total, total, states * total, activations, 0)
    if zero == 1:
        owner = _dp().owners([p.numel for p in layout.params], n)
        per_rank = [sum(s for s, o in zip(sizes, owner) if o == r) for r in range(n)]
        return RunMemory(total, total, states * max(per_rank), activations, 0)
    local = max(sum(shard_numel(p, n, r) * p.itemsize for p in layout.params) for r in range(n))
    gathered = 0
    if zero == 2:
        gathered = sum(n * padded_shard_numel(p, n) * p.itemsize
                       for g in fsdp_groups(layout, blocks) for p in g)
    return RunMemory(local, local, states * local, activations, gathered)


def dp_run_traffic(layout: Layout, *, zero: int, workers: int, steps: int, codec: str = "none",
                blocks: Sequence[str] = ()) -> Traffic:
    """The ledger's totals of a ``dp`` run of ``steps`` steps (module docstring)."""
    from thinwire.strategies.traffic import Traffic, wire

    bucket_traffic = _dp().buckets
    n = workers
    if n <= 1:
        return Traffic.none(n)
    if zero == 0:
        return bucket_traffic(layout, codec, n, steps)
    if zero == 1:
        return bucket_traffic(layout, codec, n, steps) + _broadcasts(layout, n, steps)
    calls: dict[str, tuple[int, int]] = {}
    pay = sent = 0
    gathers = 2 if zero >= 3 else 1
    for group in fsdp_groups(layout, blocks):
        shard = sum(padded_shard_numel(p, n) * p.itemsize for p in group)
        for op, payload, times in (("all_gather", shard, gathers),
                                   ("reduce_scatter", n * shard, 1)):
            w = wire(op, payload, n)
            pay += payload * times * steps
            sent += w * times * steps
            c, b = calls.get(op, (0, 0))
            calls[op] = (c + times * steps, b + w * times * steps)
    return Traffic((sent,) * n, (sent,) * n, (pay,) * n, calls)


def _broadcasts(layout: Layout, n: int, steps: int) -> Traffic:
    """ZeRO-1: each owning rank broadcasts its parameters every step (chain estimate)."""
    from thinwire.runtime.ledger import wire_estimate
    from thinwire.strategies.traffic import Traffic

    owner = _dp().owners([p.numel for p in layout.params], n)
    owned = [sum(p.numel * p.itemsize for p, o in zip(layout.params, owner) if o == r)
             for r in range(n)]
    sent, recv, pay = [0] * n, [0] * n, [0] * n
    calls = 0
    wire0 = 0
    for src, payload in enumerate(owned):
        if not payload:
            continue
        calls += 1
        for r in range(n):
            s, v = wire_estimate("broadcast", payload, n, root=r == src)
            sent[r] += s * steps
            recv[r] += v * steps
            pay[r] += payload * steps
            if r == 0:
                wire0 += s * steps
    return Traffic(tuple(sent), tuple(recv), tuple(pay), {"broadcast": (calls * steps, wire0)})


def predict_dp_run(cfg: Any, dataset: Any, model: Any) -> tuple[RunMemory, Traffic]:
    """The prediction for config ``cfg`` (method ``dp``) of ``model`` on ``dataset``: memory
    per rank and the ledger's totals, from the model's shapes and its entry's formulas."""
    from thinwire.models import MODELS
    from thinwire.strategies import METHODS
    from thinwire.strategies.entry import Compressed
    from thinwire.strategies.traffic import Layout

    entry = MODELS.get(cfg.model.name)
    layout = Layout.of_model(model)
    n = cfg.runtime.workers
    zero = cfg.memory.zero if n > 1 else 0
    acts = 0
    if entry.activations is not None:
        acts = entry.activations(cfg.model.options, dataset, cfg.train.batch_size,
                                 cfg.memory.recompute)
    states = optimizer_tensors(cfg.train.optimizer, cfg.train.momentum)
    mem = run_memory(layout, zero=zero, workers=n, states=states, activations=acts,
                     blocks=entry.blocks)
    method = METHODS.get(cfg.method.name)  # the run's codec, as a compressed method gives it
    codec = method.codec(cfg.method.options) if isinstance(method, Compressed) else "none"
    traffic = dp_run_traffic(layout, zero=zero, workers=n, steps=cfg.train.steps, codec=codec,
                          blocks=entry.blocks)
    return mem, traffic


__all__ = ["RunMemory", "fsdp_groups", "optimizer_tensors", "predict_dp_run", "run_memory",
           "dp_run_traffic", "shard_numel"]
