"""Test-wide set-up: the harness on the path, one torch thread, the shared test data (Cora,
tiny-shakespeare at ../shared/data), no downloads, GPU tests skipped without a device."""

from __future__ import annotations

import os
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA device: GPU smoke tests run only where one is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


from harness import SHARED_DATA  # noqa: E402


@pytest.fixture(autouse=True)
def no_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any attempt to open a URL fails the test (tests may replace it with a fake)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"a test tried to download: {args[:1]}")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)


@pytest.fixture
def isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No $THINWIRE_DATA_DIR and an empty user cache under ``tmp_path / "cache"``."""
    monkeypatch.delenv("THINWIRE_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def _shared(sub: str, filename: str) -> Path:
    if SHARED_DATA is None:
        pytest.skip("shared test data not found (../shared/data from the repository root)")
    if not (SHARED_DATA / sub / filename).is_file():
        pytest.skip(f"{SHARED_DATA / sub / filename} is absent")
    return SHARED_DATA


@pytest.fixture
def shakespeare_dir() -> Path:
    """The shared data directory holding ``tinyshakespeare/input.txt`` (skips without it)."""
    return _shared("tinyshakespeare", "input.txt")


@pytest.fixture
def cora_dir() -> Path:
    """The shared data directory holding ``cora/cora.npz`` (skips without it)."""
    return _shared("cora", "cora.npz")
