"""Memory options, orthogonal to the method, and the measurement of what a rank holds.

The ``[memory]`` section (:class:`thinwire.config.MemoryConfig`) chooses, for any model of the
registry (each :class:`~thinwire.models.registry.ModelEntry` names its ``blocks`` and its
``selective`` parts as regular expressions over module names):

- ``zero = 1``: ZeRO stage 1 (Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
  Trillion Parameter Models", SC'20, Sec. 5.1, P_os): :class:`ShardedOptimizer`. Our own rather
  than ``torch.distributed.optim.ZeroRedundancyOptimizer`` because that one broadcasts the
  updated parameters with ``torch.distributed`` directly, outside the ledger.
- ``zero = 2 | 3``: torch's FSDP2 ``fully_shard`` on every block and on the root
  (:func:`shard_model`): parameters, gradients and optimizer state sharded over the ranks at
  rest. ``2`` keeps the gathered parameters from the forward to the backward pass
  (``reshard_after_forward=False``: one all-gather per group per step, ZeRO-2's memory during
  compute); ``3`` frees them after each block's forward and gathers again for its backward
  (ZeRO-3; FSDP2 never reshards the root after forward: its parameters are needed first in the
  backward). FSDP2 calls its collectives itself; :class:`LedgerAllGather` and
  :class:`LedgerReduceScatter` are handed to it (``set_custom_all_gather`` /
  ``set_custom_reduce_scatter``), so every byte goes through :class:`~thinwire.runtime.comm.Comm`
  and its ledger like any other method's.
- ``recompute = block | selective``: torch's composable ``checkpoint`` (non-reentrant
  ``torch.utils.checkpoint``) on every block, or on every selective part (the GPT's attention:
  Korthikanti et al. 2022's selective recomputation); a checkpointed module keeps only its inputs
  and runs its forward again in the backward pass.
- ``offload = params``: FSDP2's ``CPUOffloadPolicy``: sharded parameters, gradients and
  optimizer state live in host memory and the optimizer steps there; only the gathered
  parameters of the running block are on the device. On a CPU run the host is the device, so
  offload moves no byte: the measured memory is the same as without it.

Measurement (:class:`ActivationMeter`, :func:`state_bytes`): parameter, gradient and
optimizer-state bytes from the tensors themselves (local shards of DTensors, distinct storages);
activations as the bytes of the distinct storages autograd saves for backward during the forward
pass and the loss (``torch.autograd.graph.saved_tensors_hooks``), plus the inputs a checkpointed
module keeps for its recomputation, parameters excluded; the parameters FSDP2 holds gathered at
the end of the forward pass. The transient of one block's recomputation during backward is not
included (the figure is what is held when the backward pass starts).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from thinwire.runtime.comm import Comm
from thinwire.runtime.ledger import nbytes

# --- which modules -----------------------------------------------------------------------------


def matching_modules(model: nn.Module, patterns: Sequence[str]) -> list[tuple[str, nn.Module]]:
    """(name, module) of every submodule whose full name matches one of ``patterns``."""
    rx = [re.compile(p) for p in patterns]
    return [(n, m) for n, m in model.named_modules() if n and any(r.fullmatch(n) for r in rx)]


@contextmanager
def running_stats_kept(module: nn.Module) -> Iterator[None]:
    """Leave the running statistics of every BatchNorm inside ``module`` as they were on entry:
    a recomputed forward pass in training mode would otherwise fold the same batch into them a
    second time (twice the momentum, ``num_batches_tracked`` counted twice), so evaluation
    would differ from the run without recomputation."""
    norms = [m for m in module.modules()
             if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats]
    saved = [[b.clone() for b in m.buffers(recurse=False)] for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, old in zip(norms, saved):
                for b, o in zip(m.buffers(recurse=False), old):
                    b.copy_(o)


def apply_recompute(model: nn.Module, patterns: Sequence[str]) -> list[nn.Module]:
    """Checkpoint every module matching ``patterns`` (torch's composable ``checkpoint``, in
    place: names and state dicts are unchanged); returns the checkpointed modules. The
    recomputation runs under :func:`running_stats_kept`, so a checkpointed block with
    BatchNorm updates its running statistics once per step, as without recomputation."""
    from torch.distributed._composable import checkpoint

    mods = [m for _, m in matching_modules(model, patterns)]
    for m in mods:
        checkpoint(m, context_fn=lambda m=m: (nullcontext(), running_stats_kept(m)))
    return mods


# --- measurement -------------------------------------------------------------------------------


def _is_param(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def distinct_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (local shards of DTensors)."""
    seen: set[tuple[int, str]] = set()
    total = 0
    for t in tensors:
        t = _local(t)
        st = t.untyped_storage()
        key = (st.data_ptr(), str(t.device))
        if key not in seen:
            seen.add(key)
            total += st.nbytes()
    return total


