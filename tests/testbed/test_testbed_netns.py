"""Namespace tests: the rate limit holds, measured bytes match the ledger, nothing is left behind.

Skipped, with the reason, only where namespaces cannot be created (not root, no iproute2).
Every load is small and bounded: ~1 MB at 4 Mbit/s, ~10 s per test at most.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from harness import wait_until

from thinwire import config as config_mod
from thinwire.run import run_directory
from thinwire.testbed.measure import compare, read_ledgers
from thinwire.testbed.netns import Testbed, cleanup_stale, list_namespaces, sh, unavailable_reason
from thinwire.testbed.rates import Link
from thinwire.testbed.run import (
    BenchFailed,
    BenchTimeout,
    run_in_testbed,
    run_processes,
    worker_env,
)

REASON = unavailable_reason()
if REASON:
    pytest.skip(f"network namespaces unavailable: {REASON}", allow_module_level=True)

pytestmark = pytest.mark.netns
RATE = 4e6  # bit/s
BURST = 32 * 1024  # the shaper's burst at this rate (see shaping_commands)
MINE = f"tw-{os.getpid()}-"

SERVER = textwrap.dedent("""
    import socket, sys
    n = int(sys.argv[2]); s = socket.socket(); s.settimeout(20)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 29555))
    s.listen(1); c, _ = s.accept(); got = 0
    while got < n:
        b = c.recv(1 << 16)
        if not b: break
        got += len(b)
    c.sendall(b"k"); print(got)
""")
CLIENT = textwrap.dedent("""
    import socket, sys, time
    addr, n = sys.argv[1], int(sys.argv[2])
    for _ in range(100):
        try: c = socket.create_connection((addr, 29555), timeout=20); break
        except OSError: time.sleep(0.05)
    t0 = time.perf_counter(); c.sendall(b"x" * n); c.recv(1)
    print(time.perf_counter() - t0)
""")


def leftovers() -> tuple[list[str], list[str]]:
    """Our namespaces still listed, and any tw- interface in the host's namespace."""
    host = [ln for ln in sh(["ip", "-o", "link", "show"]).splitlines() if ": tw-" in ln]
    return [ns for ns in list_namespaces() if ns.startswith(MINE)], host


def test_rate_limit_slows_a_known_transfer() -> None:
    n = 1_000_000
    with Testbed(2, Link(RATE)) as tb:
        before = tb.counters()
        server = subprocess.Popen(tb.exec_argv(1, [sys.executable, "-c", SERVER, tb.addr(1),
                                                   str(n)]), stdout=subprocess.PIPE, text=True)
        client = subprocess.run(tb.exec_argv(0, [sys.executable, "-c", CLIENT, tb.addr(1),
                                                 str(n)]), capture_output=True, text=True,
                                timeout=30, check=True)
        assert int(server.communicate(timeout=30)[0]) == n
        after = tb.counters()
    seconds = float(client.stdout)
    floor = (n - BURST) / (RATE / 8)  # the wire cannot carry more than rate x time + burst
    assert seconds >= floor, f"{n} bytes in {seconds:.2f} s: faster than {RATE:g} bit/s"
    assert seconds <= 2.0 * n / (RATE / 8) + 1.0, f"{seconds:.2f} s: the rate was not reached"
    tx0 = after[0][0] - before[0][0]
    rx1 = after[1][1] - before[1][1]
    assert n <= tx0 <= 1.10 * n and n <= rx1 <= 1.10 * n  # payload plus headers
    assert leftovers() == ([], [])


def test_training_bytes_match_the_ledger(tmp_path: Path) -> None:
    cfg = config_mod.load(None, {
        "data.name": "teacher", "model.hidden": "64,64", "method.name": "localsgd",
        "method.period": 1, "train.steps": 40, "train.eval_every": 20, "runtime.workers": 2,
        "runtime.threads": 1, "run.out": str(tmp_path), "run.progress": False})
    with run_directory(cfg) as rd:
        wire = run_in_testbed(rd.path, 2, Link(RATE), 1, time.monotonic() + 60)
    run_dir = rd.final
    ledgers = read_ledgers(run_dir, 2)
    cmp = compare(wire.tx_bytes, wire.rx_bytes, ledgers)
    assert cmp.estimated_total > 1_500_000  # the training traffic dominates the fixed set-up
    assert cmp.within(0.10), f"measured / estimated = {cmp.ratio:.3f}"
    assert cmp.ratio >= 1.0  # headers and set-up traffic only ever add bytes
    for r in range(2):
        assert abs(wire.rx_bytes[r] / ledgers[r].recv - 1) <= 0.10
    train_s = float(json.loads((run_dir / "summary.json").read_text())["wall_s"])
    floor = (ledgers[0].sent - BURST) / (RATE / 8)
    assert train_s >= floor, f"rank 0 sent {ledgers[0].sent} B in {train_s:.2f} s: too fast"
    assert leftovers() == ([], [])


def test_timeout_kills_workers_and_errors_tear_down(tmp_path: Path) -> None:
    with pytest.raises(BenchTimeout), Testbed(1, Link(RATE)) as tb:
        ns = tb.namespace(0)
        try:  # the sleeper outlives the 1 s deadline: BenchTimeout, and it is killed
            run_processes([(tb.exec_argv(0, ["sleep", "600"]),
                            worker_env(0, 1, tb.addr(0), 29500, tb.ifname(0), 1))],
                          tmp_path, time.monotonic() + 1.0)
        finally:
            assert sh(["ip", "netns", "pids", ns]).split() == []  # the sleeper is gone
    assert leftovers() == ([], [])


