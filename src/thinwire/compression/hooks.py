"""Compressed data parallelism: any compressor as a DDP communication hook, through the ledger.

``hook(state, bucket) -> Future[Tensor]``: DDP hands over each bucket of gradients
(``bucket.buffer()``, flat) and waits for the future of their average. Per bucket and step:
  1. note the bucket's layout and its step counter (the ``step`` of every shared random draw;
     all ranks call the hook for the same buckets in the same order, so counters agree). When
     DDP rebuilds its buckets after the first iteration, the compressor state of a bucket whose
     parameters changed is reset;
  2. linear compressors (identity, fp16, bf16, Rand-k with shared indices): divide the bucket by
     the world size n, encode (with error feedback where configured), all-reduce the single
     payload tensor (``Comm.all_reduce_async``: the sum of the payloads encodes the sum of the
     inputs) and decode once: the average;
  3. other compressors (Top-k, QSGD, int8, sign): encode (with error feedback), view the
     payload's tensors as bytes and concatenate them, all-gather those bytes
     (``Comm.all_gather_async``: the ledger counts exactly the encoded indices, values, scales
     and packed bits), split each rank's bytes back into typed tensors, decode each and average
     in rank order (so every rank computes the same sum);
  4. PowerSGD: its own two all-reduces (P, then Q) with error feedback and warm start, per
     tensor of the bucket (:meth:`PowerSGD.average_async`).
Every exchange is tagged ``grad``. :func:`average_async` is the same exchange for any flat
tensor (DiLoCo's pseudo-gradient uses it, tagged ``average``).

No ``from __future__ import annotations`` here: DDP's ``register_comm_hook`` compares the hook's
annotations with ``dist.GradBucket`` and ``Future[Tensor]`` as objects, not strings.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from thinwire.compression.base import Compressor, from_bytes, to_bytes
from thinwire.compression.powersgd import PowerSGD
from thinwire.runtime.comm import Comm, nbytes


def average_async(comm: Comm, compressor: Compressor, x: torch.Tensor, step: int, *,
                  key: int = 0, tag: str = "grad",
                  shapes: Sequence[Sequence[int]] | None = None
                  ) -> tuple[torch.futures.Future, int]:
    """Future of the all-rank average of flat ``x`` through ``compressor``, and the payload
    bytes this rank handed to collectives. ``x`` may be overwritten (it is, for linear ones)."""
    if isinstance(compressor, PowerSGD):
        return compressor.average_async(comm, x, step, key=key, tag=tag, shapes=shapes)
    world, numel, dtype = comm.world_size, x.numel(), x.dtype
    if compressor.linear:
        # 2. divide, encode, sum the payload, decode once
        (wire,) = compressor.encode(x.div_(world), step, key=key)

        def decode_sum(f: torch.futures.Future) -> torch.Tensor:
            out = compressor.decode((f.value(),), numel, step, key=key)
            return out.to(dtype).view_as(x)

        return comm.all_reduce_async(wire, tag=tag).then(decode_sum), nbytes(wire)
    # 3. encode, gather every rank's bytes, decode each, average
    wire = to_bytes(compressor.encode(x, step, key=key))
    spec = compressor.spec(numel, dtype)

    def decode_all(f: torch.futures.Future) -> torch.Tensor:
        rows = f.value().view(world, -1)
        total = compressor.decode(from_bytes(rows[0], spec), numel, step, key=key).to(dtype)
        for r in range(1, world):
            total = total + compressor.decode(from_bytes(rows[r], spec), numel, step, key=key)
        return total.div_(world).view_as(x)

    return comm.all_gather_async(wire, tag=tag).then(decode_all), nbytes(wire)


@dataclass
class HookState:
    """What the hook keeps between calls; error-feedback residuals live in the compressor."""

    comm: Comm
    compressor: Compressor
    tag: str = "grad"
    # bucket index -> calls so far: the step of shared random draws
    steps: dict[int, int] = field(default_factory=dict)
    # bucket index -> parameters it held last time (to reset state when DDP rebuilds buckets)
    layouts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    # payload bytes this rank handed to collectives, all buckets and steps
    encoded_bytes: int = 0

    def begin(self, key: int, layout: tuple[int, ...]) -> int:
        """Step 1: this bucket's step; reset its compressor state if its parameters changed."""
        if self.layouts.get(key, layout) != layout:
            self.compressor.reset(key)
        self.layouts[key] = layout
        step = self.steps.get(key, 0)
        self.steps[key] = step + 1
        return step


def compressed_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook (``DDP.register_comm_hook(state, compressed_hook)``)."""
    buf = bucket.buffer()
    key = bucket.index()
    # 1. layout and step
    step = state.begin(key, tuple(id(p) for p in bucket.parameters()))
    shapes = [tuple(g.shape) for g in bucket.gradients()]
    # 2-4. exchange through the ledger
    fut, sent = average_async(state.comm, state.compressor, buf, step, key=key, tag=state.tag,
                              shapes=shapes)
    state.encoded_bytes += sent
    return fut
