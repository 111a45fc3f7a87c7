"""Encode + decode throughput of every codec, against a plain copy, on this machine.

For each codec (the codec alone: no error feedback, no communication) and each size d of fp32
input, time ``decode(encode(x), out=y)`` -- decoded into a preallocated buffer, as the exchange
decodes into the DDP bucket -- and report GB/s of fp32 input (4 d bytes / seconds, median of the
repeats), next to the bandwidth of a plain copy measured in the same run (``y.copy_(x)`` into a
preallocated buffer, and ``x.clone()``), so a codec's cost reads as a fraction of a copy's
speed; beside it the floor of any codec that reads x and writes y: one read of x (``x.sum()``)
and one write of y (``y.zero_()``), each timed alone. Each repeat times the copy and every
codec in turn, each timed call right after an untimed
call of the same row (steady state: the row's code, tables and buffers warm), and each cell is
the median of its repeats; a second table splits each codec's time into encode and decode, in units of the
copy's time (a copy reads x once and writes y once); with PowerSGD among the codecs, a third
compares its encode + decode with the products it must compute on the same matrix (M Q, the
QR, M^T P, and the decode's P Q^T), each timed alone (``powersgd_floor``). Sizes are in M = 2^20 floats. Default: 1M, 16M, 64M with 11 / 7 / 5 repeats, on one
torch thread (a DDP worker's share of a small host, and immune to the stalls a 2-thread pool
shows on a shared machine); ``--sizes 1M`` for a quick run; ``--device cuda`` times the device
paths (synchronised around every call). ``--clock cpu`` times with this thread's CPU time
instead of the wall clock: on an oversubscribed host the wall clock mostly measures the time
other processes hold the core.

    python benchmarks/compress_throughput.py [--sizes 1M,16M,64M] [--repeats N] [--threads T]
                                             [--device cpu|cuda] [--codecs topk,int8,...]
                                             [--clock wall|cpu] [--paths compiled,torch]
                                             [--ratio 0.01]
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from collections.abc import Callable

import torch

from thinwire import kernels
from thinwire.compression import (
    QSGD,
    Cast,
    Compressor,
    Int8,
    PowerSGD,
    RandK,
    ScaledSign,
    TopK,
)
from thinwire.compression.fp4 import FP4
from thinwire.compression.fp8 import FP8
from thinwire.compression.powersgd import square_shape

MI = 2**20
POWERSGD_RANK = 2

PATHS = {"[compiled]": "1", "[torch]": "0"}
"""Row suffix -> :mod:`thinwire.kernels` mode: the compiled kernels or the pure-torch/numpy
path (the codecs without kernels, fp16, bf16 and PowerSGD, run the same code on both)."""


def codecs(ratio: float = 0.01) -> dict[str, Compressor]:
    """Each codec with its registry defaults (ratio 0.01, 16 levels, chunk 512 / 256 for fp4,
    e4m3 for fp8, rank 2), without error feedback, top-k's and Rand-k's ratio as given;
    ``topk~`` is top-k with ``approx=True``. The identity is left out: its encode and decode
    are views of the input."""
    return {
        "fp16": Cast(torch.float16), "bf16": Cast(torch.bfloat16),
        "topk": TopK(ratio), "topk~": TopK(ratio, approx=True), "randk": RandK(ratio),
        "qsgd": QSGD(16), "int8": Int8(), "fp8": FP8(), "fp4": FP4(), "sign": ScaledSign(),
        "powersgd": PowerSGD(POWERSGD_RANK),
    }


def sync(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def seconds(fn: Callable[[], object], device: torch.device | None = None,
            clock: Callable[[], float] = time.perf_counter) -> float:
    sync(device)
    t0 = clock()
    fn()
    sync(device)
    return clock() - t0


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def default_repeats(numel: int) -> int:
    return 11 if numel <= MI else 7 if numel <= 16 * MI else 5


def parse_sizes(text: str) -> list[int]:
    return [int(float(s.strip().upper().rstrip("M")) * MI) for s in text.split(",") if s.strip()]


def measure(numel: int, repeats: int, chosen: dict[str, Compressor], device: torch.device,
            clock: Callable[[], float]) -> dict[str, tuple[float, float, float]]:
    """Median seconds (total, encode, decode) of a copy and each codec at one size: every
    repeat times the copy and then each codec in turn (interleaved, so a change of load on a
    shared host hits all of them alike), and each cell is the median of its repeats. Each
    timed call directly follows an untimed call of the same row (the codec at another step), so
    every row is timed in the state a codec called on every bucket of every step runs in: its
    code, tables and buffers warm, x in the caches as far as its size allows, as for the copy
    (without it a row pays for what the rows before it evicted: at 1M a decode cost up to twice
    as much)."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0)).to(device)
    y = torch.empty_like(x)
    y.copy_(x)
    base: dict[str, Callable[[], object]] = {
        "memcpy (copy_)": lambda: y.copy_(x), "memcpy (clone)": lambda: x.clone(),
        "read x (sum)": lambda: x.sum(), "write y (zero_)": lambda: y.zero_()}
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in base}
    times.update({name: [] for name in chosen})

    def codec(c: Compressor, i: int, path: str) -> tuple[float, float, float]:
        with kernels.forced(path):
            sync(device)
            t0 = clock()
            payload = c.encode(x, i)
            sync(device)
            t1 = clock()
            c.decode(payload, numel, i, out=y)
            sync(device)
            t2 = clock()
        return t2 - t0, t1 - t0, t2 - t1

    for i in range(repeats):
        for name, fn in base.items():
            fn()  # each timed call follows an untimed one of the same row (steady state)
            t = seconds(fn, device, clock)
            times[name].append((t, t, 0.0))
        y.copy_(x)
        for name, comp in chosen.items():
            path = PATHS[name.rpartition(" ")[2]]
            codec(comp, 2 * i, path)
            times[name].append(codec(comp, 2 * i + 1, path))
    return {name: (median([t[0] for t in ts]), median([t[1] for t in ts]),
                   median([t[2] for t in ts])) for name, ts in times.items()}


