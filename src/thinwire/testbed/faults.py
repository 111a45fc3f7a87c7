"""Fault-tolerant jobs on the testbed: a worker SIGKILLed at a chosen step, a worker rejoining.

Two kinds of recovery run under the same planned faults, each on fresh namespaces
(:class:`~thinwire.testbed.netns.Testbed`, torn down on every exit path, bounded by the
deadline):

- **quorum, no restart** (``runtime.fault_tolerance torchft``, :mod:`thinwire.ft_trainer`),
  :func:`run_quorum_in_testbed`:

  1. torchft's lighthouse runs in the bridge's namespace, bound on the bridge's own address
     :data:`HUB` (198.18.0.254), which every worker reaches over its shaped veth (never a
     host's 127.0.0.1 across namespaces) -- :mod:`thinwire.testbed.lighthouse`;
  2. each worker is its own replica group in its own namespace: ``THINWIRE_FT_HOST`` is its
     veth address (torchft's manager server, its store and gloo listen there),
     ``GLOO_SOCKET_IFNAME`` its veth, its output in ``RUN_DIR/workerI/output.log``
     (``output.join1.log`` for a rejoined one);
  3. the faults fire from outside, as a machine's loss would: the bench reads the job's
     progress (the highest step in the workers' ``metrics.jsonl``: log every step for a
     precise trigger) and sends SIGKILL to the worker's process once the progress reaches
     the fault's step; a ``join`` starts a worker under that index again (it recovers the
     live state from a peer, ledgered under the ``recovery`` tag);
  4. the job ends when every worker still running has finished (code 0); a worker that ends
     otherwise and was not killed by the plan fails the run (:class:`BenchFailed`).

- **restart** (``runtime.max_restarts`` with ``run.checkpoint_every``),
  :func:`run_restart_in_testbed`: the testbed's torchrun-style workers
  (:mod:`thinwire.testbed.run`); when one dies, the bench does what torch's elastic agent
  does: it stops the others and starts every worker again (``TORCHELASTIC_RESTART_COUNT``
  counts the attempt; each resumes from the newest complete checkpoint; a fresh rendezvous
  port per attempt), at most ``max_restarts`` times. Progress is read from rank 0's
  ``RUN_DIR/metrics.jsonl``; a fault fires once, whatever the attempt, and records when the
  restarted job is back at the step it was killed at (``back_s``: the time the failure cost,
  restart and steps redone, whatever the start-up of the first attempt took).

Both measure the kernel's counters of every worker's veth from before the first process
starts until the last one ends (every attempt, every rejoin, the lighthouse's heartbeats
included) into ``RUN_DIR/wire.json``, with the elapsed time and the faults as fired.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from thinwire.errors import UsageError
from thinwire.testbed.netns import SUBNET, Testbed, sh
from thinwire.testbed.rates import Link
from thinwire.testbed.run import (
    MASTER_PORT,
    BenchFailed,
    BenchTimeout,
    kill_all,
    worker_argv,
    worker_env,
)

HUB = f"{SUBNET}.254"
"""The bridge's own address, where the lighthouse listens."""

POLL_S = 0.05


@dataclass(frozen=True)
class Fault:
    """``kill`` worker ``worker`` (SIGKILL) or ``join`` it again, once the job reached ``step``."""

    action: str
    worker: int
    step: int

    @property
    def spec(self) -> str:
        return f"{self.action}:{self.worker}@{self.step}"


def parse_faults(text: str, workers: int) -> list[Fault]:
    """``"kill:3@40,join:3@80"`` -> faults in the order they fire (by step); one line on bad
    input. A ``join`` must follow a ``kill`` of the same worker."""
    out: list[Fault] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        try:
            action, rest = item.split(":", 1)
            who, at = rest.split("@", 1)
            fault = Fault(action.strip(), int(who), int(at))
        except ValueError:
            raise UsageError(f"fault {item!r}: write ACTION:WORKER@STEP, e.g. kill:3@40 or "
                             "join:3@80") from None
        if fault.action not in ("kill", "join"):
            raise UsageError(f"fault {item!r}: the action is kill or join")
        if not 0 <= fault.worker < workers or fault.step < 0:
            raise UsageError(f"fault {item!r}: the worker must be in 0..{workers - 1} and the "
                             "step >= 0")
        out.append(fault)
    out.sort(key=lambda f: f.step)
    dead: set[int] = set()
    for f in out:
        if (f.action == "kill") == (f.worker in dead):
            raise UsageError(f"fault {f.spec}: worker {f.worker} is "
                             f"{'already lost' if f.action == 'kill' else 'not lost'} then")
        (dead.add if f.action == "kill" else dead.discard)(f.worker)
    return out


