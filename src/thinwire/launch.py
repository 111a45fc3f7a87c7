"""Start N local workers through torch's own elastic launcher (the API behind ``torchrun``).

``launch(run_dir, workers)`` runs ``python -m thinwire.worker RUN_DIR/config.toml`` in N
processes with a c10d rendezvous on a free loopback port, ``max_restarts=0``: if any worker
fails or dies, the agent stops the others and we raise :class:`WorkerFailed` naming the rank and
its error; collective timeouts (``runtime.timeout_s``) end a stuck peer. The workers are the same
program an external multi-node ``torchrun`` starts (see :mod:`thinwire.worker`).
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from thinwire.runtime.spawn import free_port


class WorkerFailed(RuntimeError):
    """A worker exited with an error; the message names the rank and the cause."""


def launch(run_dir: Path, workers: int, *, env: dict[str, str] | None = None,
           max_restarts: int = 0) -> None:
    config_path = run_dir / "config.toml"
    cfg = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=workers, run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{free_port()}",
        max_restarts=max_restarts, monitor_interval=0.2, start_method="spawn",
        log_line_prefix_template=None,
    )
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        elastic_launch(cfg, entrypoint=sys.executable)("-m", "thinwire.worker", str(config_path))
    except ChildFailedError as exc:
        rank, failure = min(exc.failures.items())
        cause = _last_error_line(failure)
        raise WorkerFailed(f"worker rank {rank} failed (exit code {failure.exitcode}): {cause}") from None
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _last_error_line(failure: object) -> str:
    msg = str(getattr(failure, "message", "") or "")
    if isinstance(getattr(failure, "error_file_data", None), dict):
        data = failure.error_file_data  # type: ignore[attr-defined]
        msg = str(data.get("message", {}).get("message", msg)) if isinstance(data.get("message"), dict) else msg
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    if lines:
        return lines[-1]
    sig = getattr(failure, "signal_name", lambda: "")()
    return f"terminated by {sig}" if sig else "see the worker's output above"
