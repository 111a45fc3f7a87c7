"""Run one config's workers under a hard deadline: in testbed namespaces or over loopback.

Each worker is ``python -m thinwire.worker RUN_DIR/config.toml`` with torchrun's environment
(RANK, WORLD_SIZE, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR, MASTER_PORT) and
GLOO_SOCKET_IFNAME set to its own interface, so gloo's traffic takes the shaped veth (or ``lo``).
In the testbed, worker r runs through ``ip netns exec tw-...-wR`` and rendezvous is on the first
namespace's address, 198.18.0.1. Output goes to ``RUN_DIR/worker{r}.log``.

Bounded in time: past the deadline every worker is killed (SIGTERM, then SIGKILL to its process
group) and :class:`BenchTimeout` is raised; if one worker fails, the others are killed and
:class:`BenchFailed` names the rank and its last output line. Workers are killed on every exit
path (success, error, Ctrl-C), before the namespaces are deleted.

``run_in_testbed`` reads the kernel's interface counters before the first worker starts and after
the last one exits and writes them to ``RUN_DIR/wire.json``: these are the *measured* bytes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from thinwire.rundir import create_exclusive
from thinwire.testbed.netns import Testbed
from thinwire.testbed.rates import Link

MASTER_PORT = 29500
KILL_GRACE_S = 3.0


class BenchFailed(RuntimeError):
    """A worker failed; the message names the rank and the cause."""


class BenchTimeout(BenchFailed):
    """The bench's wall-clock limit passed; every worker was killed."""


@dataclass(frozen=True)
class WireRun:
    """Measured traffic of one run: per worker-side interface, bytes sent and received."""

    link: Link
    workers: int
    elapsed_s: float
    tx_bytes: list[int]
    rx_bytes: list[int]


def worker_env(rank: int, workers: int, master_addr: str, master_port: int, ifname: str,
               threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(workers), "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "GLOO_SOCKET_IFNAME": ifname, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
    })
    return env


def worker_argv(run_dir: Path) -> list[str]:
    return [sys.executable, "-m", "thinwire.worker", str(run_dir / "config.toml")]


def _last_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    return lines[-1][:300] if lines else "no output"


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM every live worker's process group, then SIGKILL what is left after a grace."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        end = time.monotonic() + KILL_GRACE_S
        for p in live:
            try:
                p.wait(timeout=max(0.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for p in procs:
        if p.poll() is None:
            p.wait()


def run_processes(specs: list[tuple[list[str], dict[str, str]]], log_dir: Path,
                  deadline: float) -> float:
    """Start one process per (argv, env), wait for all; return the elapsed seconds.

    ``deadline`` is a ``time.monotonic()`` instant. Every process is killed on every exit path.
    """
    procs: list[subprocess.Popen[bytes]] = []
    logs = [log_dir / f"worker{r}.log" for r in range(len(specs))]
    t0 = time.monotonic()
    try:
        for r, ((argv, env), log) in enumerate(zip(specs, logs)):
            try:
                with open(create_exclusive(log), "wb") as f:
                    procs.append(subprocess.Popen(argv, env=env, stdout=f,
                                                  stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL,
                                                  start_new_session=True))
            except OSError as exc:  # not executable, missing, no processes left, no log
                raise BenchFailed(f"worker rank {r} could not be started ({exc.strerror or exc}: "
                                  f"{exc.filename or argv[0]}); check that it exists and is "
                                  "executable and that the run directory is writable") from None
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                r, c = failed[0]
                raise BenchFailed(f"worker rank {r} failed (exit code {c}): {_last_line(logs[r])} "
                                  f"(log: {logs[r]})")
            if all(c == 0 for c in codes):
                return time.monotonic() - t0
            if time.monotonic() > deadline:
                raise BenchTimeout(f"wall-clock limit reached after {time.monotonic() - t0:.0f} s "
                                   "in this run; all workers killed")
            time.sleep(0.1)
    finally:
        kill_all(procs)


def run_in_testbed(run_dir: Path, workers: int, link: Link, threads: int,
                   deadline: float) -> WireRun:
    """The prepared run directory's config on ``workers`` namespaces joined by ``link``."""
    with Testbed(workers, link) as tb:
        specs = [(tb.exec_argv(r, worker_argv(run_dir)),
                  worker_env(r, workers, tb.addr(0), MASTER_PORT, tb.ifname(r), threads))
                 for r in range(workers)]
        before = tb.counters()
        elapsed = run_processes(specs, run_dir, deadline)
        after = tb.counters()
    wire = WireRun(link, workers, elapsed, [a[0] - b[0] for a, b in zip(after, before)],
                   [a[1] - b[1] for a, b in zip(after, before)])
    (run_dir / "wire.json").write_text(json.dumps({"mode": "measured", **asdict(wire),
                                                   "link_label": link.label}, indent=1))
    return wire


def run_on_loopback(run_dir: Path, workers: int, threads: int, deadline: float) -> float:
    """The prepared run directory's config on ``workers`` local processes over ``lo``.

    1. This process binds and serves the rendezvous store on a loopback port the kernel picks
       (:func:`thinwire.launch.loopback_store`: bound before its number is known, so no other
       process can take it between choosing and binding);
    2. the workers reach it as clients (``TORCHELASTIC_USE_AGENT_STORE``: torch's ``env://``
       rendezvous then starts no store of its own on any rank);
    3. the store is closed when the last worker has exited."""
    from thinwire.launch import loopback_store

    store, port = loopback_store()
    try:
        specs = [(worker_argv(run_dir),
                  {**worker_env(r, workers, "127.0.0.1", port, "lo", threads),
                   "TORCHELASTIC_USE_AGENT_STORE": "True"})
                 for r in range(workers)]
        return run_processes(specs, run_dir, deadline)
    finally:
        del store
