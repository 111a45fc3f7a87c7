"""The bench loop: every method on every link, measured on the testbed or modelled.

Measured: before the first run, leftovers of killed runs are removed
(:func:`~thinwire.testbed.netns.cleanup_stale`); each run gets fresh namespaces, so counters
start from zero traffic and nothing carries over between methods. Modelled: each method runs once
over loopback and is modelled on every link (:mod:`thinwire.testbed.modelled`).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

from thinwire.config import Config
from thinwire.report.tables import fmt_bytes, load_run
from thinwire.run import run_directory
from thinwire.testbed.measure import compare, read_ledgers
from thinwire.testbed.modelled import model_run
from thinwire.testbed.netns import cleanup_stale
from thinwire.testbed.rates import Link
from thinwire.testbed.report import BenchResult
from thinwire.testbed.run import run_in_testbed, run_on_loopback


def iter_measured(cfgs: dict[str, list[Config]], links: list[Link],
                  deadline: float) -> Iterator[BenchResult]:
    """Each config of ``cfgs[link.label]`` on a fresh testbed with ``link``, one result a run."""
    stale = cleanup_stale()
    if stale:
        print(f"removed leftovers of killed runs: {', '.join(stale)}", flush=True)
    for link in links:
        for cfg in cfgs[link.label]:
            n = cfg.runtime.workers
            print(f"== {link.label} {cfg.run_name}: {n} workers in namespaces, "
                  f"{cfg.train.steps} steps", flush=True)
            with run_directory(cfg) as rd:
                wire = run_in_testbed(rd.path, n, link, cfg.runtime.threads, deadline)
            run_dir = rd.final
            cmp = compare(wire.tx_bytes, wire.rx_bytes, read_ledgers(run_dir, n))
            run = load_run(run_dir)
            curve = [(int(r["step"]), float(r[run.metric]), float(r["wall_s"])) for r in run.evals]
            print(f"   done in {wire.elapsed_s:.0f} s; wire tx {fmt_bytes(cmp.measured_total)} "
                  f"measured vs {fmt_bytes(cmp.compared_total)} estimated "
                  f"({(cmp.ratio - 1) * 100:+.1f}%)", flush=True)
            yield BenchResult(link, run, "measured", curve, float(run.summary["wall_s"]), cmp)


def iter_modelled(cfgs: list[Config], links: list[Link], deadline: float) -> Iterator[BenchResult]:
    """Each config once over loopback, then modelled on every link (results after all runs)."""
    loaded = []
    for cfg in cfgs:
        n = cfg.runtime.workers
        print(f"== {cfg.run_name}: {n} workers over loopback (for the model), "
              f"{cfg.train.steps} steps", flush=True)
        with run_directory(cfg) as rd:
            elapsed = run_on_loopback(rd.path, n, cfg.runtime.threads, deadline)
        run_dir = rd.final
        print(f"   done in {elapsed:.0f} s", flush=True)
        loaded.append((load_run(run_dir), read_ledgers(run_dir, n)))
    for link in links:
        for run, ledgers in loaded:
            m = model_run(run.summary, run.records, ledgers, link)
            yield BenchResult(link, run, "modelled", m.curve, m.wall_s)


def _raise_interrupt(signum: int, _frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise KeyboardInterrupt, so every finally tears down; SIGINT's
    handler is set here too, as the launcher's is, so a bench started in the background (where
    the shell leaves SIGINT ignored, and Python then keeps it so) still stops on it."""
    old = {s: signal.signal(s, _raise_interrupt)
           for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def run_all(cfgs: dict[str, list[Config]], links: list[Link], deadline: float, *,
            modelled: bool) -> tuple[list[BenchResult], str]:
    """Every run, measured (one group per link) or modelled (group ``"modelled"``), with SIGTERM
    and SIGHUP raising like Ctrl-C so every namespace is torn down. Returns the finished
    results and, when a run failed or time ran out, why the bench stopped early ("" if not)."""
    from thinwire.testbed.run import BenchFailed

    results: list[BenchResult] = []
    with interrupts_raise():
        try:
            for res in (iter_modelled(cfgs["modelled"], links, deadline) if modelled
                        else iter_measured(cfgs, links, deadline)):
                results.append(res)
        except BenchFailed as exc:
            return results, str(exc)
    return results, ""
