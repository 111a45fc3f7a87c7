"""The scattered exchange of a codec whose payloads cannot be summed: a quantised reduce-scatter
with fp32 accumulation, then an all-gather of the re-quantised mean.

Prime Intellect, "INTELLECT-1 Technical Report" (arXiv 2412.01152), section 3 (the int8
all-reduce of the pseudo-gradients); Douillard et al., "Streaming DiLoCo" (arXiv 2501.18512),
section 2.3 (4-bit outer gradients accumulated in fp32). The default exchange of a non-linear
codec (:meth:`~thinwire.compression.base.Compressor.average_async`) all-gathers every rank's
payload: each of n ranks sends (n - 1) payloads. Here each sends 2 (n - 1) / n payloads, a ring
all-reduce's share, for one more rounding. For x of d elements on n ranks:

  1. cut x into n shards of s elements (s: d / n rounded up to a multiple of the codec's
     ``chunk``, so a shard holds whole scale blocks, and to an even count, so 4-bit codes pack
     whole bytes; the tail padded with zeros);
  2. encode every shard (with the codec's error feedback, a residual per shard, keyed
     ``key * n + j``) and send shard j's payload to rank j (an ``all_to_all`` through
     :class:`~thinwire.runtime.comm.Comm`: the quantised reduce-scatter);
  3. rank j decodes the n payloads of its shard and sums them in fp32 in rank order, then
     divides by n: its shard of the mean;
  4. re-encodes that mean (the codec without error feedback: the rounding of the shared mean
     is not any one rank's to keep) and sends it to every other rank (an ``all_to_all`` of the
     same payload to all: the all-gather);
  5. every rank decodes the n shards of the mean into x.

Both exchanges are point-to-point messages (gloo has no reduce-scatter of byte payloads), so
the ledger's bytes are exact: (n - 1) shard payloads sent in each. The exchange runs on one
background thread per codec, exchanges in the order they were issued (the same on every rank),
so :meth:`ScatteredExchange.average_async` returns at once and a caller overlaps it with
compute (Streaming DiLoCo's ``delay``). Chosen with the codec option ``exchange=scatter``
(``fp4:exchange=scatter``, ``int8:exchange=scatter``).

Error feedback keeps one residual a shard (key ``key * n + j``). Laid end to end the n shards'
residuals are a residual of x itself (the zero padding's is always 0: zeros encode exactly), so
:meth:`ScatteredExchange.split_state` hands each tensor of x its piece, as the plain codec does,
and :meth:`ScatteredExchange.join_state` cuts a bucket's pieces back into shards: in DDP's hook a
residual follows its parameters into a rebuilt bucket and across a checkpoint. Limit: the
messages are point-to-point, which gloo carries for CPU tensors only (CUDA tensors need nccl).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from thinwire.compression.base import (
    Collective,
    Compressor,
    Part,
    Payload,
    Shapes,
    from_bytes,
    to_bytes,
)
from thinwire.compression.feedback import ErrorFeedback
from thinwire.runtime.comm import Comm


def shard_numel(numel: int, world: int, chunk: int = 1) -> int:
    """Step 1: elements of one shard of ``numel`` over ``world`` ranks, whole chunks of
    ``chunk`` elements and an even count."""
    block = chunk if chunk % 2 == 0 else 2 * chunk
    return max(1, math.ceil(numel / max(world, 1) / block)) * block


class ScatteredExchange(Compressor):
    """A codec (``inner``, possibly with its error feedback) averaged by a quantised
    reduce-scatter and an all-gather of the re-quantised mean (module docstring). The wire
    format, encode and decode are the inner codec's."""

    linear = False

    def __init__(self, inner: Compressor) -> None:
        super().__init__(seed=inner.seed, rank=inner.rank)
        self.inner = inner
        self.name = inner.name
        self.unbiased = inner.unbiased
        self._plain = inner.inner if isinstance(inner, ErrorFeedback) else inner
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        # the world size of the last exchange, and joined state waiting to learn it
        self._world = 0
        self._joined: dict[int, torch.Tensor] = {}

    @property
    def wants_error_feedback(self) -> bool:
        return False  # the inner codec has it, or does not want it

    @property
    def chunk(self) -> int:
        return int(getattr(self._plain, "chunk", 1))

    def params(self) -> dict[str, Any]:
        return {**self.inner.params(), "exchange": "scatter"}

    def spec(self, numel: int, dtype: torch.dtype = torch.float32) -> tuple[Part, ...]:
        return self.inner.spec(numel, dtype)

    def encode(self, x: torch.Tensor, step: int, *, key: int = 0) -> Payload:
        return self.inner.encode(x, step, key=key)

    def decode(self, payload: Payload, numel: int, step: int, *, key: int = 0,
               out: torch.Tensor | None = None) -> torch.Tensor:
        return self.inner.decode(payload, numel, step, key=key, out=out)

    def decode_add(self, payload: Payload, out: torch.Tensor, step: int, *, key: int = 0) -> None:
        self.inner.decode_add(payload, out, step, key=key)

    # --- the exchange --------------------------------------------------------------------------
    def collectives(self, numel: int, shapes: Shapes | None = None,
                    dtype: torch.dtype = torch.float32, *, world: int = 1) -> list[Collective]:
        """Two ``all_to_all`` of (n - 1) shard payloads each (steps 2 and 4); nothing on one
        rank."""
        del shapes
        if world <= 1:
            return []
        shard = self.payload_bytes(shard_numel(numel, world, self.chunk), dtype)
        return [("all_to_all", (world - 1) * shard)] * 2

    def average_async(self, comm: Comm, x: torch.Tensor, step: int, *, key: int = 0,
                      tag: str = "grad", shapes: Shapes | None = None
                      ) -> tuple[torch.futures.Future, int]:
        del shapes
        fut: torch.futures.Future = torch.futures.Future()
        world = comm.world_size
        self._world = world
        self._place(key, x.numel(), world)
        sent = sum(b for _, b in self.collectives(x.numel(), world=world))

        def job() -> None:
            try:
                fut.set_result(self._exchange(comm, x, step, key, tag))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(exc)

        if world == 1:
            job()
            return fut, sent
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scatter")
            self._pool.submit(job)
        return fut, sent

    def _exchange(self, comm: Comm, x: torch.Tensor, step: int, key: int, tag: str
                  ) -> torch.Tensor:
        n, me = comm.world_size, comm.rank
        flat = x.reshape(-1)
        d = flat.numel()
        s = shard_numel(d, n, self.chunk)
        padded = torch.zeros(n * s, dtype=torch.float32, device=flat.device)
        padded[:d] = flat
        spec = self.inner.spec(s, torch.float32)
        # 1-2. encode each shard, send shard j to rank j
        sends = [to_bytes(self.inner.encode(padded[j * s:(j + 1) * s], step, key=key * n + j))
                 for j in range(n)]
        recvs = [torch.empty_like(sends[0]) for _ in range(n)]
        comm.all_to_all(sends, recvs, tag=tag)
        # 3. this rank's shard: the fp32 sum of every rank's payload in rank order, / n
        mine = torch.empty(s, dtype=torch.float32, device=flat.device)
        shard_key = key * n + me
        self.inner.decode(from_bytes(recvs[0], spec), s, step, key=shard_key, out=mine)
        for r in range(1, n):
            self.inner.decode_add(from_bytes(recvs[r], spec), mine, step, key=shard_key)
        mine.div_(n)
        # 4. re-encode the mean shard (no error feedback) and send it to every rank
        wire = to_bytes(self._plain.encode(mine, step, key=shard_key))
        gathered = [torch.empty_like(wire) for _ in range(n)]
        comm.all_to_all([wire] * n, gathered, tag=tag)
        # 5. decode every shard of the mean
        for j in range(n):
            self._plain.decode(from_bytes(gathered[j], spec), s, step, key=key * n + j,
                               out=padded[j * s:(j + 1) * s])
        flat.copy_(padded[:d])
        return flat.view_as(x)

    def close(self) -> None:
        """Finish the exchanges in flight and stop the background thread."""
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    # --- state: the inner codec's, per shard -------------------------------------------------
    def _residuals(self) -> dict[int, torch.Tensor] | None:
        residuals = getattr(self.inner, "residuals", None)
        return residuals if isinstance(residuals, dict) else None

    def _place(self, key: int, numel: int, world: int) -> None:
        """Cut a joined residual of x (``numel`` elements) into the shards of ``world`` ranks."""
        flat = self._joined.pop(key, None)
        residuals = self._residuals()
        if flat is None or residuals is None or flat.numel() != numel:
            return
        s = shard_numel(numel, world, self.chunk)
        padded = flat.new_zeros(world * s)
        padded[:numel] = flat
        for j in range(world):
            residuals[key * world + j] = padded[j * s:(j + 1) * s].clone()

    def reset(self, key: int | None = None) -> None:
        if key is None:
            self._joined.clear()
            self.inner.reset(None)
            return
        self._joined.pop(key, None)
        n = max(self._world, 1)
        for j in range(n):
            self.inner.reset(key * n + j)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.inner.load_state_dict(state)

    def split_state(self, key: int, shapes: Shapes) -> list[dict[str, torch.Tensor]]:
        """Each tensor's piece of bucket ``key``'s residual: the shards' residuals end to end,
        the padding dropped (module docstring)."""
        sizes = [math.prod(s) for s in shapes]
        d, n, residuals = sum(sizes), self._world, self._residuals()
        flat = self._joined.get(key)
        if flat is None and residuals is not None and n > 0:
            shards = [residuals.get(key * n + j) for j in range(n)]
            s = shard_numel(d, n, self.chunk)
            if all(e is not None and e.numel() == s for e in shards):
                flat = torch.cat([e for e in shards if e is not None])[:d]
        if flat is None or flat.numel() != d:
            return [{} for _ in shapes]
        return [{"residual": piece.clone()} for piece in flat.split(sizes)]

    def join_state(self, key: int, shapes: Shapes,
                   pieces: Sequence[Mapping[str, torch.Tensor]]) -> None:
        """Bucket ``key``'s residual from its tensors' pieces (absent ones zero), cut into shards
        at its next exchange, when the world size is known."""
        found = [p.get("residual") for p in pieces]
        like = next((t for t in found if t is not None), None)
        self.reset(key)
        if like is None:
            return
        self._joined[key] = torch.cat([
            t.reshape(-1) if t is not None else like.new_zeros(math.prod(s))
            for t, s in zip(found, shapes)])