def powersgd_floor(numel: int, repeats: int, rank: int, device: torch.device,
                   clock: Callable[[], float]) -> dict[str, float]:
    """Median seconds of the products PowerSGD's codec must compute on its near-square matrix
    M (n x m) at ``rank`` r, each alone: step 1's M Q, step 3's reduced QR of the n x r result,
    step 4's M^T P and the decode's P Q^T (into a preallocated n x m buffer). Each product is
    timed in two layouts, as written (``M @ Q``, ``M.T @ P``, ``torch.mm(P, Q.T, out=)``) and
    in the one that reads M row by row (Q's columns contiguous, ``(P^T M)^T``); a ``*`` key
    holds the faster of the two, the floor."""
    n, m = square_shape(numel)
    mat = torch.randn(n, m, generator=torch.Generator().manual_seed(1)).to(device)
    q = torch.randn(m, rank, generator=torch.Generator().manual_seed(2)).to(device)
    qt, p = q.t().contiguous(), torch.linalg.qr(mat @ q).Q
    pc, y = p.contiguous(), torch.empty(n, m, device=device)
    fns: dict[str, Callable[[], object]] = {
        "M Q": lambda: mat @ q, "M Q (Q^T stored)": lambda: mat @ qt.t(),
        "QR": lambda: torch.linalg.qr(pc),
        "M^T P": lambda: mat.t() @ pc, "M^T P as (P^T M)^T": lambda: pc.t() @ mat,
        "P Q^T": lambda: torch.mm(pc, q.t(), out=y), "P Q^T (Q^T stored)":
            lambda: torch.mm(pc, qt, out=y)}
    times = {k: median([seconds(f, device, clock) for _ in range(repeats)])
             for k, f in fns.items()}
    for short in ("M Q", "M^T P", "P Q^T"):
        times[short + " *"] = min(t for k, t in times.items() if k.startswith(short))
    return times


