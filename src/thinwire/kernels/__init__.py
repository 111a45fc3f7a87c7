"""Compiled CPU kernels for the codecs' and SLIDE's hot loops, with the pure-torch path kept.

The mechanism (docs/ARCHITECTURE.md, "Compiled CPU kernels", says why this one): one C++17 file,
``thinwire_kernels.cpp``, with a C ABI and no torch or Python headers, compiled by the system's
C++ compiler (``$CXX``, else ``g++``, else ``c++``) into a shared library and called through
:mod:`ctypes` on tensors' data pointers:

  1. the first call that wants a kernel (or ``python -m thinwire.kernels``, which ``make``
     runs) looks for the library in the cache, ``$THINWIRE_KERNELS_CACHE`` or
     ``$XDG_CACHE_HOME/thinwire/kernels`` (``~/.cache/thinwire/kernels``), under a name hashed
     from the source, the flags, the compiler's version and this CPU's feature flags (so a
     shared home directory serves different machines, and an edit rebuilds);
  2. if it is missing, it compiles it (``-O3 -march=native -ffp-contract=off``: no fused
     multiply-adds, so every kernel rounds exactly as torch and numpy do) into a temporary file
     under a file lock and renames it into place (concurrent processes build it once);
  3. if there is no compiler or the build fails, one line on stderr says so and every caller
     takes its pure-torch/numpy path.

Which path runs: ``THINWIRE_KERNELS=0`` the pure path, ``=1`` the compiled one (an error naming
the fix if it cannot be built), unset or ``auto`` the compiled one where it builds; in code
:func:`set_mode` and the context manager :func:`forced` (the tests run both paths through it).
Only float32 CPU tensors take the kernels; every other device and dtype takes the torch path,
which stays the reference the tests compare the kernels with. Kernels use up to
``torch.get_num_threads()`` threads: the calling thread and workers kept between calls (a
thread started per call cost tens of microseconds, more than a codec's work on 1M floats),
which claim the blocks of a call from a shared counter, so a worker the scheduler runs late
finds them done and the caller does not wait for it; a forked child starts its own workers.
The same bits on any thread count.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("thinwire_kernels.cpp")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-std=c++17",
         "-shared", "-fPIC", "-pthread")
"""Compiler flags. ``-ffp-contract=off`` keeps each multiply and add rounded on its own (as in
torch and numpy); ``-fno-math-errno`` only lets floor and rint compile to one instruction."""

MODES = ("auto", "0", "1")

_mode: str | None = None  # set_mode's override of $THINWIRE_KERNELS
_lib: ctypes.CDLL | None = None
_failure: str | None = None  # why the library could not be had (said once)
_said = False

_p = ctypes.c_void_p
_i64 = ctypes.c_int64
_int = ctypes.c_int
_f32 = ctypes.c_float
_u32 = ctypes.c_uint32
SIGNATURES: dict[str, tuple[object, tuple[object, ...]]] = {
    "thinwire_kernels_version": (_int, ()),
    "int8_encode": (None, (_p, _i64, _i64, _p, _p, _int)),
    "int8_decode": (None, (_p, _p, _i64, _i64, _p, _int)),
    "sign_encode": (None, (_p, _i64, _p, _p, _int)),
    "sign_decode": (None, (_p, _i64, _f32, _p, _int, _int)),
    "qsgd_encode_counter": (None, (_p, _i64, _f32, _u32, _u32, _u32, _p, _int, ctypes.c_int32,
                                   _int)),
    "qsgd_decode": (None, (_p, _int, _i64, _f32, _p, _int)),
    "sum_squares": (ctypes.c_double, (_p, _i64, _int)),
    "topk_encode": (_int, (_p, _i64, _i64, _i64, _i64, _i64, _p, _int, _p, _int)),
    "fp8_encode": (None, (_p, _i64, _i64, _int, _p, _p, _int)),
    "fp8_decode": (None, (_p, _p, _i64, _i64, _int, _p, _int)),
    "fp4_encode": (None, (_p, _i64, _i64, _p, _p, _int)),
    "fp4_decode": (None, (_p, _p, _i64, _i64, _p, _int)),
    "scatter_decode": (None, (_p, _p, _int, _i64, _p, _i64, _int, _int)),
    "randk_gather": (None, (_p, _i64, _i64, _u32, _u32, _u32, _p, _int)),
    "randk_scatter": (None, (_p, _i64, _i64, _u32, _u32, _u32, _int, _p, _int, _int)),
    "lowrank_decode": (None, (_p, _p, _i64, _i64, _i64, _i64, _p, _int)),
    "slide_touched_rows": (_i64, (_p, _i64, _i64, _p, _p, _p)),
    "slide_forward_rows": (None, (_p, _p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _p, _int)),
    "slide_backward_rows": (None, (_p, _p, _p, _p, _p, _p, _p, _i64, _i64, _i64, _i64, _p, _p,
                                   _p, _int)),
    "advise_huge_pages": (_int, (_p, _i64)),
    "slide_softmax_loss": (None, (_p, _p, _p, _p, _i64, _i64, _i64, _i64, _p, _p, _p, _p, _p, _p,
                                  _int)),
    "slide_softmax_loss_backward": (None, (_p, _p, _p, _p, _i64, _i64, ctypes.c_double, _p,
                                           _int)),
    "lsh_simhash_codes": (None, (_p, _i64, _i64, _i64, _p, _int)),
    "lsh_dwta_codes": (None, (_p, _i64, _i64, _p, _i64, _i64, _i64, _p, _i64, _p, _i64, _p,
                              _int)),
    "lsh_build": (None, (_p, _p, _i64, _i64, _i64, _p, _p, _int)),
    "lsh_vanilla": (_int, (_p, _p, _p, _i64, _i64, _i64, _i64, _i64, _p, _p, _i64, _i64, _p, _p,
                           _int)),
    "lsh_fill": (None, (_p, _p, _i64, _i64, _i64, _p, _int)),
    "lsh_topk": (None, (_p, _p, _p, _i64, _i64, _i64, _i64, _i64, _p, _i64, _p, _p, _i64, _p,
                        _p, _int)),
}


def mode() -> str:
    """The path asked for: ``0`` pure torch, ``1`` compiled (required), ``auto``."""
    if _mode is not None:
        return _mode
    value = os.environ.get("THINWIRE_KERNELS", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise ValueError(f"THINWIRE_KERNELS={value!r}: use 0 (pure torch), 1 (compiled "
                         "kernels, required) or auto (compiled where a compiler is found)")
    return value


def set_mode(value: str | bool | None) -> None:
    """Force a path for this process: True / ``"1"`` compiled, False / ``"0"`` pure torch,
    ``"auto"``; None goes back to ``$THINWIRE_KERNELS``."""
    global _mode
    if isinstance(value, bool):
        value = "1" if value else "0"
    if value is not None and value not in MODES:
        raise ValueError(f"kernels mode {value!r}: use True, False, '0', '1' or 'auto'")
    _mode = value


@contextmanager
def forced(value: str | bool | None) -> Iterator[None]:
    """:func:`set_mode` for the duration of a ``with`` block."""
    global _mode
    before = _mode
    set_mode(value)
    try:
        yield
    finally:
        _mode = before


def cache_dir() -> Path:
    """Where the built library lives (step 1)."""
    if os.environ.get("THINWIRE_KERNELS_CACHE"):
        return Path(os.environ["THINWIRE_KERNELS_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "thinwire" / "kernels"


def compiler() -> str | None:
    """The C++ compiler: ``$CXX``, else ``g++``, else ``c++`` on the PATH; None if none."""
    for name in ([os.environ["CXX"]] if os.environ.get("CXX") else []) + ["g++", "c++"]:
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor()


def library_path(cxx: str) -> Path:
    """The library's file for this source, flags, compiler and CPU (step 1)."""
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
    h = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(FLAGS).encode(), version.encode(),
                 _cpu_flags().encode(), platform.machine().encode()):
        h.update(part)
        h.update(b"\0")
    return cache_dir() / f"thinwire_kernels-{h.hexdigest()[:16]}.so"