def _size(path: Path) -> int:
    """A file's size, -1 while it does not exist."""
    try:
        return path.stat().st_size
    except OSError:
        return -1


def last_step(path: Path) -> int:
    """The highest ``step`` among the last records of a ``metrics.jsonl`` (-1: none yet)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            tail = f.read().decode("utf-8", errors="replace")
    except OSError:
        return -1
    best = -1
    for line in tail.splitlines()[1:] if len(tail) >= 4096 else tail.splitlines():
        try:
            best = max(best, int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue
    return best


@dataclass
class FaultRun:
    """What one run on the testbed measured: elapsed seconds (first start to last exit),
    per worker-side interface bytes sent and received, the faults with the step the job had
    reached and the second when each fired, and (restart) the attempts."""

    link: Link
    workers: int
    elapsed_s: float = 0.0
    tx_bytes: list[int] = field(default_factory=list)
    rx_bytes: list[int] = field(default_factory=list)
    fired: list[dict[str, Any]] = field(default_factory=list)
    attempts: int = 1
    exits: dict[int, int] = field(default_factory=dict)

    def write(self, run_dir: Path) -> None:
        data = {"mode": "measured", **asdict(self), "link_label": self.link.label}
        (run_dir / "wire.json").write_text(json.dumps(data, indent=1, default=str))


class _Plan:
    """The faults still to fire, fired in order once the progress reaches each one's step."""

    def __init__(self, faults: Sequence[Fault], run: FaultRun, t0: float) -> None:
        self.todo, self.run, self.t0 = list(faults), run, t0
        self.size = -1  # the metrics file's size at the last look
        self.at_restart = -2  # its size when the last attempt started (-2: none yet)

    def due(self, progress: int) -> list[Fault]:
        out = []
        while self.todo and progress >= self.todo[0].step:
            f = self.todo.pop(0)
            self.run.fired.append({**asdict(f), "at_step": progress,
                                   "at_s": round(time.monotonic() - self.t0, 3)})
            out.append(f)
        return out

    def back(self, progress: int, size: int) -> None:
        """Restart: a fired fault's ``back_s``, the second the job's progress (read again from
        the restarted rank 0's records, once they dropped below it) is back at the fault's.
        The resume cuts the records after its checkpoint: a file that shrank since the last
        look dropped below, even where the job was past the fault's step again by then."""
        shrunk = 0 <= size < self.size
        self.size = size
        written = size != self.at_restart  # the restarted job wrote (or cut) its records
        for rec in self.run.fired:
            if "back_s" in rec:
                continue
            if progress < rec["at_step"]:
                rec["dipped"] = True
            elif (rec.get("dipped") and written) or shrunk:
                rec.pop("dipped", None)
                rec["back_s"] = round(time.monotonic() - self.t0, 3)

    def restarted(self) -> None:
        """A new attempt starts: its resume goes back to a checkpoint at or before every fired
        fault's step, so each is behind until the new attempt's records reach it again."""
        self.at_restart = self.size
        for rec in self.run.fired:
            if "back_s" not in rec:
                rec["dipped"] = True