class ActivationMeter:
    """Bytes autograd keeps for backward at the end of a forward pass (module docstring).

    ``held`` are the checkpointed modules: their inputs are what a checkpoint keeps. The
    buffers of ``model`` (and any sparse tensor: a graph's adjacency) are the model's state, not
    activations, and are not counted.
    """

    def __init__(self, held: Sequence[nn.Module] = (), model: nn.Module | None = None) -> None:
        self.model = model
        self._buffers: set[tuple[int, str]] = set()
        self.last = 0
        self.peak = 0
        self._seen: set[tuple[int, str]] = set()
        self._bytes = 0
        self._active = False
        self.gathered = 0
        self.gathered_of: Callable[[], int] | None = None
        """Called when a forward pass ends: gathered parameter bytes (peak in ``gathered``)."""
        for m in held:
            m.register_forward_pre_hook(self._held)

    def _note(self, t: torch.Tensor) -> None:
        if not isinstance(t, torch.Tensor) or _is_param(t) or t.layout != torch.strided:
            return
        st = _local(t).untyped_storage()
        key = (st.data_ptr(), str(t.device))
        if key not in self._seen and key not in self._buffers:
            self._seen.add(key)
            self._bytes += st.nbytes()

    def _held(self, _module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._active and torch.is_grad_enabled():
            for a in args:
                self._note(a)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self._note(t)
        return t

    @contextmanager
    def measure(self) -> Iterator[None]:
        """Count the tensors saved inside the block (forward and loss)."""
        self._seen, self._bytes, self._active = set(), 0, True
        self._buffers = set()
        if self.model is not None:
            self._buffers = {(b.untyped_storage().data_ptr(), str(b.device))
                             for b in self.model.buffers() if b.layout == torch.strided}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            self._active = False
            self.last = self._bytes
            self.peak = max(self.peak, self._bytes)
            if self.gathered_of is not None:
                self.gathered = max(self.gathered, self.gathered_of())


def state_bytes(params: Sequence[torch.Tensor], optimizer_states: Iterable[dict[str, Any]],
                device: torch.device) -> tuple[int, int, int, int]:
    """(parameters, gradients, optimizer state, bytes of these on the host while training on
    another device) from the tensors: local shards, distinct storages, scalars (Adam's step
    count) excluded."""
    opt = [v for s in optimizer_states for v in s.values()
           if isinstance(v, torch.Tensor) and v.dim() > 0]
    grads = [p.grad for p in params if p.grad is not None]
    host = 0
    if device.type != "cpu":
        host = distinct_bytes(t for t in [*params, *grads, *opt] if t.device.type == "cpu")
    return distinct_bytes(params), distinct_bytes(grads), distinct_bytes(opt), host


# --- ZeRO-1 ------------------------------------------------------------------------------------


def deal(sizes: Sequence[int], n: int) -> list[int]:
    """Owner rank of each parameter: largest first to the least loaded rank (ties: lowest rank,
    then registration order), so ranks hold near-equal optimizer state. Pure: the planner
    prices ZeRO-1 with it."""
    load = [0] * n
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(n), key=lambda r: (load[r], r))
        owner[i] = r
        load[r] += sizes[i]
    return owner


