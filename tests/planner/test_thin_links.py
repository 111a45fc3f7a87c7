"""The demo's thin-link table: time to target modelled from loopback runs, on hand-built runs
whose compute, bytes and crossing steps are known; the choice between measured (testbed) and
modelled figures, its labels, and the testbed runs' stopping rule."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from conv_runs import ramp, write_run

from thinwire import config as config_mod
from thinwire.commands import compare
from thinwire.report.tables import load_run
from thinwire.testbed import netns
from thinwire.testbed import thin_links as tl
from thinwire.testbed.modelled import FRAME_EFFICIENCY
from thinwire.testbed.thin_links import modelled_report as report

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
    # the other method's time over the fastest's, per link: 2 + 200/rate against 8 + 0.8/rate
    rate = 12.5e6 * FRAME_EFFICIENCY
    slow = (2 + 1e9 * 0.2 / rate) / (8 + 1e6 * 0.8 / rate)
    assert f"at 100mbit, time to the target over the fastest's: dp {slow:.1f}x" in text


NOT_ROOT = "not root: network namespaces and tc need CAP_NET_ADMIN (run as root)"


def test_source_is_measured_only_when_asked_and_available():
    assert tl.choose_source("auto", None) == ("measured", "")
    kind, why = tl.choose_source("auto", NOT_ROOT)
    assert kind == "modelled" and NOT_ROOT in why
    kind, why = tl.choose_source("auto", "'tc' not found: install iproute2")
    assert kind == "modelled" and "install iproute2" in why
    kind, why = tl.choose_source("modelled", None)  # available, but modelled was asked for
    assert kind == "modelled" and "--thin-links modelled" in why
    with pytest.raises(ValueError):
        tl.choose_source("measured", None)


def test_testbed_stops_where_the_loopback_run_reached_the_target(tmp_path):
    run = _run(tmp_path / "dp", "dp", {0.7: 30, 0.8: 50}, 10.0, 1e6)
    assert tl.testbed_steps(run, 0.8) == 50
    assert tl.testbed_steps(run, 0.7) == 30
    assert tl.testbed_steps(run, 0.9) == STEPS  # never reached: all its steps
    big = config_mod.load(None, {"train.steps": 100, "method.name": "ist",
                                 "method.local_steps": 20, "run.out": str(tmp_path)})
    (c,) = tl.testbed_configs([big], [run], 0.9, tl.parse_links("1gbit"), tmp_path / "t")["1gbit"]
    assert c.train.steps == 100  # never more than the loopback run's steps
    cfg = config_mod.load(None, {"train.steps": 600, "train.lr": 0.03, "run.out": str(tmp_path),
                                 "run.name": "dp", "method.name": "ist",
                                 "method.local_steps": 20})
    groups = tl.testbed_configs([cfg], [run], 0.8, tl.parse_links("100mbit,1gbit"),
                                tmp_path / "thin_links")
    assert list(groups) == ["100mbit", "1gbit"]
    for label, (c,) in groups.items():
        assert c.train.steps == 60  # 50, rounded up to whole periods of K = 20
        # threads 0 means cores / workers over loopback; alone in a namespace it must stay that
        assert c.runtime.threads == max(1, (os.cpu_count() or 1) // cfg.runtime.workers)
        assert c.run.out == str(tmp_path / "thin_links" / label) and c.run.name == "dp"
        assert (c.train.lr, c.method, c.model, c.data) == (cfg.train.lr, cfg.method, cfg.model,
                                                           cfg.data)


def _two_runs(tmp_path):
    return [_run(tmp_path / "dp", "dp", {0.8: 20}, 10.0, 1e9),
            _run(tmp_path / "ist", "ist", {0.8: 80}, 10.0, 1e6)]


def test_labels_follow_the_source(tmp_path):
    runs = _two_runs(tmp_path)
    links = tl.parse_links(tl.THIN_LINKS)
    mod = tl.modelled(runs, links)
    text, _ = tl.report(mod, 0.8, tmp_path / "m", "no thin-wire testbed here (" + NOT_ROOT + ")")
    assert "(modelled)" in text and "(measured)" not in text
    assert f"Modelled, not measured: no thin-wire testbed here ({NOT_ROOT})." in text
    meas = [dataclasses.replace(r, kind="measured") for r in mod]
    text, _ = tl.report(meas, 0.8, tmp_path / "t")
    assert "(measured)" in text and "odelled" not in text
    assert "Measured on the thin-wire testbed" in text


def _compare_thin_links(tmp_path, monkeypatch, unavailable, measured=None, requested="auto"):
    runs = _two_runs(tmp_path)
    calls = []
    monkeypatch.setattr(netns, "unavailable_reason", lambda: unavailable)

    def fake_measured(cfgs, runs_, target, links, out, deadline):
        calls.append((target, [lk.label for lk in links], out))
        return measured(runs_, links)

    monkeypatch.setattr(tl, "measured", fake_measured)
    report_dir = tmp_path / "out" / "report"
    report_dir.mkdir(parents=True)
    compare._thin_links([None, None], runs, None, report_dir, requested, 60.0)
    return (report_dir / "thin_links.md").read_text(), calls


def test_compare_models_without_the_testbed_and_says_why(tmp_path, monkeypatch, capsys):
    text, calls = _compare_thin_links(tmp_path, monkeypatch, NOT_ROOT)
    assert calls == []  # the testbed was not tried
    assert "(modelled)" in text and NOT_ROOT in text
    assert NOT_ROOT in capsys.readouterr().out
    assert (tmp_path / "out" / "report" / "accuracy_vs_time_thin_links.png").is_file()


def test_compare_measures_on_the_testbed_when_it_can(tmp_path, monkeypatch):
    def on_testbed(runs, links):  # the testbed's results, as thinwire.testbed.bench labels them
        return [dataclasses.replace(r, kind="measured") for r in tl.modelled(runs, links)], ""

    text, calls = _compare_thin_links(tmp_path, monkeypatch, None, on_testbed)
    assert calls == [(0.8, ["100mbit", "1gbit"], tmp_path / "out" / "thin_links")]
    assert "(measured)" in text and "odelled" not in text
    text, calls = _compare_thin_links(tmp_path / "m", monkeypatch, None, on_testbed,
                                      requested="modelled")
    assert calls == [] and "(modelled)" in text and "--thin-links modelled" in text


def test_compare_falls_back_when_the_testbed_stops(tmp_path, monkeypatch):
    def stopped(runs, links):
        return [], "wall-clock limit reached after 60 s in this run; all workers killed"

    text, calls = _compare_thin_links(tmp_path, monkeypatch, None, stopped)
    assert len(calls) == 1
    assert "(modelled)" in text
    assert "the testbed stopped early (wall-clock limit reached after 60 s" in text


def test_compare_names_where_a_method_wins_when_it_did_not_here(monkeypatch) -> None:
    """A method fastest on no link gets one line with its registry entry's regime; the winner
    and a method without a regime get none."""
    from types import SimpleNamespace

    from thinwire.commands.compare import _regimes
    from thinwire.strategies import METHODS

    links = [SimpleNamespace(label="100mbit"), SimpleNamespace(label="1gbit")]
    results = [SimpleNamespace(link=lk) for lk in links]
    monkeypatch.setattr(tl, "fastest", lambda rs, target: "localsgd(H=10)")
    cfgs = [SimpleNamespace(method=SimpleNamespace(name=n)) for n in ("dp", "localsgd", "ist")]
    runs = [SimpleNamespace(label=lb) for lb in ("dp", "localsgd(H=10)", "ist(K=auto)")]
    text = _regimes(cfgs, runs, results, links, 0.85)
    lines = [ln for ln in text.splitlines() if ln]
    assert lines == [f"ist(K=auto) is not the fastest here; it wins {METHODS.get('ist').regime}."]
    assert "benchmarks/thin_wire.py" in lines[0]
    monkeypatch.setattr(tl, "fastest", lambda rs, target: "ist(K=auto)")
    assert _regimes(cfgs, runs, results, links, 0.85) == ""