def _popen(argv: list[str], env: Mapping[str, str], log: Path) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        return subprocess.Popen(argv, env=dict(env), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _tail(log: Path) -> str:
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "no output"
    return lines[-1][:300] if lines else "no output"


def _check_deadline(deadline: float, t0: float) -> None:
    if time.monotonic() > deadline:
        raise BenchTimeout(f"wall-clock limit reached after {time.monotonic() - t0:.0f} s in "
                           "this run; all workers killed")


# --- the lighthouse in the bridge's namespace ---------------------------------------------------
def start_lighthouse(tb: Testbed, min_workers: int, heartbeat_ms: int, join_timeout_ms: int,
                     deadline: float) -> tuple[subprocess.Popen[str], str]:
    """Give the bridge :data:`HUB`, start :mod:`thinwire.testbed.lighthouse` in its namespace,
    return the process and the address it printed once listening."""
    sh(["ip", "-n", tb.bridge_ns, "addr", "add", f"{HUB}/24", "dev", "tw-br"])
    argv = ["ip", "netns", "exec", tb.bridge_ns, sys.executable, "-m",
            "thinwire.testbed.lighthouse", HUB, str(min_workers), str(heartbeat_ms),
            str(join_timeout_ms)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "RUST_LOG": "error"})
    out: IO[str] = proc.stdout  # type: ignore[assignment]
    end = min(deadline, time.monotonic() + 60)
    while time.monotonic() < end:
        if select.select([out], [], [], 0.2)[0]:
            line = out.readline()
            if line.startswith("listening "):
                return proc, line.split()[1]
            if not line:
                break
    proc.kill()
    proc.wait()
    raise BenchFailed(f"the lighthouse in {tb.bridge_ns} did not start: "
                      f"{(out.read() or 'no output').strip()[-300:]}")


