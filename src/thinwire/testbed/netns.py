"""Network namespaces joined by rate-limited veth pairs: a thin wire on one machine.

Layout for n workers, every object named with the prefix ``tw-<pid>-<k>-`` (pid of the owner,
k a counter) so concurrent runs never clash and leftovers of a killed run can be recognised::

    namespace tw-P-K-w0  [tw-w0 198.18.0.1/24] ==veth== [tw-b0] -+
    namespace tw-P-K-w1  [tw-w1 198.18.0.2/24] ==veth== [tw-b1] -+- bridge tw-br
    ...                                                          |  (namespace tw-P-K-br)

Safety: addresses only in 198.18.0.0/15 (RFC 2544 benchmarking range), one connected /24 and
no default route, no NAT, no forwarding; the veth pairs are created directly inside the
namespaces (``ip link add ... netns``), so the host's namespace, interfaces and routes are never
touched. IPv6 is disabled in every namespace (no autoconfiguration chatter in the counters);
loopback is up in every worker namespace.

Shaping (``tc``), on the egress of *both* ends of each worker's veth, so upload and download are
limited separately: ``tbf`` with ``overhead 24`` (Ethernet preamble, FCS and inter-frame gap,
so the rate is a real wire's bit rate), a burst of max(32 KiB, 4 ms at the rate) and a queue of
50 ms at the rate; with a delay, ``htb`` for the rate and ``netem`` for the delay (the kernel
needs netem; without it a delay is refused in one line).

What is measured here: the kernel's byte counters of each worker-side interface
(``/sys/class/net/tw-wR/statistics/{tx,rx}_bytes``), which count every frame that crossed the
veth: payload plus Ethernet/IP/TCP headers, ACKs, ARP, rendezvous and setup traffic. veth keeps
the kernel's segmentation offload, so a TCP super-packet of up to 64 KB is counted with one set
of headers (a physical NIC would put one per 1448-byte segment on the wire: ~4.5% more); the
shaper charges the rate on the wire length of every segment either way.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence

from thinwire.errors import UsageError
from thinwire.testbed.rates import Link

PREFIX = "tw-"
SUBNET = "198.18.0"
_STALE = re.compile(r"^tw-(\d+)-")
_counter = itertools.count()


class TestbedError(RuntimeError):
    """A namespace, link or shaping command failed; the message names the command."""


def sh(args: Sequence[str], *, check: bool = True, timeout: float = 20.0) -> str:
    """Run one command (no shell), return stdout; raise TestbedError naming it on failure."""
    try:
        p = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise TestbedError(f"{' '.join(args)}: {exc}") from None
    if check and p.returncode != 0:
        err = (p.stderr.strip() or p.stdout.strip() or f"exit {p.returncode}").splitlines()[-1]
        raise TestbedError(f"{' '.join(args)}: {err}")
    return p.stdout


def unavailable_reason() -> str | None:
    """None when namespaces can be built here; otherwise the one-line reason why not."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "not root: network namespaces and tc need CAP_NET_ADMIN (run as root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' not found: install iproute2"
    probe = f"{PREFIX}{os.getpid()}-probe"
    try:
        sh(["ip", "netns", "add", probe])
    except TestbedError as exc:
        return f"'ip netns add' failed: {exc}"
    sh(["ip", "netns", "del", probe], check=False)
    return None


def list_namespaces() -> list[str]:
    out = sh(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale() -> list[str]:
    """Delete ``tw-<pid>-`` namespaces whose owner pid is dead (a killed run); return them.

    Processes still inside such a namespace (orphaned workers of that run) are killed first,
    by pid, so the namespace really goes away.
    """
    removed = []
    for ns in list_namespaces():
        m = _STALE.match(ns)
        if not m or pid_alive(int(m.group(1))):
            continue
        for pid in sh(["ip", "netns", "pids", ns], check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        sh(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    return removed


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Block SIGINT/SIGTERM/SIGHUP while tearing down, so a second Ctrl-C cannot cut it short."""
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def burst_bytes(bytes_per_s: float) -> int:
    """The token bucket's depth of a link shaped at ``bytes_per_s``: max(32 KiB, 4 ms of it)."""
    return max(32 * 1024, int(bytes_per_s * 0.004))


def shaping_commands(dev: str, link: Link) -> list[list[str]]:
    """The ``tc`` commands shaping the egress of ``dev`` (run inside its namespace)."""
    cmds: list[list[str]] = []
    bps = link.bytes_per_s
    delay = f"{link.delay_s * 1e6:.0f}us"
    if bps is None:
        if link.delay_s:
            cmds.append(["tc", "qdisc", "add", "dev", dev, "root", "netem", "delay", delay,
                         "limit", "10000"])
        return cmds
    burst = burst_bytes(bps)
    limit = burst + int(bps * 0.05)
    rate = f"{int(link.rate_bps or 0)}bit"
    if not link.delay_s:
        cmds.append(["tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                     "burst", str(burst), "limit", str(limit), "overhead", "24"])
        return cmds
    cmds.append(["tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"])
    cmds.append(["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                 "rate", rate, "ceil", rate, "burst", str(burst), "cburst", str(burst),
                 "overhead", "24"])
    cmds.append(["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
                 "delay", delay, "limit", str(max(1000, limit // 1000))])
    return cmds


class Testbed:
    """n worker namespaces on one bridge; a context manager that always tears down.

    ``addr(r)``, ``ifname(r)``, ``namespace(r)`` name worker r's side; ``exec_argv(r, argv)``
    wraps a command to run in worker r's namespace; ``counters()`` reads every worker-side
    interface's (tx_bytes, rx_bytes).
    """

    __test__ = False  # not a pytest class

    def __init__(self, workers: int, link: Link) -> None:
        if not 1 <= workers <= 250:
            raise UsageError(f"--workers {workers}: the testbed supports 1..250 workers")
        self.workers, self.link = workers, link
        self.prefix = f"{PREFIX}{os.getpid()}-{next(_counter)}-"
        self.bridge_ns = self.prefix + "br"
        self.created: list[str] = []

    # --- names -------------------------------------------------------------------------------
    def namespace(self, rank: int) -> str:
        return f"{self.prefix}w{rank}"

    def ifname(self, rank: int) -> str:
        return f"tw-w{rank}"

    def addr(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    def exec_argv(self, rank: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace(rank), *argv]

    # --- build and tear down -----------------------------------------------------------------
    def __enter__(self) -> Testbed:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, ns: str) -> None:
        sh(["ip", "netns", "add", ns])
        self.created.append(ns)
        sh(["ip", "netns", "exec", ns, "sh", "-c",
            "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6; "
            "echo 1 > /proc/sys/net/ipv6/conf/all/disable_ipv6"])

    def build(self) -> None:
        br, n = self.bridge_ns, self.workers
        self._add_ns(br)
        sh(["ip", "-n", br, "link", "add", "tw-br", "type", "bridge"])
        sh(["ip", "-n", br, "link", "set", "tw-br", "up"])
        for r in range(n):
            ns, dev, peer = self.namespace(r), self.ifname(r), f"tw-b{r}"
            self._add_ns(ns)
            sh(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", peer,
                "netns", br])
            sh(["ip", "-n", br, "link", "set", peer, "master", "tw-br", "up"])
            sh(["ip", "-n", ns, "addr", "add", f"{self.addr(r)}/24", "dev", dev])
            sh(["ip", "-n", ns, "link", "set", dev, "up"])
            sh(["ip", "-n", ns, "link", "set", "lo", "up"])
            for where, d in ((ns, dev), (br, peer)):
                for cmd in shaping_commands(d, self.link):
                    self._tc(where, cmd)

    def _tc(self, ns: str, cmd: list[str]) -> None:
        try:
            sh(["ip", "netns", "exec", ns, *cmd])
        except TestbedError as exc:
            if "netem" in cmd and "unknown" in str(exc).lower():
                raise UsageError("--delay needs the netem qdisc, which this kernel lacks "
                                 "(CONFIG_NET_SCH_NETEM); use --delay 0 or --modelled") from None
            raise

    def close(self) -> None:
        """Delete every namespace this testbed created (their veths and bridge go with them)."""
        with signals_deferred():
            errors = []
            for ns in reversed(self.created):
                for pid in sh(["ip", "netns", "pids", ns], check=False).split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                try:
                    sh(["ip", "netns", "del", ns])
                except TestbedError as exc:
                    errors.append(str(exc))
            self.created.clear()
            left = [ns for ns in list_namespaces() if ns.startswith(self.prefix)]
        if errors or left:
            raise TestbedError(f"teardown incomplete: {'; '.join(errors) or ', '.join(left)}")

    # --- measurement -------------------------------------------------------------------------
    def counters(self) -> list[tuple[int, int]]:
        """(tx_bytes, rx_bytes) of every worker-side interface, read from the kernel."""
        out = []
        for r in range(self.workers):
            stats = f"/sys/class/net/{self.ifname(r)}/statistics"
            text = sh(self.exec_argv(r, ["cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"]))
            tx, rx = (int(v) for v in text.split())
            out.append((tx, rx))
        return out
