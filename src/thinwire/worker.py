"""The worker entry: ``python -m thinwire.worker RUN_DIR/config.toml``.

``thinwire train`` starts it through torch's elastic launcher (:mod:`thinwire.launch`); on
several machines start it with an external torchrun, for example on each of 2 nodes::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 --rdzv-id myrun -m thinwire.worker runs/dp/config.toml

The run directory is the folder holding the config file.

Guarantees (tests in ``tests/reliability/``):

- **Dies with its launcher** (``test_job_processes.py``). On Linux the worker asks the kernel for
  ``SIGKILL`` when its parent dies (``prctl(PR_SET_PDEATHSIG)``), then checks that its parent is
  still the launcher (``THINWIRE_LAUNCHER_PID``): a launcher killed before that call is caught by
  the check. The kernel's signal fires when the *thread* that forked the worker exits; torch's
  agent forks the workers from the thread that runs :func:`thinwire.launch.launch`, which blocks
  until the last worker is gone (restarts included), so it outlives every worker. We chose the
  kernel's signal over a polling thread: it acts at once and also reaches a worker that is
  stopped (SIGSTOP) or busy in C code without the GIL. Where ``prctl`` is missing (not Linux) a
  daemon thread polls the parent pid every second instead.
- **Quiet signals** (``test_job_processes.py``). SIGINT and SIGTERM keep their default action (end the
  process): a worker stopped by Ctrl-C or by its agent prints no KeyboardInterrupt traceback.
  Checkpoints are written atomically, so ending a worker at any instant loses no checkpoint.
- **One-line failures.** A bad input (config, checkpoint, disk full) ends the worker with one
  line, never a traceback; communication failures caused by a dead or stuck peer are recorded
  as such (``kind: peer``). The record goes to torch's per-worker error file
  (``TORCHELASTIC_ERROR_FILE``) with a precise time, so the launcher names the worker that
  failed first. Under thinwire's own launcher the worker prints nothing for these (the launcher
  prints the one line); under an external torchrun it prints ``thinwire worker rank R: error:
  ...``. Unexpected exceptions (bugs) print their traceback.
- **Resume on restart** (``test_elastic_restart.py``). A worker restarted by the elastic agent
  (``TORCHELASTIC_RESTART_COUNT`` > 0) resumes from the newest complete checkpoint, as with
  ``--run.resume``; a first start with ``run.resume`` and no checkpoint is a one-line error.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

LAUNCHER_PID_ENV = "THINWIRE_LAUNCHER_PID"
"""Set by :func:`thinwire.launch.launch`: the pid the workers must die with."""

FT_LIGHTHOUSE_ENV = "THINWIRE_FT_LIGHTHOUSE"
"""With ``runtime.fault_tolerance torchft``: the lighthouse's address (``http://HOST:PORT``)."""

FT_WORKER_ENV = "THINWIRE_FT_WORKER"
"""With ``runtime.fault_tolerance torchft``: this worker's index among ``runtime.workers`` (its
replica group and its data shard)."""

FT_HOST_ENV = "THINWIRE_FT_HOST"
"""With ``runtime.fault_tolerance torchft``: the address this worker's peers reach it on
(127.0.0.1 on one machine)."""

EXIT_QUORUM = 3
"""A fault-tolerant worker whose quorum cannot go on (lighthouse lost, too few workers)."""

RESUME_CHECKED_ENV = "THINWIRE_RESUME_CHECKED"
"""Set by :func:`thinwire.run.run_config`, whose run directory checked a resume (every rank's
checkpoint, :func:`thinwire.checkpoint.require_resumable`) before starting the workers; a
worker started without it (an external torchrun) checks the resume itself."""

EXIT_USAGE = 2
EXIT_ERROR = 1