def build(verbose: bool = False) -> Path:
    """Steps 1-2: the path of the built library, compiling it if it is not in the cache.
    Raises RuntimeError (one line naming the fix) without a compiler or when the build fails."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set $CXX, or install g++: apt-get install "
                           "g++)")
    target = library_path(cxx)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():  # another process built it while this one waited
            return target
        t0 = time.perf_counter()
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            done = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True,
                                  text=True, timeout=300)
            if done.returncode != 0:
                first = (done.stderr.strip().splitlines() or ["(no message)"])[0]
                raise RuntimeError(f"{cxx} could not build {SOURCE.name}: {first}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        if verbose:
            print(f"built {target} in {time.perf_counter() - t0:.2f} s")
    return target


def _load() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    for name, (res, args) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    return lib


def lib() -> ctypes.CDLL | None:
    """The compiled kernels if this process should use them (the mode and step 3), else None:
    the caller then takes its pure-torch path."""
    global _lib, _failure, _said
    m = mode()
    if m == "0":
        return None
    if _lib is None and _failure is None:
        try:
            _lib = _load()
        except (RuntimeError, OSError, subprocess.SubprocessError) as e:
            _failure = str(e)
    if _lib is not None:
        return _lib
    if m == "1":
        raise RuntimeError(f"THINWIRE_KERNELS=1 but the compiled kernels are unavailable: "
                           f"{_failure}; unset THINWIRE_KERNELS to run the pure-torch path")
    if not _said:
        _said = True
        print(f"thinwire: compiled CPU kernels unavailable ({_failure}); using the pure-torch "
              "path", file=sys.stderr)
    return None


def available() -> bool:
    """Whether the compiled kernels can be had on this machine (builds them if needed)."""
    with forced("auto"):
        return lib() is not None


def threads() -> int:
    """Threads a kernel may use: torch's intra-op thread count."""
    return max(1, torch.get_num_threads())


def ptr(t: torch.Tensor) -> int:
    """A tensor's data pointer (its storage is kept alive by the caller)."""
    return t.data_ptr()


HUGE_BYTES = 4 << 20
"""Buffers of at least this many bytes are offered 2 MiB pages (:func:`empty_huge`)."""


def empty_huge(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``torch.empty(*shape)`` on the CPU, backed by 2 MiB pages where the kernels are built,
    the buffer has at least :data:`HUGE_BYTES` and the OS allows it (Linux's transparent huge
    pages in ``madvise`` mode: ``advise_huge_pages`` in the C++ file says why); asked before
    the first write, so the pages are faulted in 2 MiB at a time."""
    t = torch.empty(*shape, dtype=dtype, device="cpu")
    nbytes = t.numel() * t.element_size()
    if nbytes >= HUGE_BYTES:
        lib_ = lib()
        if lib_ is not None:
            lib_.advise_huge_pages(t.data_ptr(), nbytes)
    return t


def wants(x: torch.Tensor) -> ctypes.CDLL | None:
    """The kernels if they apply to ``x`` (a contiguous float32 CPU tensor), else None."""
    if not x.is_cpu or x.dtype is not torch.float32 or not x.is_contiguous():
        return None
    return lib()


__all__ = ["available", "build", "cache_dir", "empty_huge", "forced", "lib", "mode", "set_mode",
           "threads", "wants"]
