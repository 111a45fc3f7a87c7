"""Run directories: where a run writes, and the only places thinwire ever deletes.

Guarantees (tested in ``tests/reliability/test_rundir.py``, ``test_data_loss.py`` and the
property test ``test_rundir_properties.py``):

- **Names.** A run name is one plain path component: not empty, not ``.`` or ``..``, no ``/`` or
  ``\\``, no NUL or other control character, no leading ``.`` (hidden names are thinwire's own:
  lock and staging entries), at most :data:`MAX_NAME` characters. Anything else is a one-line
  :class:`~thinwire.errors.UsageError` naming the fix (:func:`check_name`), so a run directory is
  always a direct child of the output root.
- **Ownership.** Every run directory thinwire creates holds the marker file :data:`MARKER`,
  written only when thinwire creates the directory, never into an existing one. thinwire
  writes into, resumes, replaces or deletes only marked directories that are direct children
  of the output root (or hidden entries it made there), never anything else. A directory
  without the marker, even one laid out like a run, is refused with one line naming it
  (:func:`open_run`).
- **Modes.** With nothing at ``OUT/NAME`` a new run is created in place (a failed first run
  stays there, resumable, destroying nothing). An existing run is reused only with ``resume``
  (in place, under the lock: checkpoints are only ever added atomically and pruned after a newer
  one is complete, so a failed resume keeps the previous checkpoints) and replaced only with
  ``overwrite``: the new run writes into the staging directory ``OUT/.NAME.staging`` and is
  swapped into place by :meth:`RunDir.commit` only after it succeeded (an atomic
  ``renameat2(RENAME_EXCHANGE)`` where the file system has it, else two renames that
  :func:`open_run` completes after a crash). A failed or interrupted replacement removes its
  staging directory and leaves the previous run exactly as it was.
- **No links.** A run directory holding a symbolic link anywhere inside it is not resumed
  (:func:`check_no_links`, one line naming the link): thinwire never follows a link for
  writing or deletion. Atomic writes replace a link at their target instead of following it.
- **One job per run directory.** :func:`take_lock` takes an exclusive ``flock`` on
  ``OUT/.NAME.thinwire-lock``, a file thinwire creates complete with its tag
  (:data:`LOCK_TAG`, then the holder's pid) and removes when it releases the lock; a file of
  that name without the tag is not thinwire's and is refused, never truncated. :func:`open_run`
  holds it until :meth:`RunDir.close`, and the worker entry's rank 0 takes it too unless its
  launcher holds it (:func:`thinwire.worker.claim_run_dir`), so a ``torchrun`` beside a live
  ``thinwire train`` is refused. The kernel drops the lock when its holder exits in any way (a
  stale file left by a killed job carries the tag and is reused); the descriptor is not
  inherited by workers. A second job fails at once with one line naming the directory and the
  holder's pid.
- **Writes.** :func:`write_text` writes a temporary file beside the target, fsyncs and renames
  it: a target is either the old or the new content, never empty or partial; on any
  ``OSError`` (ENOSPC, EDQUOT, EROFS, EACCES...) the temporary file is removed and the error is
  one line naming the errno and the path (:func:`describe_os_error`).
- **Report folders.** ``compare`` and ``report`` write their tables and plots only into a
  directory they create and mark (:data:`REPORT_MARKER`, :func:`open_output_dir`) or one
  they marked before; a link, a file or a folder of the user's there is refused in one line.
- **Output root.** It is created when missing; one that is a file, cannot be created or is not
  writable is a one-line error (:func:`check_out`).

The caller holds a :class:`RunDir` for the whole job::

    with rundir.open_run(cfg.run.out, cfg.run_name, resume=..., overwrite=...) as rd:
        rundir.write_text(rd.path / "config.toml", text)
        launch(rd.path, workers)
        rd.commit()

Leaving the ``with`` block without :meth:`RunDir.commit` (an exception, Ctrl-C) discards a
replacement's staging directory; the lock is released either way.

One concept, one file (over 400 lines): the run directory and the guarantees above, which its
names, marker, writes and lock hold together.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import shutil
import signal
import stat
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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


def check_no_links(run_dir: Path) -> None:
    """One line when anything inside ``run_dir`` (its files, ``checkpoints/`` and the step
    folders) is a symbolic link: thinwire never follows a link for writing or deletion, so a
    run holding one is not resumed or written into."""
    pending = [Path(run_dir)]
    while pending:
        here = pending.pop()
        try:
            entries = list(os.scandir(here))
        except OSError as exc:
            raise UsageError(f"cannot read {here}: {describe_os_error(exc, here)}") from None
        for e in entries:
            if e.is_symlink():
                raise UsageError(f"{e.path} is a symbolic link; thinwire never follows links "
                                 "inside a run directory: replace it with the file itself, or "
                                 "start a new run with another --run.name")
            if e.is_dir(follow_symlinks=False):
                pending.append(Path(e.path))


REPORT_MARKER = ".thinwire-report"
"""The file that marks a directory as one ``thinwire compare`` / ``report`` wrote its tables
and plots into."""


def is_report_dir(path: Path) -> bool:
    """True when ``path`` is a real directory (not a link) holding :data:`REPORT_MARKER`."""
    try:
        return (stat.S_ISDIR(os.lstat(path).st_mode)
                and stat.S_ISREG(os.lstat(path / REPORT_MARKER).st_mode))
    except OSError:
        return False


def open_output_dir(path: str | os.PathLike[str], what: str) -> Path:
    """The directory ``path`` for ``compare``'s and ``report``'s files: created (with parents)
    and marked with :data:`REPORT_MARKER` when missing, reused when it holds that marker; a
    link, a file or a directory thinwire did not create is a one-line UsageError (``what``
    names the option, e.g. ``--plots``), and it is left as it is."""
    d = Path(path)
    fix = f"choose another {what}"
    if os.path.lexists(d):
        if os.path.islink(d):
            raise UsageError(f"{what}: {d} is a symbolic link; thinwire does not follow it: {fix}")
        if not d.is_dir():
            raise UsageError(f"{what}: {d} exists and is not a directory; {fix}")
        if not is_report_dir(d):
            raise UsageError(f"{what}: {d} exists and was not created by thinwire (no "
                             f"{REPORT_MARKER} marker); thinwire never writes into it: {fix}")
        return d
    try:
        d.mkdir(parents=True)
    except OSError as exc:
        raise UsageError(f"{what}: cannot create {d}: {describe_os_error(exc, d)}") from None
    from thinwire import __version__

    write_text(d / REPORT_MARKER,
               json.dumps({"created_by": "thinwire", "version": __version__}) + "\n")
    return d


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
    fd = create_exclusive(tmp)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # OSError, or a signal mid-write: no temporary file is left
        _unlink_quietly(tmp)
        raise


def create_exclusive(tmp: Path) -> int:
    """A file descriptor of a new file at ``tmp``, open for writing (``O_CREAT | O_EXCL |
    O_NOFOLLOW``): whatever is at ``tmp`` already (a crash's leftover, or a link or hard link
    planted in the run directory) is removed first, never followed or written through; one
    that reappears at once is an OSError (EEXIST)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(tmp, flags, 0o644)
    except FileExistsError:
        os.unlink(tmp)  # the name only: a link's target is untouched
    return os.open(tmp, flags, 0o644)


