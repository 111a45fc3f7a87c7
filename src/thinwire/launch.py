"""Start N local workers through torch's own elastic launcher (the API behind ``torchrun``).

``launch(run_dir, workers)`` runs ``python -m thinwire.worker RUN_DIR/config.toml`` in N
processes. The workers are the same program an external multi-node ``torchrun`` starts (see
:mod:`thinwire.worker`).

Guarantees (tests in ``tests/reliability/``):

- **Loopback only** (``test_job_processes.py``). torch's c10d rendezvous binds its store on every
  interface (``::``) whatever the endpoint says, and the agent adds a second such store; neither
  takes a bind address, nor does any ``TORCH_*`` variable. :class:`torch.distributed.TCPStore`
  does accept an already listening socket (``master_listen_fd``), and a multi-tenant store is
  shared per port inside a process. So the launcher binds one socket to ``127.0.0.1`` itself,
  starts the store on it and uses torch's *static* rendezvous on that port: the static handler's
  own multi-tenant store reuses ours and creates no other, and the workers reach it as clients
  (the agent store). ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` default to ``lo`` so the
  workers' own connections listen on loopback too. The store still has no authentication: any
  local user can reach it while a job runs.
- **First failure named** (``test_job_processes.py``, ``test_failure_order.py``). When a worker
  fails, the agent stops the others
  (SIGTERM) and peers that were talking to it fail with communication errors; the launcher
  ranks the failures, earliest first within a class: a death by a signal the agent does not
  send (the OOM killer's SIGKILL, SIGSEGV: never a consequence of another worker), a stopped
  worker, an error recorded by a worker (bad input, I/O, a bug; ordered by the precise time
  each worker recorded), communication errors and other exit codes, then workers ended by the
  agent. It raises :class:`WorkerFailed` naming that worker and its cause.
- **Timeout honoured.** A stopped (SIGSTOP) worker cannot act on the agent's SIGTERM, and the
  agent waits 30 s before SIGKILL; a watcher thread kills a stopped worker as soon as it has a
  termination signal pending, so the job ends ``runtime.timeout_s`` after the stall.
- **Interrupts.** SIGINT, SIGTERM, SIGHUP or SIGQUIT to the launcher stop every worker (their
  default action: no tracebacks) and raise :class:`Interrupted`, a KeyboardInterrupt, so the
  command line prints one line and exits 130 (``128 + SIGINT``: one code for "interrupted",
  whichever signal it was). torch's own log lines go to ``RUN_DIR/launcher.log``, not the
  terminal; the signal handlers in force before the call are restored after it. Signals are
  handled once: those that follow the first are ignored while the job is torn down.
- **No orphans.** Workers die with the launcher, however it ends (see :mod:`thinwire.worker`).
- **Elastic restarts** (``test_elastic_restart.py``). With ``max_restarts`` > 0 the agent restarts the
  whole worker group after a failure, and the restarted workers resume from the newest complete
  checkpoint.
- **No restart** (``test_ft_trainer.py``). With ``runtime.fault_tolerance torchft``,
  :func:`launch_replicas` starts torchft's lighthouse on 127.0.0.1 (a port it binds itself) and
  each worker as a replica group of its own, not under torch's agent: a lost worker ends
  nobody else; the job succeeds when a worker finishes, and the lost ones are returned.

One concept, one file (over 400 lines): starting, watching and stopping a job's local workers
(the elastic agent, its signals, and the first failure named).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError
from thinwire.rundir import describe_os_error
from thinwire.worker import LAUNCHER_PID_ENV

HANDLED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
EXIT_INTERRUPTED = 130
_TERMINATING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGKILL)


class WorkerFailed(RuntimeError):
    """A worker exited with an error; the message names the rank and the cause.

    ``rank``, ``exitcode``, ``cause`` and ``kind`` (usage, io, error, signal, stopped, peer,
    exit) describe the worker that failed first; ``kind == "usage"`` is a bad input."""

    def __init__(self, message: str, *, rank: int = -1, exitcode: int = 0, cause: str = "",
                 kind: str = "") -> None:
        super().__init__(message)
        self.rank, self.exitcode, self.cause, self.kind = rank, exitcode, cause, kind


class Interrupted(KeyboardInterrupt):
    """The launcher got a termination signal; every worker has been stopped."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {_signame(signum)}")
        self.signum = signum
        self.exit_code = EXIT_INTERRUPTED


