"""Compressed data parallelism in your own training loop: any codec as a DDP communication hook,
every byte through the ledger.

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from thinwire.compression import register

    dist.init_process_group("gloo")                 # or torchrun's environment
    ddp = DDP(model)
    state = register(ddp, "topk", ratio=0.01)       # or "powersgd:rank=2", "sign", ...
    ...                                             # train as usual
    print(state.compressor.describe(), state.comm.ledger.totals())

After a resume (model, optimizer and ``state.restore`` loaded), :func:`rebuild_buckets` before
the first step keeps the run bit for bit the uninterrupted one.

``hook(state, bucket) -> Future[Tensor]``: DDP hands over each bucket of gradients
(``bucket.buffer()``, flat) and waits for the future of their average. Per bucket and step:
  1. note the bucket's layout and its step counter (the ``step`` of every shared random draw;
     all ranks call the hook for the same buckets in the same order, so counters agree). When
     DDP rebuilds its buckets after the first iteration (and in every resumed process), each
     parameter's codec state (residual, warm start) and step follow it into its new bucket;
  2. the codec's exchange, :meth:`Compressor.average_async`, tagged ``grad``: linear codecs
     all-reduce their payload and decode once, the others all-gather their exact payload bytes
     and decode each rank's, PowerSGD runs its two all-reduces per tensor of the bucket; the
     average is decoded into the bucket's buffer.
:func:`average_async` is the same exchange for any flat tensor (DiLoCo's pseudo-gradient uses
it, tagged ``average``).

No ``from __future__ import annotations`` here: DDP's ``register_comm_hook`` compares the hook's
annotations with ``dist.GradBucket`` and ``Future[Tensor]`` as objects, not strings.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
import torch.distributed as dist

from thinwire.compression.base import Compressor
from thinwire.compression.registry import build_codec
from thinwire.runtime.comm import Comm


def average_async(comm: Comm, compressor: Compressor, x: torch.Tensor, step: int, *,
                  key: int = 0, tag: str = "grad",
                  shapes: Optional[Sequence[Sequence[int]]] = None
                  ) -> tuple[torch.futures.Future, int]:
    """Future of the all-rank average of flat ``x`` through ``compressor``, and the payload
    bytes this rank handed to collectives: :meth:`Compressor.average_async`. ``x`` may be
    overwritten."""
    return compressor.average_async(comm, x, step, key=key, tag=tag, shapes=shapes)


@dataclass
class HookState:
    """What the hook keeps between calls; error-feedback residuals live in the codec.

    ``comm.ledger`` records every collective the hook issues; ``encoded_bytes`` sums the
    payload bytes this rank handed to them. Codec state belongs to a bucket (the codec's
    ``key``), but DDP regroups its parameters into new buckets after the first iteration and
    again in every new process: so when a bucket's parameters change, each parameter's piece of
    the old bucket's state (:meth:`Compressor.split_state`) follows it into its new bucket
    (:meth:`Compressor.join_state`), with its step count; :meth:`export` and :meth:`restore` do
    the same across a checkpoint, keyed by the parameter's position in the model."""

    comm: Comm
    compressor: Compressor
    tag: str = "grad"
    # bucket index -> calls so far: the step of shared random draws
    steps: dict[int, int] = field(default_factory=dict)
    # bucket index -> (parameter ids, shapes) it held last time
    bucket_params: dict[int, tuple[tuple[int, ...], tuple[tuple[int, ...], ...]]] = field(
        default_factory=dict)
    # parameter id -> (its piece of codec state, its bucket's step), between buckets
    pending: dict[int, tuple[dict[str, torch.Tensor], int]] = field(default_factory=dict)
    # payload bytes this rank handed to collectives, all buckets and steps
    encoded_bytes: int = 0
    # while True the hook hands each bucket back unchanged and exchanges nothing
    # (:func:`rebuild_buckets`)
    silent: bool = False

    def _stash(self, key: int) -> None:
        """Move bucket ``key``'s state into :attr:`pending`, per parameter."""
        ids, shapes = self.bucket_params.pop(key)
        step = self.steps.pop(key, 0)
        for pid, piece in zip(ids, self.compressor.split_state(key, shapes)):
            self.pending[pid] = (piece, step)
        self.compressor.reset(key)

    def begin(self, key: int, ids: tuple[int, ...],
              shapes: tuple[tuple[int, ...], ...] = ()) -> int:
        """Step 1: this bucket's step, its codec state carried over from wherever its
        parameters were before (``shapes`` of ``ids``, in buffer order)."""
        if self.bucket_params.get(key, (ids, shapes))[0] != ids:
            self._stash(key)
        if key not in self.bucket_params:
            # other buckets holding any of these parameters give them up first
            owners = {k for k, (old, _) in self.bucket_params.items() if set(old) & set(ids)}
            for k in owners:
                self._stash(k)
            found = [self.pending.pop(pid, None) for pid in ids]
            if any(f is not None for f in found):
                self.compressor.join_state(key, shapes, [f[0] if f else {} for f in found])
                self.steps[key] = max(f[1] for f in found if f is not None)
            self.bucket_params[key] = (ids, shapes)
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        return step

    def export(self, params: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The codec state of every parameter, keyed ``"<index in params>.<name>"`` (and its
        step as ``"<index>.step"``): independent of DDP's bucket layout."""
        index = {id(p): i for i, p in enumerate(params)}
        out: dict[str, torch.Tensor] = {}
        items = list(self.pending.items())
        for key, (ids, shapes) in self.bucket_params.items():
            pieces = self.compressor.split_state(key, shapes)
            items += [(pid, (piece, self.steps.get(key, 0))) for pid, piece in zip(ids, pieces)]
        for pid, (piece, step) in items:
            i = index[pid]
            out[f"{i}.step"] = torch.tensor(step, dtype=torch.int64)
            out.update({f"{i}.{name}": t for name, t in piece.items()})
        return out

    def restore(self, params: Sequence[torch.Tensor], state: dict[str, torch.Tensor]) -> None:
        """Undo :meth:`export` into :attr:`pending`; each piece joins its bucket when the hook
        first sees it."""
        self.bucket_params.clear()
        self.steps.clear()
        self.compressor.reset()
        pieces: dict[int, dict[str, torch.Tensor]] = {}
        steps: dict[int, int] = {}
        for name, t in state.items():
            i, _, field_ = name.partition(".")
            if field_ == "step":
                steps[int(i)] = int(t)
            else:
                pieces.setdefault(int(i), {})[field_] = t
        self.pending = {id(params[i]): (pieces.get(i, {}), step) for i, step in steps.items()}


def unchanged(bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A completed future of the bucket's own gradients: what a silent hook returns."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def rebuild_buckets(ddp_model: Any, state: Any, forward_backward: Callable[[], Any]) -> None:
    """In a resumed process, let DDP rebuild its gradient buckets before the first real
    exchange, so that the run goes on bit for bit as the uninterrupted one.

    A new process starts DDP from its first-iteration bucket (every gradient in one bucket, in
    parameter order) and only then rebuilds the buckets in gradient-ready order; the
    uninterrupted run had rebuilt them after its first step. A codec whose result depends on a
    value's position in its bucket (int8's and fp4's chunk scales, QSGD's and rand-k's draws)
    would encode a differently laid out bucket at the first step after a resume. Call this once
    after loading the checkpoint (model, optimizer, ``state.restore``), before the first step:

        state = register(ddp, "int8")
        ...  # load model, optimizer and state.restore(list(model.parameters()), saved)
        rebuild_buckets(ddp, state, lambda: loss_fn(ddp(x), y).backward())

    Steps: 1. save the module's buffers; 2. ``forward_backward()`` (one forward and backward of
    ``ddp_model`` on any batch, say the next one) with the hook silent (``state.silent``: each
    bucket handed back unchanged, nothing exchanged, the codec state untouched) inside
    :func:`torch.random.fork_rng` (dropout's draws are put back), so DDP records the
    gradient-ready order; 3. put the buffers back and drop the gradients. DDP rebuilds at the
    next forward. ``state`` is the hook's state (:func:`register`'s) or any object with a
    ``silent`` attribute the hook reads. Every rank calls it (DDP's own buffer broadcast, if
    on, runs in this forward as in any other)."""
    module = ddp_model.module
    saved = [b.detach().clone() for b in module.buffers()]
    dev = next(module.parameters()).device
    state.silent = True
    try:
        with torch.random.fork_rng(devices=[] if dev.type == "cpu" else [dev],
                                   device_type=dev.type if dev.type != "cpu" else "cuda"):
            forward_backward()
    finally:
        state.silent = False
    with torch.no_grad():
        for b, kept in zip(module.buffers(), saved):
            b.copy_(kept)
    for p in module.parameters():
        p.grad = None


def compressed_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook (``DDP.register_comm_hook(state, compressed_hook)``)."""
    if state.silent:
        return unchanged(bucket)
    buf = bucket.buffer()
    key = bucket.index()
    # 1. layout and step
    shapes = tuple(tuple(g.shape) for g in bucket.gradients())
    step = state.begin(key, tuple(id(p) for p in bucket.parameters()), shapes)
    # 2. the codec's exchange, through the ledger
    fut, sent = state.compressor.average_async(state.comm, buf, step, key=key, tag=state.tag,
                                               shapes=[list(s) for s in shapes])
    state.encoded_bytes += sent
    return fut


Hook = Callable[[HookState, dist.GradBucket], torch.futures.Future]


def ddp_hook(codec: Union[str, Compressor] = "none", *, comm: Optional[Comm] = None,
             seed: int = 0, **options: Any) -> tuple[HookState, Hook]:
    """``(state, hook)`` for ``DDP.register_comm_hook``: ``codec`` (a spec such as ``"topk"``
    or ``"powersgd:rank=2,ef=false"`` with ``options`` as keywords, or a built
    :class:`Compressor`) on every bucket, through ``comm`` (default ``Comm()``: the default
    process group, so call it after ``init_process_group``). ``seed`` must be the same on every
    rank (shared randomness); the codec's private randomness uses the rank. Example::

        state, hook = ddp_hook("powersgd", rank=2)
        ddp_model.register_comm_hook(state, hook)
        ...
        state.comm.ledger.totals()["payload_bytes"]
    """
    comm = comm if comm is not None else Comm()
    if isinstance(codec, str):
        comp = build_codec(codec, options, seed=seed, rank=comm.rank)
    else:
        if options:
            raise TypeError("options go with a codec spec, not with a built codec")
        comp = codec
    return HookState(comm, comp), compressed_hook


def register(ddp_model: Any, codec: Union[str, Compressor] = "none", *,
             comm: Optional[Comm] = None, seed: int = 0, **options: Any) -> HookState:
    """Register ``codec`` as ``ddp_model``'s communication hook (:func:`ddp_hook`) and return
    its state (``state.comm.ledger`` holds the bytes). Example::

        ddp = DDP(model)
        state = register(ddp, "topk", ratio=0.01)
        print(state.compressor.describe())   # topk(ratio=0.01,ef)
    """
    state, hook = ddp_hook(codec, comm=comm, seed=seed, **options)
    ddp_model.register_comm_hook(state, hook)
    return state
