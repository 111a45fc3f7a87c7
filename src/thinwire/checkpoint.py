"""Atomic per-rank checkpoints and resume.

Layout: ``RUN/checkpoints/step_00000100/rank0.pt ... rankN.pt`` plus ``COMPLETE`` (the worker
count, one decimal line). Every rank writes its own state (a sharded strategy holds different
parameters on each rank) to a temporary file, fsyncs it and renames it into place; after a
barrier rank 0 writes ``COMPLETE`` the same way. Resume takes the newest step whose ``COMPLETE``
exists, so a crash mid-write never loses the previous checkpoint; older complete checkpoints
beyond ``keep`` are removed by rank 0 only after a newer one is sealed.

Guarantees (tests: ``tests/reliability/test_checkpoint_errors.py``, ``test_resume_cli.py`` and
the property-based ``tests/reliability/test_fuzz_inputs.py``):

- Loading uses ``torch.load(weights_only=True)``: no arbitrary objects are unpickled.
- Every unusable checkpoint is a one-line :class:`CheckpointError` (a
  :class:`~thinwire.errors.UsageError`) naming the file and the fix, never a traceback: a
  missing, empty, truncated or random-bytes rank file, a ``COMPLETE`` that does not hold a
  worker count, a checkpoint of another world size, a pickle refused by safe loading, a valid
  torch file whose content is not a thinwire state (wrong types).
- A failed write (ENOSPC, EDQUOT, EROFS...) is a one-line CheckpointError naming the errno and
  the file; the temporary file is removed and earlier checkpoints are untouched.
- Temporary files are created anew (``O_EXCL | O_NOFOLLOW``, :func:`thinwire.rundir.
  create_exclusive`): a link planted at a temporary file's path is removed, never followed, so
  a checkpoint never writes outside the run directory; an interrupted write leaves none.
- :func:`require_resumable` reports what ``checkpoints/`` holds that is not a step directory
  (:func:`strays`: ``step_abc``, a stray ``COMPLETE``) instead of ignoring it.
- :func:`require_resumable` turns "resume, but there is no checkpoint" into a one-line error
  instead of a silent fresh start, and refuses to resume a run whose newest checkpoint is at
  or beyond the run's ``train.steps`` (a finished run: resuming it would only rewrite its
  results; ``tests/reliability/test_data_loss.py``), unless its final write (summary, model,
  ledgers) is not whole (:func:`final_state_problem`): then the resume redoes that write from
  the final checkpoint.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError

TRAINER_KEYS = ("wall_s", "sent_bytes", "payload_bytes", "recv_bytes")
_STEP_RE = re.compile(r"step_(\d{1,12})")


class CheckpointError(UsageError):
    """An unusable checkpoint or a failed checkpoint write; the message names the file and fix."""


def _step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:08d}"


def step_dir(run_dir: Path, step: int) -> Path:
    """The directory of the checkpoint of ``step``."""
    return _step_dir(run_dir, step)


# --- writing ------------------------------------------------------------------------------------
class _RecordingFile:
    """A file wrapper remembering the first OSError of a write (torch's zip writer reports a
    failed write as an opaque RuntimeError; this keeps the real errno)."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return int(self.f.write(data))
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.f.flush()


