"""The demo's thin-link table: time to target modelled from loopback runs, on hand-built runs
whose compute, bytes and crossing steps are known."""

from __future__ import annotations

import json

from conv_runs import ramp, write_run

from thinwire.report.tables import load_run
from thinwire.testbed.modelled import FRAME_EFFICIENCY
from thinwire.testbed.thin_links import report

STEPS = 100


def _run(path, method, reach, compute_s, sent_per_rank):
    """A 2-worker run: ``compute_s`` of compute spread evenly over its steps, ``sent_per_rank``
    bytes of all-reduce spread evenly too (evaluations carry the cumulative bytes)."""
    write_run(path, {"name": method}, ramp(reach, STEPS), workers=2)
    summary = json.loads((path / "summary.json").read_text())
    summary.update(compute_s=compute_s, steps=STEPS)
    summary["bytes"]["sent_per_worker_max"] = sent_per_rank
    (path / "summary.json").write_text(json.dumps(summary))
    lines = []
    for line in (path / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        frac = r["step"] / STEPS
        r["compute_s"] = compute_s * frac
        r["sent_bytes_max"] = sent_per_rank * frac
        lines.append(json.dumps(r))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    for rank in range(2):
        op = {"calls": STEPS, "sent": sent_per_rank, "recv": sent_per_rank}
        (path / f"ledger.rank{rank}.json").write_text(json.dumps({
            "by_op": {"all_reduce": op}, "totals": {"sent_bytes": sent_per_rank,
                                                    "recv_bytes": sent_per_rank,
                                                    "payload_bytes": sent_per_rank,
                                                    "calls": STEPS}}))
    return load_run(path)


def test_modelled_time_to_target_and_does_not_reach(tmp_path):
    dp = _run(tmp_path / "dp", "dp", {0.8: 50}, 10.0, 1.25e9)
    ist = _run(tmp_path / "ist", "ist", {0.7: 30}, 2.0, 1e6)
    text, plot = report([dp, ist], 0.8, tmp_path / "report")
    assert plot.is_file()
    rate = 12.5e6 * FRAME_EFFICIENCY  # 100 Mbit/s of TCP payload
    at_100 = 5.0 + 0.5 * 1.25e9 / rate
    at_1g = 5.0 + 0.5 * 1.25e9 / (10 * rate)
    row = next(ln for ln in text.splitlines() if ln.startswith("| dp "))
    assert row == f"| dp | {at_100:.1f} | 50 | {at_1g:.1f} | 50 |"
    assert "| ist | does not reach | - | does not reach | - |" in text
    assert "fastest to the target: 100mbit dp; 1gbit dp" in text
    assert "modelled" in text.lower()


def test_the_fastest_changes_with_the_link(tmp_path):
    """dp reaches at step 20 with many bytes, ist at step 80 with few: ist is first on the thin
    link, dp on the fat one (the crossing is known from the numbers)."""
    dp = _run(tmp_path / "dp", "dp", {0.8: 20}, 10.0, 1e9)   # to target: 2 s + 0.2 GB / rate
    ist = _run(tmp_path / "ist", "ist", {0.8: 80}, 10.0, 1e6)  # 8 s + 0.8 MB / rate
    text, _ = report([dp, ist], 0.8, tmp_path / "r", links="100mbit,10gbit")
    assert "fastest to the target: 100mbit ist; 10gbit dp" in text
    assert "every link" not in text
