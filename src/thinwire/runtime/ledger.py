"""The per-rank byte ledger: one :class:`LedgerEntry` per communication call of a
:class:`~thinwire.runtime.comm.Comm` (the operation, payload bytes, the bytes sent and received
on the wire, exact for point-to-point and estimated for collectives by :func:`wire_estimate`, the
peers, wall time, tag and device). Traffic tagged :data:`CONTROL` (evaluation, metric
reductions, checkpoint barriers) is kept out of a method's totals.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from thinwire.ring import RING_OPS, ring_bytes

CONTROL = "control"


def nbytes(tensors: torch.Tensor | Sequence[torch.Tensor]) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    return sum(t.numel() * t.element_size() for t in tensors)


def wire_estimate(op: str, payload: int, n: int, *, root: bool = False) -> tuple[int, int]:
    """(sent, received) bytes per rank on the wire for ``op`` over n ranks (estimates).

    - all_reduce (ring): reduce-scatter + all-gather, each rank sends and receives
      2 (n-1)/n x payload;
    - all_gather (ring) of ``payload`` bytes per rank: sends and receives (n-1) x payload;
    - reduce_scatter (ring) of a ``payload``-byte input (the full tensor): sends and receives
      (n-1)/n x payload;
    - broadcast (chain): every rank but the last forwards the payload once: the root sends it,
      others receive it and (n-2)/(n-1) of them forward it; we charge the root ``payload`` sent
      and each other rank ``payload`` received and (n-2)/(n-1) x payload sent;
    - send / recv: exact.
    """
    if n <= 1:
        return 0, 0
    if op in RING_OPS:  # the ring's bytes: thinwire.ring
        b = ring_bytes(op, payload, n)
        return b, b
    if op == "broadcast":
        return (payload, 0) if root else (round((n - 2) / (n - 1) * payload), payload)
    if op == "send":
        return payload, 0
    if op == "recv":
        return 0, payload
    if op == "barrier":
        return 0, 0
    raise ValueError(f"unknown op {op!r}")


@dataclass(frozen=True)
class LedgerEntry:
    step: int
    op: str
    tag: str
    payload: int
    sent: int
    recv: int
    peers: str
    seconds: float
    estimated: bool
    device: str = ""


class Ledger:
    """Per-rank record of every communication call (thread-safe: DDP hooks finish on threads)."""

    def __init__(self, rank: int = 0) -> None:
        self.rank = rank
        self.step = 0
        self.entries: list[LedgerEntry] = []
        self._lock = threading.Lock()

    def record(self, entry: LedgerEntry) -> None:
        with self._lock:
            self.entries.append(entry)

    def totals(self, *, include_control: bool = False, since: int = 0) -> dict[str, float]:
        """Sums over entries[since:]: payload, sent, recv, seconds, calls; estimated flags it."""
        with self._lock:
            chosen = [e for e in self.entries[since:] if include_control or e.tag != CONTROL]
        return {
            "payload_bytes": sum(e.payload for e in chosen),
            "sent_bytes": sum(e.sent for e in chosen),
            "recv_bytes": sum(e.recv for e in chosen),
            "comm_seconds": sum(e.seconds for e in chosen),
            "calls": len(chosen),
            "sent_estimated": any(e.estimated and e.sent for e in chosen),
        }

    def by_op(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        with self._lock:
            for e in self.entries:
                if e.tag == CONTROL:
                    continue
                d = out.setdefault(f"{e.op}:{e.tag}" if e.tag else e.op,
                                   {"calls": 0, "payload": 0, "sent": 0, "recv": 0})
                d["calls"] += 1
                d["payload"] += e.payload
                d["sent"] += e.sent
                d["recv"] += e.recv
        return out

    def mark(self) -> int:
        with self._lock:
            return len(self.entries)

    def dump(self) -> list[dict[str, Any]]:
        with self._lock:
            return [asdict(e) for e in self.entries]
