"""Pure unit tests of the testbed: link parsing, shaping commands, modelled arithmetic, tables."""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

import pytest

from thinwire.cli import main as cli_main
from thinwire.errors import UsageError
from thinwire.report.tables import Run
from thinwire.testbed.bench import interrupts_raise
from thinwire.testbed.measure import RankLedger, compare
from thinwire.testbed.modelled import (
    FRAME_EFFICIENCY,
    comm_seconds,
    compute_at,
    hops,
    model_run,
    op_seconds,
)
from thinwire.testbed.netns import shaping_commands
from thinwire.testbed.rates import Link, parse_delay, parse_links, parse_rate
from thinwire.testbed.report import BenchResult, bench_table, common_target


@pytest.mark.parametrize("text,bps", [("100mbit", 1e8), ("1gbit", 1e9), ("1Gbit/s", 1e9),
                                      ("2.5mbit", 2.5e6), ("64kbit", 64e3), ("800kbit", 8e5),
                                      ("unlimited", None), ("UNLIMITED", None)])
def test_parse_rate(text: str, bps: float | None) -> None:
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["", "100", "100mbps", "100MB", "fast", "-5mbit", "mbit",
                                  "1kbit", "1000gbit", "1e3mbit"])
def test_parse_rate_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="rate"):
        parse_rate(text)


@pytest.mark.parametrize("text,s", [("5ms", 0.005), ("0", 0.0), ("0ms", 0.0), ("200us", 2e-4),
                                    ("1s", 1.0), ("1.5ms", 0.0015)])
def test_parse_delay(text: str, s: float) -> None:
    assert parse_delay(text) == pytest.approx(s)


@pytest.mark.parametrize("text", ["5", "5 sec", "11s", "-1ms", "fast"])
def test_parse_delay_rejects(text: str) -> None:
    with pytest.raises(UsageError, match="delay"):
        parse_delay(text)


def test_parse_links_and_labels() -> None:
    links = parse_links("100mbit, 1gbit,unlimited", "5ms")
    assert [lk.rate_bps for lk in links] == [1e8, 1e9, None]
    assert [lk.label for lk in links] == ["100mbit+5ms", "1gbit+5ms", "unlimited+5ms"]
    assert Link(1e8).label == "100mbit" and Link(1e8).bytes_per_s == 1.25e7
    with pytest.raises(UsageError):
        parse_links("100mbit,100mbit")
    with pytest.raises(UsageError):
        parse_links(" , ")


def test_bad_link_is_a_one_line_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["bench", "--link", "100mbps"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "link rate '100mbps'" in err[0]
    assert cli_main(["bench", "--timeout", "0"]) == 2


def test_sigterm_raises_keyboard_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt), interrupts_raise():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler interrupts this at once
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored


