"""Modelled mode: what a run would take on a thin link, computed from a loopback run.

Used where namespaces cannot be built (not root, no iproute2) or with ``--modelled``. The methods
run normally over loopback; nothing in the result is a measurement of a thin wire, and every
figure derived here is labelled *modelled*:

    modelled wall = measured compute time (rank 0, loopback run)
                  + max over ranks of sum over the rank's ledger ops of
                        calls x hops(op, n) x 2 x delay  +  max(sent, recv) / goodput

- ``hops``: sequential message steps of one call: ring all-reduce 2 (n-1), ring all-gather and
  chain broadcast n-1, send / recv / barrier 1. A message between two workers crosses two links
  (one upload, one download), each with ``delay``, hence 2 x delay per hop. Point-to-point
  messages posted together (IST's exchanges) are charged one latency each: an upper bound.
- ``max(sent, recv)``: links are full duplex, so an op whose rank sends and receives at once
  (ring collectives) costs the larger direction; sends and receives are separate ledger ops, so
  they are summed: exact for IST's central scatter-then-gather, an upper bound otherwise.
- ``goodput`` = rate x 1448/1538: TCP payload per 1500-byte frame (IP and TCP headers with
  timestamps, Ethernet header and the 24 bytes of preamble, FCS and gap), as on the testbed.
- An unlimited link costs latency only.
- Evaluation points: compute time from rank 0's training records at that step; communication
  time scaled by the fraction of the run's final bytes sent by then (evaluation records carry
  the cumulative per-worker bytes).

Ledger bytes are the ledger's *estimates* for collectives (ring algorithm) and exact for
point-to-point; ledger files hold per-op totals and call counts (``by_op``), enough for the sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from thinwire.testbed.measure import RankLedger
from thinwire.testbed.rates import Link

FRAME_EFFICIENCY = 1448 / 1538


def hops(op: str, n: int) -> int:
    """Sequential message steps of one call of ``op`` over n ranks (see the module docstring)."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("all_gather", "broadcast"):
        return n - 1
    return 1


def op_seconds(op: str, calls: int, sent: int, recv: int, link: Link, n: int,
               efficiency: float = FRAME_EFFICIENCY) -> float:
    """Modelled seconds of ``calls`` calls of ``op`` moving (sent, recv) bytes on one rank."""
    latency = calls * hops(op, n) * 2 * link.delay_s
    bps = link.bytes_per_s
    return latency if bps is None else latency + max(sent, recv) / (bps * efficiency)


def comm_seconds(by_op: dict[str, dict[str, int]], link: Link, n: int,
                 efficiency: float = FRAME_EFFICIENCY) -> float:
    """One rank's modelled communication seconds from its ledger's per-op totals."""
    return sum(op_seconds(key.partition(":")[0], d["calls"], d["sent"], d["recv"], link, n,
                          efficiency) for key, d in by_op.items())


def compute_at(trains: Sequence[dict[str, Any]], step: int, total_compute: float,
               steps: int) -> float:
    """Rank 0's cumulative compute seconds at ``step``: the training record of that step, else
    linear between the neighbouring records (0 at step 0, ``total_compute`` at ``steps``)."""
    points = [(0, 0.0)] + [(int(r["step"]), float(r["compute_s"])) for r in trains]
    points.append((steps, total_compute))
    points.sort()
    for (s0, c0), (s1, c1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return c0 if s1 == s0 else c0 + (c1 - c0) * (step - s0) / (s1 - s0)
    return total_compute


@dataclass(frozen=True)
class ModelledRun:
    """Modelled wall times of one loopback run on one link (all figures modelled)."""

    link: Link
    compute_s: float
    comm_s: float
    curve: list[tuple[int, float, float]]  # (step, accuracy, modelled wall s)

    @property
    def wall_s(self) -> float:
        return self.compute_s + self.comm_s


def model_run(summary: dict[str, Any], records: Sequence[dict[str, Any]],
              ledgers: Sequence[RankLedger], link: Link) -> ModelledRun:
    n = int(summary["workers"])
    steps = int(summary["steps"])
    compute = float(summary["compute_s"])
    comm = max((comm_seconds(lg.by_op, link, n) for lg in ledgers), default=0.0)
    final_sent = float(summary["bytes"]["sent_per_worker_max"])
    trains = [r for r in records if r["kind"] == "train"]
    curve = []
    for ev in (r for r in records if r["kind"] == "eval"):
        step = int(ev["step"])
        frac = float(ev["sent_bytes_max"]) / final_sent if final_sent > 0 else step / steps
        wall = compute_at(trains, step, compute, steps) + comm * min(frac, 1.0)
        curve.append((step, float(ev[ev.get("metric", "accuracy")]), wall))
    return ModelledRun(link, compute, comm, curve)