# --- process set-up (before torch is imported) ---------------------------------------------------
def die_with_parent() -> str:
    """Arrange for this process to end when its parent (the launcher) does; returns the means
    ("pdeathsig" or "watchdog"). Exits at once if the launcher is already gone."""
    expected = os.environ.get(LAUNCHER_PID_ENV, "")
    means = "watchdog"
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            pr_set_pdeathsig = 1
            if libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0) == 0:
                means = "pdeathsig"
        except (OSError, AttributeError):
            pass
    parent = os.getppid()
    if expected.isdigit() and parent != int(expected):
        os._exit(EXIT_ERROR)  # the launcher died before the kernel could be told
    if means == "watchdog":
        threading.Thread(target=_watch_parent, args=(parent,), name="thinwire-parent-watch",
                         daemon=True).start()
    return means


def _watch_parent(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(EXIT_ERROR)


def quiet_signals() -> None:
    """Default actions for SIGINT and SIGTERM: the process ends without a traceback."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


# --- failure records ----------------------------------------------------------------------------
def _rank() -> int:
    """This worker's rank (a fault-tolerant worker's: its index, ``THINWIRE_FT_WORKER``)."""
    try:
        return int(os.environ.get(FT_WORKER_ENV) or os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def record_failure(message: str, kind: str, detail: str = "") -> None:
    """Write torch's per-worker error file with a one-line ``message`` and thinwire's fields
    (``kind``: usage, io, peer or error; a precise ``time``); nothing without the file's env."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    data = {"message": message, "timestamp": int(now),
            "thinwire": {"kind": kind, "time": now, "rank": _rank(), "detail": detail[-4000:]}}
    target = Path(path)
    tmp = target.with_name(target.name + f".{os.getpid()}.tmp")
    try:  # atomically: torch's agent cannot parse a half-written file
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, target)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[-1] if lines else ""


_COMM_MARKERS = ("thinwire/runtime/comm.py", "/gloo/", "ProcessGroupGloo", "ProcessGroupNCCL",
                 "NCCL error", "Connection reset by peer", "Connection closed by peer")


def _from_comm(exc: BaseException) -> bool:
    """True when the exception was raised inside a communication call (thinwire's comm layer
    or torch.distributed): a symptom of a dead or stuck peer, not a cause."""
    import torch.distributed as dist

    from thinwire.runtime.comm import CommDeviceError

    if isinstance(exc, CommDeviceError):  # a program error found before the call, not a peer
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    if any(m in text for m in _COMM_MARKERS):
        return True  # raised in a callback of a collective (the autograd engine re-raises it)
    tb = exc.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace("\\", "/")
        if name.endswith("thinwire/runtime/comm.py") or "/torch/distributed/" in name:
            return True
        tb = tb.tb_next
    return False


_PEER_RE = re.compile(r"(?:closed|reset) by peer \[([^\]]+)\]:(\d+)")
_TIMEOUT_RE = re.compile(r"Timed out waiting (\d+)ms for (\w+) operation")
_OP_RE = re.compile(r"\b(all_reduce|all_gather|reduce_scatter|broadcast|barrier|send|recv|"
                    r"isend|irecv|all_to_all)\w*")


def comm_failure(exc: BaseException) -> str:
    """One line for a communication error: the operation, the peer's address when the
    transport names it (gloo: "closed by peer [ADDR]:PORT"), or the timeout, and what to do."""
    texts, seen = [], set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        texts.append(str(e))
        e = e.__cause__ or e.__context__
    text = "\n".join(texts)
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ else []
    ops = [f.name for f in frames if f.filename.replace("\\", "/").endswith("runtime/comm.py")]
    op = ops[-1] if ops else (m.group(1) if (m := _OP_RE.search(text)) else "")
    where = f" in {op}" if op else ""
    if (m := _PEER_RE.search(text)) is not None:
        return (f"communication failed{where}: the connection to peer {m.group(1)}:"
                f"{m.group(2)} was closed (the worker there failed or was stopped first; see "
                "that worker's own error on its node)")
    if (m := _TIMEOUT_RE.search(text)) is not None:
        return (f"communication failed{where}: no peer answered within {int(m.group(1)) / 1000:g} "
                "s (a worker stalled or died first; see the other workers' errors, or raise "
                "--runtime.timeout_s)")
    return (f"communication failed{where}: {_one_line(str(exc))[:240]} (a peer worker failed "
            "first; see the other workers' errors)")