def _write_error(run_dir: Path, path: Path, exc: OSError) -> CheckpointError:
    from thinwire.rundir import describe_os_error

    prev = latest_step(run_dir)
    kept = f" (the previous checkpoint, step {prev}, is kept)" if prev is not None else ""
    return CheckpointError(f"checkpoint: {describe_os_error(exc, path)}{kept}")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` atomically (temporary file, fsync, rename); OSError propagates after
    the temporary file is removed."""
    from thinwire.rundir import replace_atomically

    replace_atomically(path, data, path.with_name(path.name + ".tmp"))


def save_rank(run_dir: Path, step: int, rank: int, state: dict[str, Any]) -> None:
    """Write this rank's state of ``step`` atomically; CheckpointError (one line) on failure."""
    import torch

    d = _step_dir(run_dir, step)
    target = d / f"rank{rank}.pt"
    tmp = d / f"rank{rank}.pt.tmp"
    from thinwire.rundir import create_exclusive

    try:
        d.mkdir(parents=True, exist_ok=True)
        with open(create_exclusive(tmp), "wb") as f:
            rec = _RecordingFile(f)
            try:
                torch.save(state, rec)  # type: ignore[arg-type]
            except RuntimeError:
                if rec.error is not None:
                    raise rec.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        _unlink(tmp)
        raise _write_error(run_dir, target, exc) from None
    except BaseException:  # a signal mid-write: no temporary file is left
        _unlink(tmp)
        raise


def mark_complete(run_dir: Path, step: int, world_size: int, keep: int = 2) -> None:
    """Rank 0, after every rank saved: seal the checkpoint and prune older ones."""
    d = _step_dir(run_dir, step)
    missing = [r for r in range(world_size) if not (d / f"rank{r}.pt").exists()]
    if missing:
        raise CheckpointError(f"checkpoint {d} lacks ranks {missing} after every rank saved; "
                              "is another job writing into this run directory?")
    try:
        atomic_write_bytes(d / "COMPLETE", f"{world_size}\n".encode())
    except OSError as exc:
        raise _write_error(run_dir, d / "COMPLETE", exc) from None
    for old in complete_steps(run_dir)[:-keep]:
        shutil.rmtree(_step_dir(run_dir, old), ignore_errors=True)


def remove_temporaries(run_dir: Path) -> list[Path]:
    """Remove the checkpoint temporary files (``step_*/rank*.pt.tmp``, ``step_*/COMPLETE.tmp``)
    a worker ended by a signal mid-write left in ``run_dir``; regular files only (a link is
    removed as a link). Returns what was removed."""
    root = run_dir / "checkpoints"
    removed = []
    try:
        found = [p for d in root.iterdir() if _STEP_RE.fullmatch(d.name) and d.is_dir()
                 and not d.is_symlink() for p in d.iterdir()
                 if re.fullmatch(r"(rank\d+\.pt|COMPLETE)\.tmp", p.name)]
    except OSError:
        return []
    for p in found:
        _unlink(p)
        removed.append(p)
    return removed


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# --- finding ------------------------------------------------------------------------------------
def complete_steps(run_dir: Path) -> list[int]:
    """Steps whose directory holds a ``COMPLETE`` file, oldest first (contents not checked)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        m = _STEP_RE.fullmatch(p.name)
        if m and (p / "COMPLETE").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def strays(run_dir: Path) -> list[Path]:
    """What ``checkpoints/`` holds besides step directories (``step_abc``, a ``COMPLETE`` file
    beside them, a step name that is a file), sorted: :func:`complete_steps` would ignore
    them, so a resume reports them instead."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if not (_STEP_RE.fullmatch(p.name) and p.is_dir() and not p.is_symlink()))


def latest_step(run_dir: Path) -> int | None:
    steps = complete_steps(run_dir)
    return steps[-1] if steps else None


def _fix(run_dir: Path, step: int) -> str:
    older = [s for s in complete_steps(run_dir) if s < step]
    d = _step_dir(run_dir, step)
    if older:
        return f"delete {d} to resume from the previous checkpoint (step {older[-1]})"
    return "start the run afresh (--run.overwrite true) or restore the file"


def read_complete(run_dir: Path, step: int) -> int:
    """The worker count sealed in the step's ``COMPLETE``; CheckpointError when it is not one."""
    path = _step_dir(run_dir, step) / "COMPLETE"
    try:
        raw = path.read_bytes()[:64]
    except OSError as exc:
        raise CheckpointError(f"checkpoint {path} cannot be read ({exc.strerror}); "
                              f"{_fix(run_dir, step)}") from None
    text = raw.decode("ascii", "replace").strip()
    if not re.fullmatch(r"[1-9][0-9]{0,6}", text):
        shown = ascii(text[:20]) if text else "nothing"
        raise CheckpointError(f"checkpoint {path} is corrupt (holds {shown}, not a worker "
                              f"count); {_fix(run_dir, step)}")
    return int(text)


def require_resumable(run_dir: Path, world_size: int, *, check_ranks: bool = True,
                      rescalable: bool = False, steps: int | None = None) -> int:
    """The step a resume of ``run_dir`` by ``world_size`` workers starts from.

    CheckpointError (one line) when there is no complete checkpoint, the newest one is already
    at or beyond ``steps`` (the run's ``train.steps``: a finished run is complete and a resume
    would only rewrite its results; ``--steps`` above it continues it), its ``COMPLETE`` is
    corrupt, it was written by another number of workers (unless ``rescalable``: the method's
    state is the same on every rank, :func:`load_rank`), or (``check_ranks``) any rank file is
    missing or unusable: the launching process calls this before any worker starts.
    """
    stray = strays(run_dir)
    if stray:
        raise CheckpointError(f"run.resume: {stray[0]} is not a checkpoint (thinwire writes "
                              "checkpoints/step_NNNNNNNN/ directories holding rankR.pt files "
                              "and COMPLETE), so resuming would ignore it; move it out of "
                              f"{run_dir / 'checkpoints'} and resume again")
    step = latest_step(run_dir)
    if step is None:
        raise CheckpointError(f"run.resume: no complete checkpoint in {run_dir / 'checkpoints'}; "
                              "start the run without --resume (checkpoints are written every "
                              "--run.checkpoint_every steps and at the end)")
    _check_world(run_dir, step, world_size, rescalable)
    if check_ranks:
        for rank in range(world_size):
            load_rank(run_dir, step, rank, world_size, rescalable=rescalable)
    if steps is not None and step == steps and final_state_problem(run_dir, step):
        return step  # the final write failed: the resume redoes it from this checkpoint
    if steps is not None and step >= steps:
        state = (f"is complete: it trained all {step} steps" if step == steps else
                 f"has trained {step} steps, more than --train.steps {steps}")
        raise CheckpointError(f"run.resume: {run_dir} {state}, so there is nothing to resume and "
                              f"its results are kept; pass --steps above {step} to continue it, "
                              "or choose another --run.name for a new run")
    return step


def final_state_problem(run_dir: Path, step: int) -> str:
    """What the final write of a run trained to ``step`` lacks ('' when it is whole): its
    ``summary.json`` (written last, once every rank's model and ledger files are written)
    missing, damaged or of another step, or a file the summary lists (``final_files``)
    missing."""
    import json

    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return f"{path} is missing"
    except (OSError, ValueError) as exc:
        return f"{path} is damaged ({type(exc).__name__})"
    if not isinstance(summary, dict) or summary.get("steps") != step:
        return f"{path} is not the summary of step {step}"
    missing = [f for f in summary.get("final_files", ()) if not (run_dir / str(f)).is_file()]
    return f"{run_dir / str(missing[0])} is missing" if missing else ""


def _check_world(run_dir: Path, step: int, world_size: int, rescalable: bool = False) -> int:
    """The worker count that wrote ``step``; CheckpointError when it differs from
    ``world_size`` and the method cannot resume at another count."""
    d = _step_dir(run_dir, step)
    saved_world = read_complete(run_dir, step)
    if saved_world != world_size and not rescalable:
        raise CheckpointError(f"checkpoint {d} was written by {saved_world} workers, this run has "
                              f"{world_size} and its method keeps per-worker state; resume with "
                              f"--runtime.workers {saved_world}")
    return saved_world


# --- loading ------------------------------------------------------------------------------------
def load_rank(run_dir: Path, step: int, rank: int, world_size: int, *,
              rescalable: bool = False) -> dict[str, Any]:
    """This rank's state of ``step``, validated (see the module docstring); safe loading only.

    With ``rescalable`` (the method's state is the same on every rank at a checkpoint,
    :class:`~thinwire.strategies.entry.Rescalable`) a run of another worker count
    resumes from it: every rank loads rank 0's file."""
    import torch

    saved_world = _check_world(run_dir, step, world_size, rescalable)
    if saved_world != world_size:
        rank = 0
    d = _step_dir(run_dir, step)
    path = d / f"rank{rank}.pt"
    fix = _fix(run_dir, step)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing (rank {rank} of {world_size}); "
                              f"{fix}")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty; {fix}")
    try:
        with warnings.catch_warnings():  # e.g. "unsupported pickle protocol": we report it below
            warnings.simplefilter("ignore")
            state = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        if "weights only" in str(exc).lower() or "weights_only" in str(exc):
            raise CheckpointError(f"checkpoint {path} holds objects other than tensors and plain "
                                  "values, refused by safe loading; it was not written by "
                                  f"thinwire: {fix}") from None
        raise CheckpointError(f"checkpoint {path} is corrupt (not a torch file); {fix}") from None
    except Exception as exc:  # noqa: BLE001 - any reader failure is a corrupt file
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated "
                              f"({type(exc).__name__}); {fix}") from None
    problem = _state_problem(state)
    if problem:
        raise CheckpointError(f"checkpoint {path} is not a thinwire state ({problem}); {fix}")
    return state  # type: ignore[no-any-return]


def _state_problem(state: Any) -> str:
    """Why ``state`` is not what :func:`save_rank` writes for the trainer; '' when it is."""
    if not isinstance(state, dict):
        return f"top level is {type(state).__name__}, not a dict"
    for key in ("strategy", "trainer"):
        if not isinstance(state.get(key), dict):
            return f"{key!r} is {type(state.get(key)).__name__}, not a dict"
    trainer = state["trainer"]
    for key in TRAINER_KEYS:
        v = trainer.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return f"trainer[{key!r}] is {type(v).__name__}, not a number"
    return ""
