"""A run's ``summary.json``, built from named per-rank totals instead of positional rows.

Steps (the trainer, at the end of a run): 1. each rank measures its :class:`RankTotals` (bytes
from its ledger, memory from its strategy and process); 2. the rows are gathered to every rank
as floats (:meth:`RankTotals.floats` / :meth:`RankTotals.of`, one field per position, so the
order is the dataclass's and nowhere else); 3. :class:`RunSummary` reduces them (mean, max,
per rank) into the sections ``bytes`` and ``memory``; 4. :meth:`RunSummary.to_json` is the dict
written to ``summary.json`` (the keys that ``thinwire report``, ``thinwire bench`` and the
planner's validation read).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class RankTotals:
    """What one rank reports at the end of a run (bytes and memory are in bytes)."""

    sent: float
    payload: float
    recv: float
    params: float
    grads: float
    optimizer: float
    param_count: float
    stored_count: float
    activations: float
    gathered: float
    host: float
    peak: float
    rss_peak: float
    device_peak: float
    holds_model: float  # 1.0 on the rank that exported the final model

    def floats(self) -> list[float]:
        """The row in field order, for :meth:`thinwire.runtime.comm.Comm.gather_floats`."""
        return [float(getattr(self, f.name)) for f in fields(self)]

    @classmethod
    def of(cls, row: Sequence[float]) -> RankTotals:
        """The inverse of :meth:`floats`."""
        names = [f.name for f in fields(cls)]
        if len(row) != len(names):
            raise ValueError(f"a rank's totals have {len(names)} fields, got {len(row)}")
        return cls(**dict(zip(names, (float(v) for v in row), strict=True)))


@dataclass(frozen=True)
class ByteTotals:
    """The ``bytes`` section: per-worker traffic over the run."""

    sent_per_worker_mean: float
    sent_per_worker_max: float
    payload_per_worker_mean: float
    recv_per_worker_max: float
    per_rank_sent: list[float]
    collectives_estimated: bool

    @classmethod
    def of(cls, ranks: Sequence[RankTotals], estimated: bool) -> ByteTotals:
        n = len(ranks)
        return cls(sent_per_worker_mean=sum(r.sent for r in ranks) / n,
                   sent_per_worker_max=max(r.sent for r in ranks),
                   payload_per_worker_mean=sum(r.payload for r in ranks) / n,
                   recv_per_worker_max=max(r.recv for r in ranks),
                   per_rank_sent=[r.sent for r in ranks], collectives_estimated=estimated)


@dataclass(frozen=True)
class MemoryTotals:
    """The ``memory`` section: the largest worker's bytes of each kind."""

    params_bytes_max: float
    grads_bytes_max: float
    optimizer_bytes_max: float
    params_held_max: int
    params_stored_max: int
    params_full: int
    activations_bytes_max: float
    gathered_bytes_max: float
    host_bytes_max: float
    peak_bytes_max: float
    per_rank_peak: list[float]
    rss_peak_bytes_max: float
    device_peak_bytes_max: float
    options: dict[str, Any]

    @classmethod
    def of(cls, ranks: Sequence[RankTotals], params_full: int,
           options: dict[str, Any]) -> MemoryTotals:
        return cls(params_bytes_max=max(r.params for r in ranks),
                   grads_bytes_max=max(r.grads for r in ranks),
                   optimizer_bytes_max=max(r.optimizer for r in ranks),
                   params_held_max=int(max(r.param_count for r in ranks)),
                   params_stored_max=int(max(r.stored_count for r in ranks)),
                   params_full=params_full,
                   activations_bytes_max=max(r.activations for r in ranks),
                   gathered_bytes_max=max(r.gathered for r in ranks),
                   host_bytes_max=max(r.host for r in ranks),
                   peak_bytes_max=max(r.peak for r in ranks),
                   per_rank_peak=[r.peak for r in ranks],
                   rss_peak_bytes_max=max(r.rss_peak for r in ranks),
                   device_peak_bytes_max=max(r.device_peak for r in ranks),
                   options=dict(options))


@dataclass(frozen=True)
class RunSummary:
    """Everything ``summary.json`` holds about a finished run."""

    method: str
    model: str
    data: str
    label: str
    run: str
    metric: str
    higher_is_better: bool
    workers: int
    steps: int
    final: dict[str, float]
    wall_s: float
    compute_s: float
    comm_s: float
    bytes: ByteTotals
    memory: MemoryTotals
    config: dict[str, Any]
    final_files: list[str] = field(default_factory=list)

    @staticmethod
    def files_of(ranks: Sequence[RankTotals]) -> list[str]:
        """What the final write holds besides ``summary.json``
        (:func:`thinwire.checkpoint.final_state_problem` checks them)."""
        return ((["model.pt"] if any(r.holds_model for r in ranks) else [])
                + [f"ledger.rank{r}.json" for r in range(len(ranks))])

    def to_json(self) -> dict[str, Any]:
        """The dict written to ``summary.json`` (sections as nested dicts)."""
        return asdict(self)