def _fail(message: str, kind: str, code: int, detail: str = "") -> int:
    record_failure(message, kind, detail)
    if not os.environ.get(LAUNCHER_PID_ENV):
        print(f"thinwire worker rank {_rank()}: error: {message}", file=sys.stderr)
    return code


# --- the entry ----------------------------------------------------------------------------------
def resume_wanted(resume: bool) -> bool:
    """Whether this start resumes: asked for, or a restart by the elastic agent."""
    return resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def main(argv: list[str] | None = None) -> int:
    die_with_parent()
    quiet_signals()
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m thinwire.worker RUN_DIR/config.toml", file=sys.stderr)
        return EXIT_USAGE
    from thinwire.errors import UsageError
    from thinwire.runtime.ft import FaultToleranceError

    try:
        return _run(Path(argv[0]))
    except FaultToleranceError as exc:
        return _fail(_one_line(str(exc)), "quorum", EXIT_QUORUM)
    except UsageError as exc:
        return _fail(_one_line(str(exc)), "usage", EXIT_USAGE)
    except OSError as exc:
        from thinwire.rundir import describe_os_error

        where = exc.filename or f"into {Path(argv[0]).parent}"
        msg = (describe_os_error(exc, where) if exc.errno in
               (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM)
               else f"{type(exc).__name__}: {_one_line(str(exc))}")
        return _fail(msg, "io", EXIT_ERROR)
    except Exception as exc:  # noqa: BLE001 - recorded for the launcher, then reported
        detail = traceback.format_exc()
        if _from_comm(exc):
            return _fail(comm_failure(exc), "peer", EXIT_ERROR, detail)
        record_failure(f"{type(exc).__name__}: {_one_line(str(exc))[:300]}", "error", detail)
        print(f"thinwire worker rank {_rank()}: unexpected error:\n{detail}", file=sys.stderr,
              end="")
        return EXIT_ERROR


def _run(path: Path) -> int:
    from thinwire import config as config_mod

    cfg = config_mod.load(path)
    run_dir = path.parent
    lock = claim_run_dir(run_dir)
    try:
        return _train(cfg, run_dir, lock)
    finally:
        if lock is not None:
            lock.release()


def claim_run_dir(run_dir: Path) -> Any:
    """One job per run directory, under any launcher: rank 0 takes the run's lock
    (:func:`thinwire.rundir.take_lock`) unless the job that started this worker holds it
    (thinwire's launcher, the testbed's runner: the parent or ``THINWIRE_LAUNCHER_PID``) or this
    process itself does (its pid is the lock's); a job already running there is a one-line error. Returns the
    :class:`~thinwire.rundir.Lock` taken (None when not taken here)."""
    from thinwire import rundir

    if _rank() != 0:
        return None
    where = run_dir.resolve()
    launcher = os.environ.get(LAUNCHER_PID_ENV, "")
    ours = {os.getpid(), os.getppid()} | ({int(launcher)} if launcher.isdigit() else set())
    # a replacement's staging directory is held by the lock of the run it replaces
    names = [where.name, *filter(None, [rundir.staged_run(where)])]
    if any(rundir.lock_holder(rundir.lock_path(where.parent, n)) in ours for n in names):
        return None  # held by this process (in-process use) or by the job that started it
    return rundir.take_lock(where.parent, where.name)