def test_sigint_raises_keyboard_interrupt_even_where_it_arrived_ignored() -> None:
    """A bench started in the background inherits SIGINT ignored (the shell's rule for
    background jobs; Python then installs no handler): the bench's own handler still stops it,
    and the ignored disposition is back afterwards."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with pytest.raises(KeyboardInterrupt), interrupts_raise():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler interrupts this at once
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # restored
    finally:
        signal.signal(signal.SIGINT, before)


def test_shaping_commands() -> None:
    (tbf,) = shaping_commands("tw-w0", Link(1e8))
    assert tbf[:6] == ["tc", "qdisc", "add", "dev", "tw-w0", "root"] and "tbf" in tbf
    opts = dict(zip(tbf[7::2], tbf[8::2]))
    assert opts["rate"] == "100000000bit" and opts["overhead"] == "24"
    burst, limit = int(opts["burst"]), int(opts["limit"])
    assert burst >= 1.25e7 * 0.004 and burst >= 64 * 1024 // 2  # >= one 4 ms tick, >= a GSO burst
    assert limit >= burst + 1.25e7 * 0.05 - 1  # 50 ms of queue
    assert shaping_commands("x", Link(None)) == []
    delayed = shaping_commands("x", Link(1e8, 0.005))
    assert [c[2] for c in delayed] == ["add"] * 3
    assert "htb" in delayed[0] and "netem" in delayed[2] and "5000us" in delayed[2]
    assert "netem" in shaping_commands("x", Link(None, 0.001))[0]


def test_hops_and_op_seconds() -> None:
    assert [hops("all_reduce", 4), hops("all_gather", 4), hops("broadcast", 4)] == [6, 3, 3]
    assert hops("send", 4) == 1 and hops("all_reduce", 1) == 0
    link = Link(8e6, 0.001)  # 1e6 bytes/s, 1 ms each way per link
    # 10 ring all-reduces on 4 ranks: 10 x 6 hops x 2 links x 1 ms + 6e6 bytes at 1e6 B/s
    assert op_seconds("all_reduce", 10, 6_000_000, 6_000_000, link, 4, 1.0) == pytest.approx(6.12)
    # full duplex: the larger direction counts; default efficiency charges the frame headers
    assert op_seconds("send", 3, 2_000_000, 0, link, 4) == pytest.approx(
        0.006 + 2.0 / FRAME_EFFICIENCY)
    assert op_seconds("all_reduce", 10, 6_000_000, 6_000_000, Link(None, 0.001), 4) == \
        pytest.approx(0.12)
    by_op = {"all_reduce:grad": {"calls": 10, "payload": 0, "sent": 6_000_000, "recv": 6_000_000},
             "send:subnet": {"calls": 2, "payload": 0, "sent": 1_000_000, "recv": 0},
             "recv:subnet": {"calls": 2, "payload": 0, "sent": 0, "recv": 500_000}}
    assert comm_seconds(by_op, link, 4, 1.0) == pytest.approx(6.12 + 1.004 + 0.504)


def test_compute_at_interpolates() -> None:
    trains = [{"step": 10, "compute_s": 2.0}, {"step": 20, "compute_s": 6.0}]
    assert compute_at(trains, 10, 9.0, 30) == 2.0
    assert compute_at(trains, 15, 9.0, 30) == pytest.approx(4.0)
    assert compute_at(trains, 5, 9.0, 30) == pytest.approx(1.0)
    assert compute_at(trains, 30, 9.0, 30) == 9.0


def _fake_run(label: str, sent_final: float) -> tuple[dict, list[dict]]:
    summary = {"workers": 2, "steps": 20, "compute_s": 4.0, "label": label, "wall_s": 5.0,
               "bytes": {"sent_per_worker_max": sent_final, "per_rank_sent": [sent_final] * 2,
                         "payload_per_worker_mean": sent_final}}
    records = [{"kind": "train", "step": 10, "compute_s": 1.0},
               {"kind": "eval", "step": 10, "accuracy": 0.5, "sent_bytes_max": sent_final / 4,
                "sent_bytes": sent_final / 4},
               {"kind": "train", "step": 20, "compute_s": 4.0},
               {"kind": "eval", "step": 20, "accuracy": 0.8, "sent_bytes_max": sent_final,
                "sent_bytes": sent_final}]
    return summary, records


def test_model_run_arithmetic() -> None:
    summary, records = _fake_run("dp", 2e6)
    op = {"all_reduce:grad": {"calls": 20, "payload": 0, "sent": 2_000_000, "recv": 2_000_000}}
    slow = {"all_reduce:grad": {"calls": 20, "payload": 0, "sent": 3_000_000, "recv": 1_000}}
    ledgers = [RankLedger(0, 0, 0, 20, op), RankLedger(0, 0, 0, 20, slow)]
    link = Link(8e6, 0.0)
    m = model_run(summary, records, ledgers, link)
    comm = 3e6 / (1e6 * FRAME_EFFICIENCY)  # the slower rank sets the pace
    assert m.comm_s == pytest.approx(comm) and m.wall_s == pytest.approx(4.0 + comm)
    assert [(s, a) for s, a, _ in m.curve] == [(10, 0.5), (20, 0.8)]
    assert m.curve[0][2] == pytest.approx(1.0 + comm / 4)  # a quarter of the bytes by step 10
    assert m.curve[1][2] == pytest.approx(4.0 + comm)
    assert model_run(summary, records, ledgers, Link(None)).wall_s == pytest.approx(4.0)


def test_modelled_table_is_labelled_and_ratios_are_right() -> None:
    results = []
    for label, comm in (("dp", 8.0), ("ist", 2.0)):
        summary, records = _fake_run(label, 1e6)
        run = Run(Path(label), summary, records)
        curve = [(10, 0.5, 1.0 + comm / 2), (20, 0.8, 4.0 + comm)]
        results.append(BenchResult(Link(1e8), run, "modelled", curve, 4.0 + comm))
    assert common_target(results) == 0.8
    table = bench_table(results, 0.8)
    assert "modelled" in table.splitlines()[0] and "(measured)" not in table
    ist_row = next(line for line in table.splitlines() if "| ist |" in line)
    assert "| 6.0 | 2.00x |" in ist_row  # dp 12 s / ist 6 s to 0.8


def test_wire_comparison() -> None:
    ledgers = [RankLedger(1000, 900, 800, 3, {}), RankLedger(3000, 100, 800, 3, {})]
    c = compare([1100, 3100], [1000, 200], ledgers)
    assert c.measured_total == 4200 and c.estimated_total == 4000
    assert c.ratio == pytest.approx(1.05) and c.within(0.10) and not c.within(0.01)
    assert c.control_sent is None and c.compared_total == 4000  # files without control totals
    assert math.isnan(compare([5], [5], [RankLedger(0, 0, 0, 0, {})]).ratio)
    with_control = [RankLedger(1000, 900, 800, 3, {}, 200), RankLedger(3000, 100, 800, 3, {}, 0)]
    c = compare([1100, 3100], [1000, 200], with_control)
    assert c.compared_total == 4200 and c.ratio == pytest.approx(1.0)
    assert compare([1], [1], [with_control[0], ledgers[1]]).control_sent is None  # partial