def launch(run_dir: Path, workers: int, *, env: Mapping[str, str] | None = None,
           max_restarts: int = 0, module: str = "thinwire.worker") -> None:
    """Run ``python -m MODULE RUN_DIR/config.toml`` on ``workers`` local processes.

    Returns when every worker succeeded. Raises :class:`WorkerFailed` (the first failure, after
    ``max_restarts`` restarts of the whole group) or :class:`Interrupted`. ``env`` is added to
    the workers' environment; ``module`` is the worker entry (tests wrap it to inject faults).
    """
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config_path = Path(run_dir) / "config.toml"
    # torch's per-worker error files: in the system's temporary folder, not the run directory,
    # so a worker can still report a full run disk; removed at the end (a launcher killed
    # outright leaves this small folder to the system's temporary-file cleaning)
    try:
        log_dir = tempfile.mkdtemp(prefix=f"thinwire-launch-{os.getpid()}-")
    except OSError as exc:
        raise UsageError(describe_os_error(exc, Path(tempfile.gettempdir()) / "thinwire-launch-*")
                         ) from None
    worker_env = {**(env or {}), LAUNCHER_PID_ENV: str(os.getpid()), **_default_env()}
    with _environ(worker_env), _saved_signal_handlers(), _interrupt_once(), \
            _torch_logs(Path(run_dir)):
        store, port = loopback_store()
        watcher = Watcher(os.getpid(), module)
        watcher.start()
        try:
            cfg = LaunchConfig(
                min_nodes=1, max_nodes=1, nproc_per_node=workers, run_id=uuid.uuid4().hex[:12],
                rdzv_backend="static", rdzv_endpoint=f"127.0.0.1:{port}",
                rdzv_configs={"rank": 0}, max_restarts=max_restarts, monitor_interval=0.2,
                start_method="spawn", log_line_prefix_template=None,
                logs_specs=DefaultLogsSpecs(log_dir=log_dir), shutdown_timeout=5)
            elastic_launch(cfg, entrypoint=sys.executable)("-m", module, str(config_path))
        except ChildFailedError as exc:
            raise first_failure(exc.failures, watcher.stopped_ranks()) from None
        except SignalException as exc:
            raise Interrupted(int(exc.sigval)) from None
        finally:
            watcher.stop()
            del store
            shutil.rmtree(log_dir, ignore_errors=True)


@dataclass(frozen=True)
class Exit:
    """How a replica group's process ended: ``code`` (negative: killed by that signal), and the
    one line it recorded (``kind``: usage, io, quorum, peer, error; empty if none)."""

    worker: int
    code: int
    message: str = ""
    kind: str = ""

    def describe(self) -> str:
        if self.code < 0:
            return f"killed by {_signame(-self.code)}"
        return self.message or f"exit code {self.code}"