def print_powersgd_floor(sizes: list[int], rows: dict[str, list[tuple[float, float, float]]],
                         floors: list[dict[str, float]], labels: list[str]) -> None:
    """PowerSGD's encode + decode against the products it must compute (powersgd_floor)."""
    copy = [t[0] for t in rows["memcpy (copy_)"]]
    print()
    print("PowerSGD against its products' floor (seconds in copies of the input; the products "
          "alone, each in the layout as written / the faster layout; floor: M Q + QR + M^T P "
          "+ P Q^T at the faster layout)")
    print()
    print("| size | n x m | M Q | QR | M^T P | P Q^T | floor: two matmuls + QR | floor + decode's "
          "P Q^T | codec | codec / floor (two matmuls + QR) | codec / floor + P Q^T |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|---|---|")
    for i, (numel, f, label) in enumerate(zip(sizes, floors, labels)):
        c = copy[i]
        n, m = square_shape(numel)
        two = f["M Q *"] + f["QR"] + f["M^T P *"]
        allf = two + f["P Q^T *"]
        codec = {k.rpartition(" ")[2]: v[i][0] for k, v in rows.items()
                 if k.startswith("powersgd ")}
        ctext = ", ".join(f"{p} {t / c:.2f}" for p, t in codec.items())
        r2 = ", ".join(f"{p} {t / two:.2f}x" for p, t in codec.items())
        r3 = ", ".join(f"{p} {t / allf:.2f}x" for p, t in codec.items())
        print(f"| {label} | {n} x {m} | {f['M Q'] / c:.2f} / {f['M Q *'] / c:.2f} | "
              f"{f['QR'] / c:.2f} | {f['M^T P'] / c:.2f} / {f['M^T P *'] / c:.2f} | "
              f"{f['P Q^T'] / c:.2f} / {f['P Q^T *'] / c:.2f} | {two / c:.2f} | {allf / c:.2f} | "
              f"{ctext} | {r2} | {r3} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1M,16M,64M", help="input sizes in M = 2^20 floats")
    ap.add_argument("--repeats", type=int, default=0,
                    help="interleaved repeats per size, median taken (0: 11/7/5 by size)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: as one worker of a loaded host; copy uses the same)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (or cuda:N)")
    ap.add_argument("--codecs", default="", help="comma-separated subset (default: all)")
    ap.add_argument("--ratio", type=float, default=0.01,
                    help="fraction of elements top-k and Rand-k keep (default 0.01)")
    ap.add_argument("--paths", default="compiled,torch",
                    help="compiled (thinwire.kernels), torch (the pure-torch/numpy path) or "
                         "both, one row each")
    ap.add_argument("--clock", default="wall", choices=sorted(CLOCKS),
                    help="wall: elapsed time; cpu: this thread's CPU time (leaves out the time "
                         "other processes hold the core: for an oversubscribed host; CPU only)")
    args = ap.parse_args(argv)
    if args.clock == "cpu" and torch.device(args.device).type != "cpu":
        ap.exit(2, f"--clock cpu times CPU work only; use --clock wall with --device "
                   f"{args.device}\n")
    if args.codecs and set(args.codecs.split(",")) - set(codecs()):
        unknown = ",".join(sorted(set(args.codecs.split(",")) - set(codecs())))
        ap.exit(2, f"--codecs: unknown {unknown}; choose from {','.join(codecs())}\n")
    if not 0 < args.ratio <= 1:
        ap.exit(2, f"--ratio {args.ratio}: use a fraction in (0, 1]\n")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sizes = parse_sizes(args.sizes)
    every = codecs(args.ratio)
    names = args.codecs.split(",") if args.codecs else list(every)
    paths = [p for p in args.paths.split(",") if p]
    if set(paths) - {"compiled", "torch"}:
        ap.exit(2, f"--paths {args.paths}: use compiled, torch or compiled,torch\n")
    if "compiled" in paths and device.type == "cpu" and not kernels.available():
        ap.exit(2, "--paths compiled: the compiled kernels cannot be built here (no C++ "
                   "compiler); use --paths torch\n")
    # one codec object a row: no cache (Rand-k's indices) is shared between two rows
    chosen = {f"{n} [{p}]": codecs(args.ratio)[n] for n in names for p in paths}
    for name, comp in chosen.items():  # warm-up: first calls allocate and load kernels
        w = torch.randn(4096, device=device)
        with kernels.forced(PATHS[name.rpartition(" ")[2]]):
            comp.decode(comp.encode(w, 0), 4096, 0, out=torch.empty_like(w))
    ratios = {name: comp.nominal_ratio(sizes[0]) for name, comp in chosen.items()}
    print(f"kernels: {kernels.mode()} ({'built' if kernels.available() else 'unavailable'}), "
          f"host {platform.processor() or platform.machine()}")
    rows: dict[str, list[tuple[float, float, float]]] = {}
    floors: list[dict[str, float]] = []
    for numel in sizes:
        repeats = args.repeats or default_repeats(numel)
        cells = measure(numel, repeats, chosen, device, CLOCKS[args.clock])
        for name, cell in cells.items():
            rows.setdefault(name, []).append(cell)
        if "powersgd" in names:
            floors.append(powersgd_floor(numel, repeats, POWERSGD_RANK, device,
                                         CLOCKS[args.clock]))
    copy = [t[0] for t in rows["memcpy (copy_)"]]
    labels = [f"{n / MI:g}M" for n in sizes]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    print(f"torch {torch.__version__}, {device.type} ({where}), {torch.get_num_threads()} "
          f"thread(s), {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, "
          f"{args.clock} clock; GB/s of fp32 input (encode + decode into a preallocated "
          f"buffer, median of {args.repeats or '11/7/5'} interleaved repeats by size); ratio at "
          f"{labels[0]}; in brackets: fraction of copy_")
    print()
    print("| compressor | ratio | " + " | ".join(labels) + " |")
    print("|---|---:|" + "---:|" * len(sizes))
    for name, timed in rows.items():
        ratio = f"{ratios[name]:.1f}x" if name in ratios else ""
        text = [f"{4 * n / 1e9 / t[0]:.2f} ({c / t[0]:.0%})"
                for n, t, c in zip(sizes, timed, copy)]
        print(f"| {name} | {ratio} | " + " | ".join(text) + " |")
    print()
    print("Time of encode + decode in copies (median time / copy_'s median time): "
          "encode + decode")
    print()
    print("| compressor | " + " | ".join(labels) + " |")
    print("|---|" + "---:|" * len(sizes))
    for name in chosen:
        text = [f"{t[1] / c:.2f} + {t[2] / c:.2f}" for t, c in zip(rows[name], copy)]
        print(f"| {name} | " + " | ".join(text) + " |")
    if floors:
        print_powersgd_floor(sizes, rows, floors, labels)


if __name__ == "__main__":
    main()