def _train(cfg: Any, run_dir: Path, lock: Any) -> int:
    import dataclasses

    from thinwire import checkpoint, rundir
    from thinwire.runtime import dist as rt
    from thinwire.runtime.comm import Comm
    from thinwire.trainer import Trainer

    del lock
    if cfg.runtime.fault_tolerance == "torchft":
        return _train_replica(cfg, run_dir)
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
    if resume_wanted(cfg.run.resume) and not cfg.run.resume:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, resume=True))
    device = rt.init_from_env(cfg.runtime)
    comm = Comm() if rt.initialised() else Comm.local()
    # a restart before the first checkpoint starts afresh; a resume the launcher checked is not
    # checked again
    if cfg.run.resume and not restarted and not os.environ.get(RESUME_CHECKED_ENV):
        from thinwire.builders import rescalable

        if comm.rank == 0:
            rundir.check_no_links(run_dir)
        checkpoint.require_resumable(run_dir, comm.world_size, check_ranks=False,
                                     rescalable=rescalable(cfg), steps=cfg.train.steps)
    trainer = _build_trainer(Trainer, cfg, comm, device, run_dir)
    trainer.run()
    del trainer
    rt.teardown(comm)
    return 0


def _train_replica(cfg: Any, run_dir: Path) -> int:
    """One replica group of a fault-tolerant run (:mod:`thinwire.ft_trainer`): no process
    group of its own; the quorum's, through torchft."""
    import torch

    from thinwire.errors import UsageError
    from thinwire.ft_trainer import FaultTolerantTrainer
    from thinwire.runtime import dist as rt
    from thinwire.runtime.ft import FaultToleranceError, Replica
    from thinwire.runtime.ledger import Ledger

    lighthouse, index = os.environ.get(FT_LIGHTHOUSE_ENV, ""), os.environ.get(FT_WORKER_ENV, "")
    if not lighthouse or not index.isdigit() or int(index) >= cfg.runtime.workers:
        raise UsageError(f"runtime.fault_tolerance torchft: start each worker with "
                         f"{FT_LIGHTHOUSE_ENV}=http://HOST:PORT and {FT_WORKER_ENV}=I (0 <= I < "
                         f"runtime.workers = {cfg.runtime.workers}), as thinwire train does")
    torch.set_num_threads(cfg.runtime.threads or max(1, (os.cpu_count() or 1)
                                                     // cfg.runtime.workers))
    device = rt.pick_device(cfg.runtime, int(index))
    t = cfg.runtime.timeout_s
    try:
        replica = Replica(f"worker{index}", lighthouse, min_workers=cfg.runtime.min_workers,
                          host=os.environ.get(FT_HOST_ENV, "127.0.0.1"), timeout=t,
                          quorum_timeout=t, device=device, ledger=Ledger(int(index)))
    except (RuntimeError, OSError) as exc:  # torchft's connection errors
        raise FaultToleranceError(
            f"fault tolerance: worker {index} cannot join the lighthouse at {lighthouse} "
            f"({_one_line(str(exc))[:200]}); start it first, or check {FT_LIGHTHOUSE_ENV}"
        ) from None
    try:
        trainer = _build_trainer(FaultTolerantTrainer, cfg, replica, device, run_dir)
        trainer.run()
    finally:
        replica.close()
    return 0


def _build_trainer(trainer_cls: Any, cfg: Any, comm: Any, device: Any, run_dir: Path) -> Any:
    """The trainer; a checkpoint that loads but does not fit this config is one line."""
    from thinwire import checkpoint
    from thinwire.errors import UsageError

    try:
        return trainer_cls(cfg, comm, device, run_dir)
    except (UsageError, OSError):
        raise
    except Exception as exc:
        step = checkpoint.latest_step(run_dir) if cfg.run.resume else None
        if step is None or _from_comm(exc):
            raise
        d = checkpoint.step_dir(run_dir, step)
        raise checkpoint.CheckpointError(
            f"checkpoint {d} does not fit this config ({type(exc).__name__}: "
            f"{_one_line(str(exc))[:160]}); resume with the run's own config.toml (the "
            "checkpoints are kept), or start a new run with another --run.name") from None


def exit_now(code: int) -> None:
    """End the process with ``code``. A failed worker skips interpreter and C++ teardown: its
    process group is broken, and destroying threads still blocked in it can abort with libstdc++'s
    "terminate called without an active exception", a second line beside the launcher's one."""
    if code == 0:
        raise SystemExit(0)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
