"""Test-wide set-up: the harness on the path, one torch thread, the data that ships with the
package (Cora, tiny-shakespeare), no downloads, GPU tests skipped without a device."""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
pytest_plugins = ["ci_skips"]

# before anything imports torchvision, timm or transformers' models (the module says why)
from thinwire.models.torchvision_ops import define_missing_torchvision_ops  # noqa: E402

define_missing_torchvision_ops()


_SESSION_PID = os.getpid()


def pytest_runtest_setup(item):  # noqa: ANN001
    """A forked child of a test (a rank, an interrupted run) that ever returned into pytest's
    loop ends here instead of running the rest of the suite beside its parent."""
    if os.getpid() != _SESSION_PID:
        os._exit(70)


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: GPU smoke tests run only where one is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


from harness import DATA  # noqa: E402


@pytest.fixture(autouse=True)
def signal_handlers_restored() -> Any:
    """The termination signals' handlers as they were before each test: the command line,
    called in-process by a test, ignores them once it was interrupted (a second Ctrl-C cannot
    cut its exit short), which is right for the process it ends and wrong for pytest's."""
    import signal

    sigs = [s for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")
            if (s := getattr(signal, name, None)) is not None]
    saved = {s: signal.getsignal(s) for s in sigs}
    yield
    for s, h in saved.items():
        if h is not None and signal.getsignal(s) is not h:
            signal.signal(s, h)


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a URL fails the test (tests may replace it with a fake)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a test tried to download: {args[:1]}")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No $THINWIRE_DATA_DIR, an empty user cache under ``tmp_path / "cache"`` and no bundled
    copy (``BUNDLED_DIR`` pointed at the absent ``tmp_path / "bundled"``): a machine where a
    dataset is found nowhere."""
    from thinwire.data import text

    monkeypatch.delenv("THINWIRE_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(text, "BUNDLED_DIR", tmp_path / "bundled")
    return tmp_path


def _bundled(sub: str, filename: str) -> Path:
    path = DATA / sub / filename
    assert path.is_file(), f"{path} is missing from the package: reinstall thinwire"
    return DATA


@pytest.fixture
def shakespeare_dir() -> Path:
    """The data directory holding ``tinyshakespeare/input.txt`` (the package's copy)."""
    return _bundled("tinyshakespeare", "input.txt")


@pytest.fixture
def cora_dir() -> Path:
    """The data directory holding ``cora/cora.npz`` (the package's copy)."""
    return _bundled("cora", "cora.npz")