# --- quorum: no restart ---------------------------------------------------------------------------
def quorum_env(tb: Testbed, rank: int, lighthouse: str, threads: int,
               extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Worker ``rank``'s environment: its index, the lighthouse, its veth address and name."""
    from thinwire.worker import FT_HOST_ENV, FT_LIGHTHOUSE_ENV, FT_WORKER_ENV

    env = worker_env(rank, tb.workers, HUB, MASTER_PORT, tb.ifname(rank), threads)
    env.update({FT_LIGHTHOUSE_ENV: lighthouse, FT_WORKER_ENV: str(rank),
                FT_HOST_ENV: tb.addr(rank), "RUST_LOG": "error", **(extra or {})})
    return env


def run_quorum_in_testbed(run_dir: Path, link: Link, threads: int, deadline: float,
                          faults: Sequence[Fault] = (), *, workers: int, min_workers: int,
                          heartbeat_ms: int = 2000, join_timeout_ms: int = 10_000,
                          env: Mapping[str, str] | None = None,
                          module: str = "thinwire.worker", summarise: bool = True) -> FaultRun:
    """A ``runtime.fault_tolerance torchft`` run on ``workers`` namespaces (module docstring);
    returns what was measured and writes ``RUN_DIR/wire.json`` and, with ``summarise``, the
    run's summary (:func:`thinwire.ft_trainer.compose_summary`; ``module``: another worker
    entry, e.g. a benchmark's own replica, which writes its own)."""
    from thinwire.ft_trainer import compose_summary
    from thinwire.launch import Exit

    run = FaultRun(link, workers)
    with Testbed(workers, link) as tb:
        lh, address = start_lighthouse(tb, min_workers, heartbeat_ms, join_timeout_ms, deadline)
        try:
            before = tb.counters()
            t0 = time.monotonic()

            def start(rank: int, log: str) -> subprocess.Popen[bytes]:
                argv = [sys.executable, "-m", module, str(run_dir / "config.toml")]
                return _popen(tb.exec_argv(rank, argv), quorum_env(tb, rank, address, threads, env),
                              run_dir / f"worker{rank}" / log)

            procs = {r: start(r, "output.log") for r in range(workers)}
            _watch_quorum(procs, run_dir, _Plan(faults, run, t0), start, deadline, t0)
            run.elapsed_s = time.monotonic() - t0
            after = tb.counters()
        finally:
            lh.kill()
            lh.wait()
    run.exits = {r: int(p.returncode) for r, p in procs.items()}
    run.tx_bytes = [a[0] - b[0] for a, b in zip(after, before)]
    run.rx_bytes = [a[1] - b[1] for a, b in zip(after, before)]
    run.write(run_dir)
    if summarise:
        compose_summary(run_dir, [Exit(r, c) for r, c in sorted(run.exits.items())])
    return run


def _watch_quorum(procs: dict[int, subprocess.Popen[bytes]], run_dir: Path, plan: _Plan,
                  start: Callable[[int, str], subprocess.Popen[bytes]], deadline: float,
                  t0: float) -> None:
    """Steps 3-4 of the module docstring: fire the faults, wait for the survivors."""
    killed: set[int] = set()
    logs = {r: "output.log" for r in procs}
    joins = 0
    try:
        while True:
            progress = max(last_step(run_dir / f"worker{r}" / "metrics.jsonl") for r in procs)
            for f in plan.due(progress):
                if f.action == "kill":
                    os.kill(procs[f.worker].pid, signal.SIGKILL)
                    procs[f.worker].wait()
                    killed.add(f.worker)
                else:
                    joins += 1
                    logs[f.worker] = f"output.join{joins}.log"
                    procs[f.worker] = start(f.worker, logs[f.worker])
                    killed.discard(f.worker)
            codes = {r: p.poll() for r, p in procs.items()}
            for r, c in codes.items():
                if c not in (None, 0) and r not in killed:
                    log = run_dir / f"worker{r}" / logs[r]
                    raise BenchFailed(f"worker {r} failed (exit code {c}): {_tail(log)} "
                                      f"(log: {log})")
            if all(c is not None for c in codes.values()):
                return
            _check_deadline(deadline, t0)
            time.sleep(POLL_S)
    finally:
        kill_all(list(procs.values()))


# --- restart: every worker again from the newest checkpoint ---------------------------------------
def run_restart_in_testbed(run_dir: Path, link: Link, threads: int, deadline: float,
                           faults: Sequence[Fault] = (), *, workers: int, max_restarts: int,
                           env: Mapping[str, str] | None = None) -> FaultRun:
    """The prepared run on ``workers`` namespaces, restarted as torch's elastic agent would
    (module docstring); writes ``RUN_DIR/wire.json``."""
    if any(f.action == "join" for f in faults):
        raise UsageError("a restart brings every worker back: plan kills only (no join)")
    run = FaultRun(link, workers)
    with Testbed(workers, link) as tb:
        before = tb.counters()
        t0 = time.monotonic()
        plan = _Plan(faults, run, t0)
        for attempt in range(max_restarts + 1):
            run.attempts = attempt + 1
            specs = [(tb.exec_argv(r, worker_argv(run_dir)),
                      {**worker_env(r, workers, tb.addr(0), MASTER_PORT + attempt, tb.ifname(r),
                                    threads), "TORCHELASTIC_RESTART_COUNT": str(attempt),
                       **(env or {})}) for r in range(workers)]
            if attempt:
                plan.restarted()
            suffix = "" if attempt == 0 else f".restart{attempt}"
            procs = [_popen(a, e, run_dir / f"worker{r}{suffix}.log")
                     for r, (a, e) in enumerate(specs)]
            failed = _watch_attempt(procs, run_dir, plan, deadline, t0)
            run.exits = {r: int(p.returncode) for r, p in enumerate(procs)}
            if failed is None:
                break
            if attempt == max_restarts:
                raise BenchFailed(f"{failed}; no restart left (max_restarts={max_restarts})")
        run.elapsed_s = time.monotonic() - t0
        after = tb.counters()
    run.tx_bytes = [a[0] - b[0] for a, b in zip(after, before)]
    run.rx_bytes = [a[1] - b[1] for a, b in zip(after, before)]
    run.write(run_dir)
    return run


def _watch_attempt(procs: list[subprocess.Popen[bytes]], run_dir: Path, plan: _Plan,
                   deadline: float, t0: float) -> str | None:
    """One attempt: fire the due kills; None when every worker finished, else the first
    failure in one line (every worker of the attempt is stopped before returning)."""
    try:
        while True:
            progress = last_step(run_dir / "metrics.jsonl")
            for f in plan.due(progress):
                os.kill(procs[f.worker].pid, signal.SIGKILL)
                procs[f.worker].wait()
            plan.back(progress, _size(run_dir / "metrics.jsonl"))
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                return f"worker rank {bad[0][0]} ended (exit code {bad[0][1]})"
            if all(c == 0 for c in codes):
                return None
            _check_deadline(deadline, t0)
            time.sleep(POLL_S)
    finally:
        kill_all(procs)