def launch_replicas(run_dir: Path, workers: int, *, min_workers: int,
                    env: Mapping[str, str] | None = None, module: str = "thinwire.worker",
                    heartbeat_ms: int = 2000, join_timeout_ms: int = 10_000) -> list[Exit]:
    """A fault-tolerant job on this machine (torchft; docs/FAULT_TOLERANCE.md):

    1. torchft's lighthouse on 127.0.0.1, on a port it binds itself (``min_workers``: the
       smallest quorum; ``heartbeat_ms``: silence after which a worker counts as lost;
       ``join_timeout_ms``: how long a quorum waits for workers that have not asked yet);
    2. ``workers`` processes ``python -m MODULE RUN_DIR/config.toml``, worker ``I`` told the
       lighthouse's address and its index (``THINWIRE_FT_LIGHTHOUSE``, ``THINWIRE_FT_WORKER``),
       its output in ``RUN_DIR/workerI/output.log``; each dies with this process;
    3. every one is waited for (a stalled quorum ends each worker within its timeout), then the
       lighthouse stops;
    4. returns every worker's :class:`Exit` when at least one finished (code 0); else raises
       :class:`WorkerFailed` with the first recorded line (bad input first, then the quorum's).
    Ctrl-C or SIGTERM stops every worker and raises :class:`Interrupted`."""
    from thinwire.runtime.ft import Lighthouse

    errors = Path(tempfile.mkdtemp(prefix=f"thinwire-replicas-{os.getpid()}-"))
    procs: list[Any] = []
    logs: list[Any] = []
    stop = {"signum": 0}

    def on_signal(signum: int, _frame: Any) -> None:
        stop["signum"] = stop["signum"] or signum
        for p in procs:
            if p.poll() is None:
                p.kill()

    quiet = {"RUST_LOG": os.environ.get("RUST_LOG", "error")}  # torchft's own log lines
    try:
        with _saved_signal_handlers(), _environ(quiet), \
                Lighthouse(min_workers, heartbeat_timeout_ms=heartbeat_ms,
                           join_timeout_ms=join_timeout_ms) as lh:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                signal.signal(sig, on_signal)
            base = {**os.environ, **quiet, **(env or {}), LAUNCHER_PID_ENV: str(os.getpid()),
                    **_default_env()}
            _spawn_replicas(Path(run_dir), workers, module, base, lh.address, errors, procs,
                            logs)
            codes = [p.wait() for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
        exits = [_exit_of(i, p.returncode, errors / f"{i}.json") for i, p in enumerate(procs)]
        shutil.rmtree(errors, ignore_errors=True)
    if stop["signum"]:
        raise Interrupted(stop["signum"])
    if any(c == 0 for c in codes):
        return exits
    order = {"usage": 0, "io": 1, "quorum": 2}
    first = min(exits, key=lambda e: (order.get(e.kind, 3), e.worker))
    raise WorkerFailed(f"worker {first.worker} failed: {first.describe()}", rank=first.worker,
                       exitcode=first.code, cause=first.message, kind=first.kind or "exit")


def _spawn_replicas(run_dir: Path, workers: int, module: str, base: Mapping[str, str],
                    lighthouse: str, errors: Path, procs: list[Any], logs: list[Any]) -> None:
    """Step 2 of :func:`launch_replicas`: each started process and its log file are appended
    to ``procs`` and ``logs`` at once, so the caller's cleanup reaches every one."""
    import subprocess

    from thinwire.worker import FT_LIGHTHOUSE_ENV, FT_WORKER_ENV

    for i in range(workers):
        out = run_dir / f"worker{i}"
        out.mkdir(exist_ok=True)
        logs.append(open(out / "output.log", "wb"))  # noqa: SIM115 - the caller closes it
        procs.append(subprocess.Popen(
            [sys.executable, "-m", module, str(run_dir / "config.toml")],
            stdin=subprocess.DEVNULL, stdout=logs[-1], stderr=subprocess.STDOUT,
            env={**base, FT_LIGHTHOUSE_ENV: lighthouse, FT_WORKER_ENV: str(i), "RANK": str(i),
                 "TORCHELASTIC_ERROR_FILE": str(errors / f"{i}.json")}))


def _exit_of(worker: int, code: int, error_file: Path) -> Exit:
    import json

    try:
        data = json.loads(error_file.read_text())
        return Exit(worker, code, str(data.get("message", "")),
                    str(data.get("thinwire", {}).get("kind", "")))
    except (OSError, ValueError):
        return Exit(worker, code)


@contextmanager
def _interrupt_once() -> Iterator[None]:
    """Signals handled once: torch's agent raises its SignalException at the first termination
    signal and stops the workers; the signals after it are ignored while the job is torn down
    (the agent's shutdown, the launcher's temporary folder), so a second Ctrl-C cannot cut the
    teardown short. The caller's handlers come back with :func:`_saved_signal_handlers`."""
    from torch.distributed.elastic.multiprocessing import api

    torch_handler = getattr(api, "_terminate_process_handler", None)
    if torch_handler is None:  # another torch: its own handler, every signal raising
        yield
        return

    def once(signum: int, frame: Any) -> None:
        ignore_signals()
        torch_handler(signum, frame)

    api._terminate_process_handler = once  # type: ignore[assignment]
    try:
        yield
    finally:
        api._terminate_process_handler = torch_handler  # type: ignore[assignment]


def ignore_signals() -> None:
    """Ignore every termination signal the launcher handles (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in HANDLED_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)


# --- the loopback store -------------------------------------------------------------------------
def loopback_store() -> tuple[Any, int]:
    """A multi-tenant TCPStore server listening on 127.0.0.1 only, and its port.

    The socket is bound and listening before the store takes it over (``master_listen_fd``;
    the store owns and closes the descriptor), so there is no window where the port is free."""
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        port = int(sock.getsockname()[1])
    except BaseException:
        sock.close()
        raise
    fd = sock.detach()
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True,
                              master_listen_fd=fd, wait_for_workers=False, use_libuv=True)
    except BaseException:
        os.close(fd)
        raise
    return store, port


def _default_env() -> dict[str, str]:
    """Loopback interfaces for gloo and NCCL unless the user chose others."""
    out = {}
    if os.path.exists("/sys/class/net/lo"):
        for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            if key not in os.environ:
                out[key] = "lo"
    if "OMP_NUM_THREADS" not in os.environ:
        out["OMP_NUM_THREADS"] = "1"
    return out


# --- scoped process state -----------------------------------------------------------------------
@contextmanager
def _environ(extra: Mapping[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextmanager
def _saved_signal_handlers() -> Iterator[None]:
    """torch's agent installs its own handlers and leaves them; put the caller's back."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = [getattr(signal, s) for s in HANDLED_SIGNALS if hasattr(signal, s)]
    old = {s: signal.getsignal(s) for s in sigs}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


@contextmanager
def _torch_logs(run_dir: Path) -> Iterator[None]:
    """torch.distributed's elastic log lines into ``RUN_DIR/launcher.log`` instead of stderr."""
    names = ("torch.distributed.elastic", "torch.distributed.launcher")
    loggers = [logging.getLogger(n) for n in names]
    saved = [(lg.propagate, list(lg.handlers)) for lg in loggers]
    handler: logging.Handler
    try:
        handler = _QuietFileHandler(run_dir / "launcher.log", delay=True)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    except OSError:
        handler = logging.NullHandler()
    for lg in loggers:
        lg.addHandler(handler)
        lg.propagate = False
    try:
        yield
    finally:
        for lg, (prop, handlers) in zip(loggers, saved):
            lg.handlers[:] = handlers
            lg.propagate = prop
        handler.close()


class _QuietFileHandler(logging.FileHandler):
    """A log file that never disturbs the job: a failed write (a full disk) drops the record."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        pass

    def close(self) -> None:
        try:
            super().close()
        except OSError:
            pass


# --- the watcher --------------------------------------------------------------------------------
@dataclass
class Watcher:
    """A daemon thread that kills a stopped worker with a termination signal pending (the agent
    asked it to end; a stopped process cannot) and remembers which ranks it had to kill.
    Linux only (reads ``/proc``); elsewhere it does nothing."""

    launcher_pid: int
    module: str
    interval: float = 0.5
    _stop: threading.Event = field(default_factory=threading.Event)
    _stopped: set[int] = field(default_factory=set)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        if not os.path.isdir("/proc/self"):
            return
        self._thread = threading.Thread(target=self._loop, name="thinwire-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def stopped_ranks(self) -> set[int]:
        return set(self._stopped)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            for pid in worker_pids(self.launcher_pid, self.module):
                try:
                    st = _status(pid)
                    if st.get("State", "")[:1] in ("T", "t") and _pending_end(st):
                        rank = _env_rank(pid)
                        os.kill(pid, signal.SIGKILL)
                        if rank is not None:
                            self._stopped.add(rank)
                except (OSError, ValueError):
                    continue


def worker_pids(launcher_pid: int, module: str = "thinwire.worker") -> list[int]:
    """Live (not zombie) children of ``launcher_pid`` running ``python -m MODULE``."""
    out = []
    needle = b"\0-m\0" + module.encode() + b"\0"
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as f:
                stat = f.read().rsplit(b")", 1)[1].split()
            if int(stat[1]) != launcher_pid or stat[0] == b"Z":
                continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                if needle in b"\0" + f.read():
                    out.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return out


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        pairs = (ln.split(":", 1) for ln in f.read().splitlines() if ":" in ln)
        return {k: v.strip() for k, v in pairs}


def _pending_end(status: Mapping[str, str]) -> bool:
    mask = int(status.get("ShdPnd") or "0", 16) | int(status.get("SigPnd") or "0", 16)
    return any(mask & (1 << (int(s) - 1)) for s in _TERMINATING)


def _env_rank(pid: int) -> int | None:
    with open(f"/proc/{pid}/environ", "rb") as f:
        for item in f.read().split(b"\0"):
            if item.startswith(b"RANK="):
                return int(item[5:])
    return None


# --- naming the first failure -------------------------------------------------------------------
def _signame(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


_AGENT_SIGNALS = frozenset({int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP),
                            int(signal.SIGQUIT)})


def first_failure(failures: Mapping[int, Any], stopped: set[int] | None = None) -> WorkerFailed:
    """The failure to report among ``{global rank: ProcessFailure}`` (see the module docstring
    for the order); ``stopped`` are ranks the watcher killed while stopped."""
    stopped = stopped or set()
    ranked = []
    for rank, f in failures.items():
        code = int(getattr(f, "exitcode", 1) or 0)
        data = getattr(f, "error_file_data", None)
        tw = data.get("thinwire") if isinstance(data, dict) else None
        tw = tw if isinstance(tw, dict) else None
        when = float(tw.get("time", 0.0)) if tw else float(getattr(f, "timestamp", 0) or 0)
        if code < 0 and -code not in _AGENT_SIGNALS and rank not in stopped:
            cls, kind = 0, "signal"
            cause = f"was killed by {_signame(-code)}"
            if -code == signal.SIGKILL:
                cause += " (the out-of-memory killer or another process; see dmesg)"
        elif rank in stopped:
            cls, kind = 1, "stopped"
            cause = ("was stopped (SIGSTOP) and stalled the job; the others timed out after "
                     "runtime.timeout_s and it was killed")
        elif tw and tw.get("kind") in ("usage", "io", "error"):
            cls, kind, cause = 2, str(tw["kind"]), f"failed: {_message(f)}"
        elif tw and tw.get("kind") == "peer":
            cls, kind, cause = 3, "peer", f"failed: {_message(f)}"
        elif code > 0:
            msg = _message(f)
            cls, kind = 3, "exit"
            cause = f"exited with code {code}" + (f": {msg}" if msg else "")
        else:
            cls, kind = 4, "signal"
            cause = f"was ended by {_signame(-code)} (exit code {code})"
        ranked.append(((cls, when, rank), rank, code, kind, cause))
    if not ranked:
        return WorkerFailed("a worker failed (no details)")
    _key, rank, code, kind, cause = min(ranked)
    return WorkerFailed(f"worker rank {rank} {cause}", rank=rank, exitcode=code, cause=cause,
                        kind=kind)


def _message(failure: Any) -> str:
    """The failure's recorded one-line message, if a worker wrote one."""
    data = getattr(failure, "error_file_data", None)
    if not isinstance(data, dict) or not data.get("message"):
        return ""
    msg = data["message"]
    if isinstance(msg, dict):
        msg = msg.get("message", "")
    lines = [ln.strip() for ln in str(msg).splitlines() if ln.strip()]
    return lines[-1] if lines else ""
