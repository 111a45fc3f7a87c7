"""Measured wire bytes beside the ledger's payload and estimated wire bytes.

Three figures per worker, and which kind each is:

- **payload** (ledger, exact): bytes handed to collectives and point-to-point calls;
- **estimated wire bytes** (ledger, ``sent``): what the collective's usual algorithm puts on the
  wire (ring all-reduce sends 2 (n-1)/n x payload; point-to-point is exact);
- **measured wire bytes** (kernel): the tx/rx byte counters of the worker's veth over the whole
  run, read before the first worker starts and after the last one exits.

What we compare: the sum over workers of measured tx bytes against the sum of the ledgers' wire
``sent`` bytes *including* ``control``-tagged traffic (evaluation, metric gathers, barriers),
since the kernel sees that traffic too. The ledger files keep control traffic out of their
``totals`` and ``by_op``; when a file also holds ``totals_with_control``
(``Ledger.totals(include_control=True)``) it is used, otherwise the comparison covers training
traffic only and says so. Control traffic is tens of bytes per evaluation for most methods, but
sharded IST assembles the full model on rank 0 at every evaluation (3/4 of the model per
evaluation with 4 workers), which the training-only figure leaves out.

Measured bytes include what the ledger leaves out, so they are expected to be a few percent
*higher*: Ethernet/IP/TCP headers of every frame (~4.5% of a full 1448-byte segment, less under
segmentation offload) and the receiver's ACKs; the rendezvous store and gloo's connection
set-up; gloo's per-message headers; DDP's one broadcast of the model at start-up (dp only).
Agreement within 10% is what the testbed tests require.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class RankLedger:
    """One rank's ledger totals (control traffic excluded) and per-op breakdown."""

    sent: int
    recv: int
    payload: int
    calls: int
    by_op: dict[str, dict[str, int]]
    control_sent: int | None = None  # control-tagged wire bytes sent, when the file has them


def read_ledgers(run_dir: Path, workers: int) -> list[RankLedger]:
    out = []
    for r in range(workers):
        data: dict[str, Any] = json.loads((run_dir / f"ledger.rank{r}.json").read_text())
        t = data["totals"]
        every = data.get("totals_with_control")
        control = None if every is None else int(every["sent_bytes"]) - int(t["sent_bytes"])
        out.append(RankLedger(int(t["sent_bytes"]), int(t["recv_bytes"]),
                              int(t["payload_bytes"]), int(t["calls"]), data["by_op"], control))
    return out


@dataclass(frozen=True)
class WireComparison:
    """Per-worker measured (kernel) and estimated (ledger) bytes of one run."""

    measured_tx: list[int]
    measured_rx: list[int]
    estimated_sent: list[int]
    estimated_recv: list[int]
    payload: list[int]
    control_sent: list[int] | None = None  # None: the ledger files lack control totals

    @property
    def measured_total(self) -> int:
        return sum(self.measured_tx)

    @property
    def estimated_total(self) -> int:
        """Ledger wire bytes sent, all workers, training traffic only."""
        return sum(self.estimated_sent)

    @property
    def compared_total(self) -> int:
        """What the measured bytes are compared with: training plus control when known."""
        return self.estimated_total + sum(self.control_sent or [])

    @property
    def ratio(self) -> float:
        """Measured / compared ledger wire bytes, summed over workers (nan without traffic)."""
        est = self.compared_total
        return self.measured_total / est if est else float("nan")

    def within(self, tolerance: float = 0.10) -> bool:
        return abs(self.ratio - 1.0) <= tolerance


def compare(tx: list[int], rx: list[int], ledgers: list[RankLedger]) -> WireComparison:
    control = [lg.control_sent for lg in ledgers]
    known = None if any(c is None for c in control) else [int(c or 0) for c in control]
    return WireComparison(list(tx), list(rx), [lg.sent for lg in ledgers],
                          [lg.recv for lg in ledgers], [lg.payload for lg in ledgers], known)
