"""Run directories: where a run writes, and the only places thinwire ever deletes.

Guarantees (each tested in ``tests/reliability/test_rundir.py``):

- **Names.** A run name is one plain path component: not empty, not ``.`` or ``..``, no ``/`` or
  ``\\``, no NUL or other control character, no leading ``.`` (hidden names are thinwire's own:
  lock and staging entries), at most :data:`MAX_NAME` characters. Anything else is a one-line
  :class:`~thinwire.errors.UsageError` naming the fix (:func:`check_name`), so a run directory is
  always a direct child of the output root.
- **Ownership.** Every run directory thinwire creates holds the marker file :data:`MARKER`.
  thinwire deletes or replaces only marked directories that are direct children of the output
  root (or hidden entries it made there), never anything else. A directory without the marker is
  never written into, replaced or removed: the error names it (:func:`open_run`).
- **Modes.** With nothing at ``OUT/NAME`` a new run is created in place (a failed first run
  stays there, resumable, destroying nothing). An existing run is reused only with ``resume``
  (in place, under the lock: checkpoints are only ever added atomically and pruned after a newer
  one is complete, so a failed resume keeps the previous checkpoints) and replaced only with
  ``overwrite``: the new run writes into the staging directory ``OUT/.NAME.staging`` and is
  swapped into place by :meth:`RunDir.commit` only after it succeeded (an atomic
  ``renameat2(RENAME_EXCHANGE)`` where the file system has it, else two renames that
  :func:`open_run` completes after a crash). A failed or interrupted replacement removes its
  staging directory and leaves the previous run exactly as it was.
- **One job per run directory.** :func:`open_run` takes an exclusive ``flock`` on
  ``OUT/.NAME.lock`` and keeps it until :meth:`RunDir.close`; the kernel drops it when the
  launching process exits in any way (the descriptor is not inherited by workers). A second job
  on the same directory fails at once with one line naming the directory and the holder's pid.
- **Writes.** :func:`write_text` writes a temporary file beside the target, fsyncs and renames
  it: a target is either the old or the new content, never empty or partial; on any
  ``OSError`` (ENOSPC, EDQUOT, EROFS, EACCES...) the temporary file is removed and the error is
  one line naming the errno and the path (:func:`describe_os_error`).
- **Output root.** It is created when missing; one that is a file, cannot be created or is not
  writable is a one-line error (:func:`check_out`).

The caller holds a :class:`RunDir` for the whole job::

    with rundir.open_run(cfg.run.out, cfg.run_name, resume=..., overwrite=...) as rd:
        rundir.write_text(rd.path / "config.toml", text)
        launch(rd.path, workers)
        rd.commit()

Leaving the ``with`` block without :meth:`RunDir.commit` (an exception, Ctrl-C) discards a
replacement's staging directory; the lock is released either way.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

from thinwire.errors import UsageError

MARKER = ".thinwire-run"
"""The file that marks a directory as a thinwire run directory (JSON: creator and version)."""

MAX_NAME = 100
"""Longest run name: leaves room for ``.NAME.staging`` within the 255-byte name limit."""

Mode = Literal["new", "resume", "replace"]


# --- names and the output root ------------------------------------------------------------------
def check_name(name: str) -> str:
    """``name`` if it is one plain path component (see the module docstring), else UsageError."""
    fix = "use a plain name such as dp-lr0.1 (letters, digits, - _ +), and --run.out for the folder"
    if not isinstance(name, str) or not name:
        raise UsageError(f"run.name: empty; {fix}")
    shown = ascii(name) if len(name) <= 60 else ascii(name[:60]) + "..."
    if name in (".", ".."):
        raise UsageError(f"run.name: {shown} is not a directory name; {fix}")
    if "/" in name or "\\" in name or (os.sep in name) or (os.altsep and os.altsep in name):
        raise UsageError(f"run.name: {shown} contains a path separator; {fix}")
    if any(ord(c) < 32 or ord(c) == 127 for c in name):
        raise UsageError(f"run.name: {shown} contains a control character; {fix}")
    if name.startswith("."):
        raise UsageError(f"run.name: {shown} starts with '.' (hidden names are thinwire's own); {fix}")
    if len(name) > MAX_NAME or len(name.encode("utf-8", "surrogateescape")) > MAX_NAME:
        raise UsageError(f"run.name: {len(name)} characters, longer than {MAX_NAME}; {fix}")
    return name


def check_out(out: str | os.PathLike[str]) -> Path:
    """The output root as a Path, created (with parents) when missing; one line when it is a
    file, cannot be created or is not writable."""
    root = Path(out)
    if not str(out):
        raise UsageError("run.out: empty; pass the folder that holds run directories, e.g. runs")
    if root.exists() and not root.is_dir():
        raise UsageError(f"run.out: {root} is a file, not a directory; pass a directory "
                         "(it is created when missing)")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"run.out: cannot create {root}: {describe_os_error(exc, root)}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise UsageError(f"run.out: {root} is not writable; choose a directory you can write "
                         "(or fix its permissions)")
    return root


def describe_os_error(exc: OSError, path: str | os.PathLike[str]) -> str:
    """One line for a failed write of ``path``: the errno's name, its meaning, the path, a fix."""
    code = exc.errno or 0
    name = errno.errorcode.get(code, "OSError")
    meaning = os.strerror(code).lower() if code else str(exc)
    fix = {
        errno.ENOSPC: "free space on that file system or choose another --run.out",
        errno.EDQUOT: "free space within your quota or choose another --run.out",
        errno.EROFS: "the file system is read-only; choose another --run.out",
        errno.EACCES: "fix the permissions or choose another --run.out",
        errno.EPERM: "fix the permissions or choose another --run.out",
    }.get(code, "check the file system, or choose another --run.out")
    return f"{meaning} ({name}) writing {path}; {fix}"


