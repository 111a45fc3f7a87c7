"""What a message costs on the thin-wire testbed's shaped links, beside bytes / rate: the three
effects the planner's pipeline simulation (:func:`thinwire.planner.pipeline.simulate`) models
with ``burst``, ``rendezvous`` and ``acks_queue``.

    sudo python benchmarks/link_probe.py --link 100mbit

Namespaces and links are the testbed's own (:class:`thinwire.testbed.netns.Testbed`); every
message is 131072 bytes (one uncompressed boundary of the pipeline benchmark), each figure the
median of 30 messages after 5 untimed ones:

1. **token bucket**: plain TCP, worker 0 sends worker 1 a message, worker 1 answers one byte
   when it has all of it; after 20 ms of idling (tbf's bucket full) and back to back;
2. **rendezvous**: gloo through thinwire's ``Comm`` (the pipeline's own calls), worker 0 posts
   ``isend`` at once, worker 1 is busy 0, 5 or 20 ms before it calls ``recv``; how long
   ``recv`` then waits (an eager transport would have the message in by 20 ms and return at
   once);
3. **acknowledgements behind data**: plain TCP, worker 0 sends worker 1 a message, alone and
   while worker 1 is itself sending worker 2 a message of the same size; the time until worker
   1 has all of worker 0's.

Probes 1 and 3 use plain TCP sockets on purpose: they measure the link and the kernel's queue,
not a training method, so no ledger is involved. Needs root; tears the namespaces down on every
exit. Bounded by ``--timeout`` seconds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from thinwire.testbed.netns import Testbed

N = 131072

_SINK = r'''
import socket, sys
n, addr, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((addr, port)); s.listen(1); c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
try:
    while True:
        got = 0
        while got < n:
            b = c.recv(1 << 20)
            if not b:
                sys.exit(0)
            got += len(b)
        c.sendall(b"k")
except OSError:  # the source was stopped
    sys.exit(0)
'''

_SOURCE = r'''
import socket, statistics, sys, time
n, addr, port, gap, reps = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5])
c = socket.socket()
for _ in range(100):
    try:
        c.connect((addr, port)); break
    except OSError:
        time.sleep(0.05)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf, ts = b"x" * n, []
for i in range(reps + 5):
    time.sleep(gap)
    t0 = time.perf_counter(); c.sendall(buf); c.recv(1); ts.append(time.perf_counter() - t0)
print(statistics.median(ts[5:]))
'''

_GLOO = r'''
import os, statistics, sys, time, torch, torch.distributed as dist
from thinwire.runtime.comm import Comm
rank, addr, ifname, reps = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
os.environ["GLOO_SOCKET_IFNAME"] = ifname
dist.init_process_group("gloo", init_method=f"tcp://{addr}:29611", rank=rank, world_size=2)
comm = Comm()
buf = torch.zeros(int(sys.argv[5]), dtype=torch.uint8)
for busy in (0.0, 0.005, 0.02):
    waits = []
    for i in range(reps + 5):
        comm.barrier(); time.sleep(0.03)
        if rank == 0:
            comm.isend(buf, 1, tag="probe").wait()
        else:
            time.sleep(busy); t0 = time.perf_counter(); comm.recv(buf, 0, tag="probe")
            waits.append(time.perf_counter() - t0)
    if rank == 1:
        print(busy, statistics.median(waits[5:]), flush=True)
comm.barrier(); dist.destroy_process_group()
'''


def _in(tb: Testbed, rank: int, code: str, *args: object) -> list[str]:
    return tb.exec_argv(rank, [sys.executable, "-c", code, *map(str, args)])


def _timed_sends(tb: Testbed, src: int, dst: int, port: int, gap: float, reps: int,
                 timeout: float) -> float:
    """Median seconds for ``src`` to hand ``dst`` a message and hear it arrived."""
    addr = tb.addr(dst)
    sink = subprocess.Popen(_in(tb, dst, _SINK, N, addr, port))
    try:
        out = subprocess.run(_in(tb, src, _SOURCE, N, addr, port, gap, reps),
                             capture_output=True, text=True, timeout=timeout, check=True)
        return float(out.stdout.strip())
    finally:
        sink.kill()
        sink.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--link", default="100mbit")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--out", default="", help="also write the table to this file")
    args = p.parse_args(argv)

    from thinwire.testbed.modelled import FRAME_EFFICIENCY
    from thinwire.testbed.netns import Testbed, burst_bytes, unavailable_reason
    from thinwire.testbed.rates import parse_links

    reason = unavailable_reason()
    if reason:
        print(f"link_probe: no network namespaces ({reason})", file=sys.stderr)
        return 2
    link = parse_links(args.link, "0")[0]
    if not link.rate_bps:
        print("link_probe: --link needs a rate, e.g. 100mbit", file=sys.stderr)
        return 2
    goodput = link.rate_bps / 8 * FRAME_EFFICIENCY
    bucket = burst_bytes(link.rate_bps / 8) * FRAME_EFFICIENCY
    per = args.timeout / 4
    rows: list[tuple[str, str, float, float | None]] = []
    with Testbed(3, link) as tb:
        idle = _timed_sends(tb, 0, 1, 29601, 0.02, args.reps, per)
        busy = _timed_sends(tb, 0, 1, 29602, 0.0, args.reps, per)
        rows += [("token bucket", "after 20 ms idle", idle, max(0.0, N - bucket) / goodput),
                 ("token bucket", "back to back", busy, N / goodput)]
        ps = [subprocess.Popen(_in(tb, r, _GLOO, r, tb.addr(0), tb.ifname(r), args.reps, N),
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
              for r in range(2)]
        outs = [q.communicate(timeout=per)[0] for q in ps]
        for line in outs[1].strip().splitlines():
            busy_s, wait = (float(v) for v in line.split())
            rows.append(("rendezvous", f"receiver busy {busy_s * 1e3:.0f} ms first",
                         wait, max(0.0, N - bucket) / goodput))
        # 3: worker 1 sends worker 2 while worker 0 sends worker 1
        side = subprocess.Popen(_in(tb, 2, _SINK, N, tb.addr(2), 29604))
        try:
            load = subprocess.Popen(_in(tb, 1, _SOURCE, N, tb.addr(2), 29604, 0.0, 100000),
                                    stdout=subprocess.DEVNULL)
            time.sleep(0.5)
            both = _timed_sends(tb, 0, 1, 29603, 0.02, args.reps, per)
            load.kill()
            load.wait()
        finally:
            side.kill()
            side.wait()
        rows += [("acks behind data", "receiver's upload idle", idle,
                  max(0.0, N - bucket) / goodput),
                 ("acks behind data", "receiver's upload sending", both, None)]
    lines = [f"{args.link}: {N} bytes a message; 'at the rate' = what the bytes take at "
             f"{goodput * 8 / 1e6:.1f} Mbit/s of TCP payload after the {bucket / 1e3:.0f} KB "
             "bucket (all of them back to back)", "",
             "| effect | case | measured ms | at the rate ms |", "|---|---|--:|--:|"]
    for effect, case, t, want in rows:
        lines.append(f"| {effect} | {case} | {t * 1e3:.2f} | "
                     + (f"{want * 1e3:.2f} |" if want is not None else "- |"))
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
