"""The run summary's named per-rank totals: the gathered row's order is the dataclass's."""

from __future__ import annotations

from dataclasses import fields

import pytest

from thinwire.summary import ByteTotals, MemoryTotals, RankTotals, RunSummary


def _rank(i: int) -> RankTotals:
    # every field a distinct value, so a field read from the wrong position shows
    return RankTotals(*[float(100 * i + k) for k in range(len(fields(RankTotals)))])


def test_row_round_trip_and_length() -> None:
    r = _rank(3)
    assert RankTotals.of(r.floats()) == r
    with pytest.raises(ValueError, match="15 fields, got 14"):
        RankTotals.of(r.floats()[:-1])


def test_sections_reduce_by_name() -> None:
    ranks = [_rank(0), _rank(1), _rank(2)]
    b = ByteTotals.of(ranks, estimated=False)
    assert b.sent_per_worker_mean == 100.0 and b.sent_per_worker_max == 200.0
    assert b.payload_per_worker_mean == 101.0 and b.recv_per_worker_max == 202.0
    assert b.per_rank_sent == [0.0, 100.0, 200.0]
    m = MemoryTotals.of(ranks, params_full=7, options={"zero": 0})
    assert (m.params_bytes_max, m.optimizer_bytes_max, m.params_held_max) == (203.0, 205.0, 206)
    assert m.params_stored_max == 207 and m.device_peak_bytes_max == 213.0
    assert m.per_rank_peak == [11.0, 111.0, 211.0] and m.rss_peak_bytes_max == 212.0
    # every _rank has a non-zero holds_model (its last field): clear it to hold none
    none = [RankTotals.of([*r.floats()[:-1], 0.0]) for r in ranks]
    assert RunSummary.files_of(none) == [f"ledger.rank{i}.json" for i in range(3)]
    assert RunSummary.files_of(ranks)[0] == "model.pt"


def test_to_json_has_the_keys_readers_use() -> None:
    ranks = [_rank(0), _rank(1)]
    s = RunSummary(method="dp", model="mlp", data="digits", label="dp", run="r", metric="acc",
                   higher_is_better=True, workers=2, steps=3, final={"acc": 0.5}, wall_s=1.0,
                   compute_s=0.5, comm_s=0.25, bytes=ByteTotals.of(ranks, True),
                   memory=MemoryTotals.of(ranks, 9, {}), config={"a": 1},
                   final_files=RunSummary.files_of(ranks)).to_json()
    assert s["bytes"]["sent_per_worker_max"] == 100.0 and s["bytes"]["collectives_estimated"]
    assert s["memory"]["params_full"] == 9 and s["final"] == {"acc": 0.5}
    assert list(s)[:4] == ["method", "model", "data", "label"]
