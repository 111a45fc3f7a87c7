"""Process helpers for the reliability tests: find a job's processes by the launcher pid they
carry in their environment (``THINWIRE_LAUNCHER_PID``, which survives re-parenting), list their
listening sockets from ``/proc/net``, start ``thinwire train`` and always clean up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from harness import poll_until

LONG = ["--data.name", "digits", "--train.steps", "100000", "--train.batch_size", "8",
        "--model.hidden", "16", "--train.eval_every", "0", "--no-progress"]


def state(pid: int) -> str:
    """The process state letter, or '' when it no longer exists."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def alive(pid: int) -> bool:
    """Exists and is not a zombie (an exited child nobody reaped yet)."""
    return state(pid) not in ("", "Z", "X")


def _ppid(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


def job_workers(launcher_pid: int) -> dict[int, int]:
    """{pid: rank} of live processes started for the launcher ``launcher_pid``: those carrying
    its pid in their environment (even once orphaned) or still its worker children."""
    out: dict[int, int] = {}
    needle = f"THINWIRE_LAUNCHER_PID={launcher_pid}".encode()
    for p in Path("/proc").iterdir():
        if not p.name.isdigit() or int(p.name) == launcher_pid:
            continue
        try:
            env = (p / "environ").read_bytes().split(b"\0")
            child = (_ppid(int(p.name)) == launcher_pid
                     and b"thinwire.worker" in (p / "cmdline").read_bytes())
        except OSError:
            continue
        if (needle in env or child) and alive(int(p.name)):
            rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), -1)
            out[int(p.name)] = rank
    return out


def by_cmdline(fragment: str) -> list[int]:
    """Live processes whose command line mentions ``fragment`` (a test's own folder)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if fragment.encode() in (p / "cmdline").read_bytes() and alive(int(p.name)):
                    out.append(int(p.name))
            except OSError:
                continue
    return out


def kill_quietly(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


def listening(pids: list[int]) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state held by ``pids``."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
        except OSError:
            continue
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:
                addr, port = f[1].split(":")
                out.append((_addr(addr), int(port, 16)))
    return out


def _addr(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)
    # /proc/net stores each 32-bit word in host (little-endian) order
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    if len(words) == 4:
        return ".".join(str(b) for b in words)
    import ipaddress

    return str(ipaddress.IPv6Address(words))


def is_loopback(addr: str) -> bool:
    import ipaddress

    ip = ipaddress.ip_address(addr)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


@contextmanager
def train_job(out: Path, *extra: str, workers: int = 2) -> Iterator[subprocess.Popen[str]]:
    """``thinwire train`` as a child process; on exit the launcher and every worker it started
    (found through their environment or their command line, even when orphaned) are killed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "thinwire", "train", "--workers", str(workers), "--out", str(out),
         *LONG, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        leftovers = {**job_workers(proc.pid), **{p: -1 for p in by_cmdline(str(out))}}
        kill_quietly(proc.pid)
        for pid in leftovers:
            kill_quietly(pid, signal.SIGCONT)
            kill_quietly(pid)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            pass


def started(proc: subprocess.Popen[str], workers: int, timeout: float = 180) -> dict[int, int]:
    """Wait until ``workers`` workers of the job are alive; {pid: rank}."""
    found = poll_until(lambda: len(job_workers(proc.pid)) >= workers or proc.poll() is not None,
                     timeout)
    assert found and proc.poll() is None, f"workers did not start: {proc.poll()}"
    return job_workers(proc.pid)


def training(run_dir: Path, timeout: float = 180) -> None:
    """Wait until rank 0 wrote its first metrics record (every worker passed the first barrier)."""
    metrics = run_dir / "metrics.jsonl"
    assert poll_until(lambda: metrics.is_file() and metrics.stat().st_size > 0, timeout), \
        "training did not start"