def write_text(path: Path, text: str) -> None:
    """:func:`write_bytes` of ``text`` encoded as UTF-8."""
    write_bytes(path, text.encode("utf-8"))


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# --- the lock -----------------------------------------------------------------------------------
LOCK_TAG = "thinwire lock"
"""The first words of every lock file thinwire writes (then ``pid N``): a file at the lock's
path that does not start with them is not thinwire's and is never opened for writing."""


def lock_path(root: Path, name: str) -> Path:
    """The lock of run ``root/name``: ``root/.name.thinwire-lock``."""
    return root / f".{name}.thinwire-lock"


def staging_path(root: Path, name: str) -> Path:
    return root / f".{name}.staging"


def staged_run(path: Path) -> str | None:
    """The name of the run whose replacement ``path`` stages (``.NAME.staging``), else None."""
    name = path.name
    if name.startswith(".") and name.endswith(".staging") and len(name) > len("..staging"):
        return name[1:-len(".staging")]
    return None


def replaced_path(root: Path, name: str) -> Path:
    return root / f".{name}.replaced"


def lock_holder(lock: Path) -> int | None:
    """The pid recorded in thinwire's lock file ``lock`` (None: no such file, not thinwire's,
    or no pid yet). The pid is only shown in messages and compared by workers."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)
    words = text.split()
    if text.startswith(LOCK_TAG) and len(words) >= 4 and words[2] == "pid" and words[3].isdigit():
        return int(words[3])
    return None


@dataclass
class Lock:
    """An exclusive ``flock`` on a lock file thinwire created; :meth:`release` removes the file
    (while still holding the lock) and closes it. The descriptor is not inherited by children,
    and the kernel drops the lock when the holding process ends in any way."""

    path: Path
    fd: int | None

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            if _same_file(self.fd, self.path):
                os.unlink(self.path)
        except OSError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def take_lock(root: Path, name: str) -> Lock:
    """The exclusive lock of run ``root/name`` (:func:`lock_path`); one line when another job
    holds it, or when a file of that name exists that thinwire did not write (it is left
    exactly as it is)."""
    lock, final = lock_path(root, name), root / name
    content = f"{LOCK_TAG} pid {os.getpid()}\n".encode()
    for _attempt in range(50):
        fd = _open_lock(lock, content)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = lock_holder(lock)
                who = f" (pid {holder})" if holder is not None else ""
                raise UsageError(f"another thinwire job{who} is running in {final}; wait for "
                                 "it to finish or choose another --run.name") from None
            raise UsageError(f"cannot lock {lock}: {describe_os_error(exc, lock)}") from None
        if _same_file(fd, lock):  # else its holder removed it between our open and flock
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, content, 0)
            except OSError:
                pass  # the pid is only shown in messages
            return Lock(lock, fd)
        os.close(fd)
    raise UsageError(f"cannot lock {lock}: it keeps being replaced; is another program "
                     "removing it?")


def _open_lock(lock: Path, content: bytes) -> int:
    """A descriptor of thinwire's lock file ``lock``: created with ``content`` when missing (a
    hard link of a complete temporary file, so the file never exists without its tag), else the
    existing file, opened only when it is a regular file starting with :data:`LOCK_TAG`."""
    tmp = lock.with_name(f"{lock.name}.{os.getpid()}.new")
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o644)
    except OSError as exc:
        raise UsageError(f"cannot create the lock file: {describe_os_error(exc, lock)}") from None
    try:
        os.write(fd, content)
        os.link(tmp, lock)
        return fd
    except FileExistsError:
        os.close(fd)
    except OSError as exc:
        os.close(fd)
        raise UsageError(f"cannot create the lock file: {describe_os_error(exc, lock)}") from None
    finally:
        _unlink_quietly(tmp)
    not_ours = (f"{lock} exists and is not thinwire's lock file; thinwire leaves it alone: move "
                "it away or choose another --run.name")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return _open_lock(lock, content)  # removed by its holder meanwhile
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(not_ours) from None
        raise UsageError(f"cannot open the lock file: {describe_os_error(exc, lock)}") from None
    try:
        ok = (stat.S_ISREG(os.fstat(fd).st_mode)
              and os.pread(fd, len(LOCK_TAG), 0) == LOCK_TAG.encode())
    except OSError:
        ok = False
    if not ok:
        os.close(fd)
        raise UsageError(not_ours)
    return fd


@contextmanager
def deferred_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP held back while the body cleans up (main thread only): one
    that arrives meanwhile is raised as KeyboardInterrupt when the body is done, unless an
    exception is already on its way out."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    old = {s: signal.signal(s, lambda signum, _frame: got.append(signum)) for s in sigs}
    try:
        yield
    except BaseException:
        got.clear()
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
    if got:
        raise KeyboardInterrupt(f"signal {got[0]}")


# --- the run directory --------------------------------------------------------------------------
@dataclass
class RunDir:
    """A run directory held for one job: ``path`` is where the workers write (the staging
    directory when replacing), ``final`` where the run lives once committed."""

    final: Path
    path: Path
    mode: Mode
    _lock: Lock | None = field(default=None, repr=False)
    committed: bool = False

    def commit(self) -> Path:
        """The job succeeded: a replacement is swapped into place and the old run removed.
        Returns ``final``. Idempotent; a no-op for new and resumed runs (already in place)."""
        if self.committed or self._lock is None:
            return self.final
        if self.mode == "replace":
            _swap_into_place(self.path, self.final)
            self.path = self.final
        self.committed = True
        return self.final

    def close(self) -> None:
        """Release (and remove) the lock; an uncommitted replacement's staging directory is
        removed first."""
        if self._lock is None:
            return
        with deferred_signals():  # a Ctrl-C now would leave the staging directory and lock
            try:
                if self.mode == "replace" and not self.committed and is_run_dir(self.path):
                    shutil.rmtree(self.path, ignore_errors=True)
            finally:
                self._lock.release()
                self._lock = None

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
    lock = take_lock(root, name)
    try:
        _recover(root, name)
        return _prepare(root, name, final, lock, resume=resume, overwrite=overwrite)
    except BaseException:
        lock.release()
        raise


def _prepare(root: Path, name: str, final: Path, fd: Lock, *, resume: bool,
             overwrite: bool) -> RunDir:
    exists = os.path.lexists(final)
    if exists and (os.path.islink(final) or not final.is_dir()):
        kind = "a symbolic link" if os.path.islink(final) else "not a directory"
        raise UsageError(f"{final} exists and is {kind}; thinwire leaves it alone: choose another "
                         "--run.name or --run.out")
    if exists and not is_run_dir(final):
        raise UsageError(f"{final} exists and was not created by thinwire (no {MARKER} "
                         "marker); thinwire never writes into, resumes or deletes it: choose "
                         "another --run.name or --run.out")
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
    for hidden in (staging, replaced):  # a lock a killed worker took there (older versions)
        lock = lock_path(root, hidden.name)
        if clear_stale_lock(lock):
            print(f"thinwire: removed {lock}, a stale lock of a job that is gone",
                  file=sys.stderr)


def clear_stale_lock(lock: Path) -> bool:
    """Remove thinwire's lock file ``lock`` when no process holds it (its holder is gone);
    a file that is not thinwire's, a link, or a lock still held is left. True when removed."""
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False
    try:
        if not (stat.S_ISREG(os.fstat(fd).st_mode)
                and os.pread(fd, len(LOCK_TAG), 0) == LOCK_TAG.encode()):
            return False
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if not _same_file(fd, lock):
            return False
        os.unlink(lock)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


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