class ShardedOptimizer:
    """ZeRO stage 1 through :class:`Comm`: each rank keeps the optimizer state of its own
    parameters only.

    Step: 1. the gradients arrive averaged on every rank (DDP); 2. each rank's inner optimizer
    (``make``) steps its own parameters (:func:`deal`); 3. every rank broadcasts its updated
    parameters, flattened into one buffer, to the others (one broadcast per rank, tag
    ``zero``). The update of each parameter is the plain optimizer's, so a run equals data
    parallelism bit for bit. ``param_groups`` lists every parameter (clipping sees the whole
    gradient); the learning rate set there is passed to the inner optimizer.
    """

    def __init__(self, params: Iterable[nn.Parameter], comm: Comm,
                 make: Callable[[list[nn.Parameter]], torch.optim.Optimizer]) -> None:
        self.comm = comm
        self.params = list(params)
        n = comm.world_size
        self.owner = deal([p.numel() for p in self.params], n)
        self.owned = [[p for p, o in zip(self.params, self.owner) if o == r] for r in range(n)]
        mine = self.owned[comm.rank]
        self.inner = make(mine) if mine else None
        lr = self.inner.param_groups[0]["lr"] if self.inner is not None else 0.0
        self.param_groups: list[dict[str, Any]] = [{"params": self.params, "lr": lr}]

    @property
    def state(self) -> dict[Any, Any]:
        return dict(self.inner.state) if self.inner is not None else {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        if self.inner is not None:
            for g in self.inner.param_groups:
                g["lr"] = self.param_groups[0]["lr"]
            self.inner.step()
        for r, owned in enumerate(self.owned):
            if not owned:
                continue
            if r == self.comm.rank:
                flat = torch.cat([p.reshape(-1) for p in owned])
            else:
                flat = torch.empty(sum(p.numel() for p in owned), dtype=owned[0].dtype,
                                   device=owned[0].device)
            self.comm.broadcast(flat, src=r, tag="zero")
            if r != self.comm.rank:
                i = 0
                for p in owned:
                    p.copy_(flat[i:i + p.numel()].view_as(p))
                    i += p.numel()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict() if self.inner is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.inner is not None:
            self.inner.load_state_dict(state)


# --- ZeRO-2/3 through FSDP2 --------------------------------------------------------------------


class LedgerAllGather:
    """FSDP2's all-gather, issued through :class:`Comm` (tag ``zero``)."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        del group
        return self.comm.all_gather_into(output_tensor, input_tensor, async_op=async_op,
                                         tag="zero")


class LedgerReduceScatter(LedgerAllGather):
    """FSDP2's gradient reduce-scatter, issued through :class:`Comm` (tag ``zero``)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,  # type: ignore[override]
                 group: Any, op: Any = None, async_op: bool = False) -> Any:
        del group
        return self.comm.reduce_scatter_into(output_tensor, input_tensor, op=op,
                                             async_op=async_op, tag="zero")


def shard_model(model: nn.Module, comm: Comm, device: torch.device, zero: int,
                blocks: Sequence[str], offload: bool) -> list[nn.Module]:
    """FSDP2 ``fully_shard`` on every block and then the root (module docstring); returns the
    FSDP modules, root last. Collectives go through ``comm``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    group = comm.group if comm.group is not None else dist.group.WORLD
    assert group is not None
    mesh = DeviceMesh.from_group(group, device.type)
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    groups = [m for _, m in matching_modules(model, blocks)] + [model]
    for m in groups:
        fully_shard(m, mesh=mesh, reshard_after_forward=zero >= 3, offload_policy=policy)
        m.set_custom_all_gather(LedgerAllGather(comm))  # type: ignore[operator]
        m.set_custom_reduce_scatter(LedgerReduceScatter(comm))  # type: ignore[operator]
    return groups


def gathered_bytes(model: nn.Module) -> int:
    """Bytes of the parameters a sharded model holds gathered now (FSDP2 registers plain
    tensors while a group is unsharded, DTensors while it is sharded)."""
    from torch.distributed.tensor import DTensor

    return distinct_bytes(p for p in model.parameters() if not isinstance(p, DTensor))


def full_state(model: nn.Module, comm: Comm) -> dict[str, torch.Tensor]:
    """The full state dict of a sharded model, gathered through ``comm`` (tag control):
    FSDP2 shards dim 0 as ``torch.chunk`` does, so each rank's shard is padded to the chunk
    size, gathered and trimmed."""
    from torch.distributed.tensor import DTensor

    from thinwire.runtime.ledger import CONTROL

    out: dict[str, torch.Tensor] = {}
    n = comm.world_size
    for name, t in model.state_dict().items():
        if not isinstance(t, DTensor):
            out[name] = t.detach()
            continue
        full = t.shape
        chunk = -(-full[0] // n)
        local = t.to_local().detach()
        pad = torch.zeros((chunk, *full[1:]), dtype=local.dtype, device=local.device)
        pad[:local.shape[0]] = local
        parts = comm.all_gather(pad, tag=CONTROL)
        out[name] = torch.cat(parts)[:full[0]].reshape(full)
    return out


def local_state(state: Any) -> Any:
    """``state`` with every DTensor replaced by its local shard (checkpoints)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {k: local_state(v) for k, v in state.items()}
    if isinstance(state, list):
        return [local_state(v) for v in state]
    return state


__all__ = [
    "ActivationMeter", "LedgerAllGather", "LedgerReduceScatter", "ShardedOptimizer",
    "apply_recompute", "deal", "distinct_bytes", "full_state", "gathered_bytes", "local_state",
    "matching_modules", "shard_model", "state_bytes", "nbytes",
]