def is_run_dir(path: Path) -> bool:
    """True when ``path`` is a real directory (not a link) holding thinwire's marker file."""
    try:
        return (stat.S_ISDIR(os.lstat(path).st_mode)
                and stat.S_ISREG(os.lstat(path / MARKER).st_mode))
    except OSError:
        return False


def mark(path: Path) -> None:
    """Write the marker into ``path`` (a directory thinwire created)."""
    from thinwire import __version__

    write_text(path / MARKER, json.dumps({"created_by": "thinwire", "version": __version__}) + "\n")


# --- atomic writes ------------------------------------------------------------------------------
def write_bytes(path: Path, data: bytes) -> None:
    """Atomically replace ``path`` with ``data`` (temporary file, fsync, rename); on OSError the
    temporary file is removed, ``path`` keeps its old content (or stays absent) and a one-line
    UsageError names the errno and the path."""
    try:
        replace_atomically(path, data, path.with_name(f".{path.name}.tmp.{os.getpid()}"))
    except OSError as exc:
        raise UsageError(describe_os_error(exc, path)) from None


def replace_atomically(path: Path, data: bytes, tmp: Path) -> None:
    """Write ``data`` to ``tmp``, fsync it and rename it over ``path``; on OSError ``tmp`` is
    removed and the error propagates (``path`` keeps its old content or stays absent)."""
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        _unlink_quietly(tmp)
        raise


def write_text(path: Path, text: str) -> None:
    """:func:`write_bytes` of ``text`` encoded as UTF-8."""
    write_bytes(path, text.encode("utf-8"))


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# --- the lock -----------------------------------------------------------------------------------
def lock_path(root: Path, name: str) -> Path:
    return root / f".{name}.lock"


def staging_path(root: Path, name: str) -> Path:
    return root / f".{name}.staging"


def replaced_path(root: Path, name: str) -> Path:
    return root / f".{name}.replaced"


def _acquire(lock: Path, final: Path) -> int:
    """An exclusive, non-blocking flock on ``lock`` (created when missing); the descriptor."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        raise UsageError(f"cannot create the lock file: {describe_os_error(exc, lock)}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        holder = ""
        try:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        except OSError:
            pass
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            who = f" (pid {holder})" if holder.isdigit() else ""
            raise UsageError(f"another thinwire job{who} is running in {final}; wait for it to "
                             "finish or choose another --run.name") from None
        raise UsageError(f"cannot lock {lock}: {describe_os_error(exc, lock)}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError:
        pass  # the pid is only shown in messages
    return fd


# --- the run directory --------------------------------------------------------------------------
@dataclass
class RunDir:
    """A run directory held for one job: ``path`` is where the workers write (the staging
    directory when replacing), ``final`` where the run lives once committed."""

    final: Path
    path: Path
    mode: Mode
    _lock_fd: int | None = field(default=None, repr=False)
    committed: bool = False

    def commit(self) -> Path:
        """The job succeeded: a replacement is swapped into place and the old run removed.
        Returns ``final``. Idempotent; a no-op for new and resumed runs (already in place)."""
        if self.committed or self._lock_fd is None:
            return self.final
        if self.mode == "replace":
            _swap_into_place(self.path, self.final)
            self.path = self.final
        self.committed = True
        return self.final

    def close(self) -> None:
        """Release the lock; an uncommitted replacement's staging directory is removed first."""
        if self._lock_fd is None:
            return
        try:
            if self.mode == "replace" and not self.committed and is_run_dir(self.path):
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def open_run(out: str | os.PathLike[str], name: str, *, resume: bool = False,
             overwrite: bool = False) -> RunDir:
    """Lock and prepare ``OUT/NAME`` for one job (see the module docstring for the rules).

    Raises UsageError (one line) for a bad name or output root, a job already running there, a
    directory thinwire did not create, an existing run without ``resume`` or ``overwrite``, or
    ``resume`` with nothing to resume. Checkpoint contents are checked by
    :func:`thinwire.checkpoint.require_resumable`, which the caller runs for ``resume``.
    """
    check_name(name)
    if resume and overwrite:
        raise UsageError("run.resume and run.overwrite are both set; resume continues the run, "
                         "overwrite replaces it: choose one")
    root = check_out(out)
    final = root / name
    fd = _acquire(lock_path(root, name), final)
    try:
        _recover(root, name)
        return _prepare(root, name, final, fd, resume=resume, overwrite=overwrite)
    except BaseException:
        os.close(fd)
        raise