def test_a_failing_worker_names_its_rank_and_tears_everything_down(tmp_path: Path) -> None:
    """Guards the testbed's teardown when a worker raises: the other worker is killed, the
    namespaces, veths and bridge are gone, and the error names the failing rank."""
    with pytest.raises(BenchFailed, match="worker rank 1 failed .exit code 3"), \
            Testbed(2, Link(RATE)) as tb:
        names = [tb.namespace(0), tb.namespace(1)]
        specs = [(tb.exec_argv(0, ["sleep", "60"]),
                  worker_env(0, 2, tb.addr(0), 29500, tb.ifname(0), 1)),
                 (tb.exec_argv(1, ["sh", "-c", "sleep 0.5; echo boom; exit 3"]),
                  worker_env(1, 2, tb.addr(0), 29500, tb.ifname(1), 1))]
        run_processes(specs, tmp_path, time.monotonic() + 30)
    assert leftovers() == ([], [])
    assert not set(names) & set(list_namespaces())


def test_stale_namespaces_of_dead_owners_are_removed() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = f"tw-{dead.pid}-0-w0"
    sh(["ip", "netns", "add", stale])
    live = f"{MINE}99-w0"  # owner alive (this process): must be kept
    sh(["ip", "netns", "add", live])
    try:
        removed = cleanup_stale()
        assert stale in removed and live not in removed
        names = list_namespaces()
        assert stale not in names and live in names
    finally:
        sh(["ip", "netns", "del", live], check=False)
        sh(["ip", "netns", "del", stale], check=False)


def test_ctrl_c_tears_down(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT) while workers run: exit 130, no namespace left. SIGTERM and SIGHUP take
    the same path (they raise KeyboardInterrupt, see test_sigterm_raises_keyboard_interrupt)."""
    args = ["bench", "--link", "4mbit", "--workers", "2", "--methods", "localsgd", "--steps",
            "100000", "--data.name", "teacher", "--model.hidden", "8,8", "--train.eval_every",
            "0", "--timeout", "60", "--out", str(tmp_path)]
    # the CLI as `python -m thinwire`, with its threads' stacks written on SIGUSR1: a teardown
    # that does not end in time is reported with where it stood (run in the background, where
    # SIGINT arrives ignored, the bench once never saw the signal)
    boot = ("import faulthandler, runpy, signal, sys; "
            "faulthandler.register(signal.SIGUSR1, all_threads=True); "
            f"sys.argv = ['thinwire', *{args!r}]; runpy.run_module('thinwire', "
            "run_name='__main__', alter_sys=True)")
    proc = subprocess.Popen([sys.executable, "-c", boot], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    prefix = f"tw-{proc.pid}-"
    try:
        def workers_running() -> bool:  # both worker namespaces built and a process in each
            assert proc.poll() is None, "bench ended before its workers ran"
            spaces = [ns for ns in list_namespaces()
                      if ns.startswith(prefix) and ns.endswith(("-w0", "-w1"))]
            return len(spaces) == 2 and all(
                sh(["ip", "netns", "pids", ns], check=False).split() for ns in spaces)

        wait_until(workers_running, 90, "bench's workers running in their namespaces")
        proc.send_signal(signal.SIGINT)
        try:
            out = proc.communicate(timeout=20)[0]
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(2)
            proc.kill()
            pytest.fail(f"bench still running 20 s after SIGINT; its output and stacks:\n"
                        f"{proc.communicate()[0]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out
    assert not [ns for ns in list_namespaces() if ns.startswith(prefix)]


def test_thin_links_rerun_each_method_until_its_loopback_target_step(tmp_path: Path) -> None:
    """compare's measured thin links: the config reruns on the testbed for the steps its loopback
    run needed (here a recorded run that reached 0.6 at step 20 of 40), labelled measured."""
    from planner.conv_runs import write_run

    from thinwire.report.tables import load_run
    from thinwire.testbed import thin_links

    cfg = config_mod.load(None, {
        "data.name": "teacher", "model.hidden": "32", "method.name": "localsgd",
        "method.period": 1, "train.steps": 40, "train.eval_every": 20, "runtime.workers": 2,
        "runtime.threads": 1, "run.out": str(tmp_path / "loop"), "run.progress": False})
    loop = write_run(tmp_path / "loop" / "localsgd", {"name": "localsgd"}, [(20, 0.6), (40, 0.7)],
                     workers=2)
    run = load_run(loop)
    results, stopped = thin_links.measured([cfg], [run], 0.6, [Link(RATE)], tmp_path / "tl",
                                           time.monotonic() + 60)
    assert stopped == ""
    (res,) = results
    assert res.kind == "measured" and res.link == Link(RATE)
    assert res.run.path == tmp_path / "tl" / "4mbit" / "localsgd"
    assert [s for s, _, _ in res.curve][-1] == 20 and int(res.run.summary["steps"]) == 20
    assert (res.run.path / "wire.json").is_file()
    assert leftovers() == ([], [])