def _prepare(root: Path, name: str, final: Path, fd: int, *, resume: bool,
             overwrite: bool) -> RunDir:
    exists = os.path.lexists(final)
    if exists and (os.path.islink(final) or not final.is_dir()):
        kind = "a symbolic link" if os.path.islink(final) else "not a directory"
        raise UsageError(f"{final} exists and is {kind}; thinwire leaves it alone: choose another "
                         "--run.name or --run.out")
    if exists and not is_run_dir(final):
        if resume and _looks_like_run(final):
            mark(final)  # a run written before markers existed: adopt it for resume
        else:
            raise UsageError(f"{final} exists and was not created by thinwire (no {MARKER} "
                             "marker); thinwire never writes into or deletes it: choose another "
                             "--run.name or --run.out")
    if resume:
        if not exists:
            raise UsageError(f"run.resume: {final} does not exist, nothing to resume; start it "
                             "without --resume")
        return RunDir(final, final, "resume", fd)
    if not exists:
        _make_marked(final)
        return RunDir(final, final, "new", fd)
    if not overwrite:
        state = "finished" if (final / "summary.json").is_file() else "unfinished"
        raise UsageError(f"{final} holds a previous ({state}) run; pass --run.resume true to "
                         "continue it, --run.overwrite true to replace it, or choose another "
                         "--run.name")
    staging = staging_path(root, name)
    _make_marked(staging)
    return RunDir(final, staging, "replace", fd)


def _make_marked(path: Path) -> None:
    """Create the directory ``path`` with its marker; nothing is left when that fails."""
    try:
        path.mkdir()
    except OSError as exc:
        raise UsageError(f"cannot create {path}: {describe_os_error(exc, path)}") from None
    try:
        mark(path)
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise


def _looks_like_run(path: Path) -> bool:
    """A directory with thinwire's layout (config.toml and a checkpoints folder)."""
    return (path / "config.toml").is_file() and (path / "checkpoints").is_dir()


def _recover(root: Path, name: str) -> None:
    """Under the lock: finish or undo what a killed job left (staging, half-done swap)."""
    final, staging, replaced = root / name, staging_path(root, name), replaced_path(root, name)
    for hidden in (staging, replaced):
        if os.path.lexists(hidden) and not is_run_dir(hidden):
            raise UsageError(f"{hidden} exists and was not created by thinwire; move it away "
                             "(thinwire keeps its own hidden entries there)")
    if os.path.lexists(replaced):
        if not os.path.lexists(final):
            # killed between the two renames of a fallback swap: the new run had succeeded
            os.replace(staging if os.path.lexists(staging) else replaced, final)
        if os.path.lexists(replaced):
            shutil.rmtree(replaced)
    if os.path.lexists(staging):
        shutil.rmtree(staging)  # an unfinished replacement: the previous run stays


def _swap_into_place(new: Path, final: Path) -> None:
    """Put ``new`` at ``final`` and delete the run that was there (both are marked)."""
    if not os.path.lexists(final):  # the previous run was moved away meanwhile
        os.replace(new, final)
        return
    if _rename_exchange(new, final):
        shutil.rmtree(new)  # ``new`` now names the previous run
        return
    replaced = replaced_path(final.parent, final.name)
    os.replace(final, replaced)
    os.replace(new, final)
    shutil.rmtree(replaced)


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux ``renameat2``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(a))
