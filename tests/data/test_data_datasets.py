"""Datasets: the idx parser, Fashion-MNIST when present, digits and teacher determinism."""

from __future__ import annotations

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from thinwire.data import DATASETS, datasets
from thinwire.data.datasets import (
    FASHION_MNIST_FILES,
    find_fashion_mnist,
    load_dataset,
    make_teacher,
    read_idx,
    stratified_subset,
)
from thinwire.errors import UsageError

FASHION_DIR = find_fashion_mnist()
needs_fashion = pytest.mark.skipif(
    FASHION_DIR is None,
    reason="Fashion-MNIST not installed (apt-get install dataset-fashion-mnist)",
)


def write_idx(path: Path, array: np.ndarray, *, compress: bool = True, code: int = 0x08) -> None:
    """Write ``array`` as an idx file (the format read_idx parses)."""
    header = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    raw = header + array.astype(array.dtype.newbyteorder(">")).tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)


def write_fake_fashion(directory: Path, n_train: int = 20, n_test: int = 10) -> None:
    rng = np.random.default_rng(0)
    for name, n in (("train", n_train), ("t10k", n_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = (np.arange(n) % 10).astype(np.uint8)
        write_idx(directory / f"{name}-images-idx3-ubyte.gz", images)
        write_idx(directory / f"{name}-labels-idx1-ubyte.gz", labels)


@pytest.fixture
def no_fashion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Hide every real Fashion-MNIST location: system dir, env var and cache point into tmp."""
    monkeypatch.setattr(datasets, "SYSTEM_FASHION_MNIST_DIR", tmp_path / "system")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("THINWIRE_DATA_DIR", raising=False)
    return tmp_path


def test_read_idx_roundtrip_gzip_and_raw(tmp_path: Path) -> None:
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz", a)
    write_idx(tmp_path / "a", a, compress=False)
    for p in ("a.gz", "a"):
        out = read_idx(tmp_path / p)
        assert out.dtype == np.uint8 and out.shape == (2, 3, 4)
        np.testing.assert_array_equal(out, a)
    b = np.array([-1, 70000, 3], dtype=np.int32)
    write_idx(tmp_path / "b.gz", b, code=0x0C)
    np.testing.assert_array_equal(read_idx(tmp_path / "b.gz"), b)


def test_read_idx_corrupt_magic_names_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.gz"
    p.write_bytes(gzip.compress(b"\x12\x34\x08\x01" + struct.pack(">I", 3) + b"abc"))
    with pytest.raises(UsageError, match="bad.gz.*magic"):
        read_idx(p)


def test_read_idx_truncated_and_bad_gzip(tmp_path: Path) -> None:
    p = tmp_path / "short.gz"
    p.write_bytes(gzip.compress(bytes([0, 0, 8, 1]) + struct.pack(">I", 10) + b"abc"))
    with pytest.raises(UsageError, match="short.gz"):
        read_idx(p)
    q = tmp_path / "broken.gz"
    q.write_bytes(gzip.compress(b"\0" * 100)[:20])
    with pytest.raises(UsageError, match="broken.gz"):
        read_idx(q)


def test_fake_fashion_from_data_dir(tmp_path: Path, no_fashion: Path) -> None:
    write_fake_fashion(tmp_path)
    d = load_dataset("fashion-mnist", str(tmp_path))
    assert d.x_train.shape == (20, 784) and d.x_test.shape == (10, 784)
    assert d.x_train.dtype == torch.float32 and d.y_train.dtype == torch.int64
    assert d.num_classes == 10 and d.input_dim == 784
    assert (
        abs(d.x_train.mean().item()) < 1e-5 and abs(d.x_train.std(unbiased=False).item() - 1) < 1e-4
    )


def test_fashion_subdirectory_of_data_dir_and_env(
    tmp_path: Path, no_fashion: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "fashion-mnist").mkdir()
    write_fake_fashion(tmp_path / "fashion-mnist")
    assert find_fashion_mnist(tmp_path) == tmp_path / "fashion-mnist"
    monkeypatch.setenv("THINWIRE_DATA_DIR", str(tmp_path))
    assert load_dataset("fashion-mnist").x_train.shape == (20, 784)


def test_fashion_corrupt_shape_names_file(tmp_path: Path, no_fashion: Path) -> None:
    write_fake_fashion(tmp_path)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", np.zeros((20, 27, 28), dtype=np.uint8))
    with pytest.raises(UsageError, match="train-images-idx3-ubyte.gz"):
        load_dataset("fashion-mnist", tmp_path)


def test_fashion_missing_names_files_dirs_and_fix(tmp_path: Path, no_fashion: Path) -> None:
    data_dir = tmp_path / "mine"
    data_dir.mkdir()
    write_idx(data_dir / "train-labels-idx1-ubyte.gz", np.zeros(3, dtype=np.uint8))
    with pytest.raises(UsageError) as err:
        load_dataset("fashion-mnist", data_dir)
    msg = str(err.value)
    assert "\n" not in msg
    for f in FASHION_MNIST_FILES:
        assert f in msg
    assert f"{data_dir} (missing train-images-idx3-ubyte.gz, t10k-images" in msg
    # an explicit directory is the only place searched: no silent fall-back elsewhere
    assert str(tmp_path / "system") not in msg and str(tmp_path / "cache") not in msg
    assert "apt-get install dataset-fashion-mnist" in msg and "--data.download true" in msg
    with pytest.raises(UsageError):
        load_dataset("fashion-mnist")  # nothing in the standard places either
    msg = str(pytest.raises(UsageError, load_dataset, "fashion-mnist").value)
    assert str(tmp_path / "system") in msg and str(tmp_path / "cache") in msg


def test_an_explicit_empty_directory_never_falls_back(tmp_path: Path, no_fashion: Path) -> None:
    """Guards ``--data.dir EMPTY`` silently training on the system copy."""
    (no_fashion / "system").mkdir()
    write_fake_fashion(no_fashion / "system")
    assert load_dataset("fashion-mnist").x_train.shape == (20, 784)  # the system copy exists
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UsageError, match="empty"):
        load_dataset("fashion-mnist", empty)


def test_download_failure_is_usage_error(no_fashion: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def offline(*args: object, **kwargs: object) -> None:
        raise OSError("network unreachable")

    monkeypatch.setattr(datasets.urllib.request, "urlopen", offline)
    with pytest.raises(UsageError, match="download .*failed.*network unreachable"):
        load_dataset("fashion-mnist", download=True)
    assert not list((no_fashion / "cache").rglob("*.part"))


@needs_fashion
def test_fashion_mnist_real_shapes_and_balance() -> None:
    d = load_dataset("fashion-mnist")
    assert d.x_train.shape == (60000, 784) and d.x_test.shape == (10000, 784)
    assert d.num_classes == 10
    assert torch.bincount(d.y_train).tolist() == [6000] * 10
    assert torch.bincount(d.y_test).tolist() == [1000] * 10
    assert abs(d.x_train.mean().item()) < 1e-4 and abs(d.x_train.std().item() - 1) < 1e-3


@needs_fashion
def test_fashion_mnist_limit_is_stratified() -> None:
    d = load_dataset("fashion-mnist", limit_train=1000, limit_test=95)
    assert torch.bincount(d.y_train).tolist() == [100] * 10
    assert torch.bincount(d.y_test).tolist() == [10] * 5 + [9] * 5  # classes dealt in order


def test_unknown_name_lists_known() -> None:
    with pytest.raises(UsageError) as err:
        load_dataset("cifar-10")
    for name in DATASETS.names():
        assert name in str(err.value)


def test_bad_limit() -> None:
    with pytest.raises(UsageError, match="limit_train"):
        load_dataset("teacher", limit_train=0)


def test_digits_split_and_determinism() -> None:
    a = load_dataset("digits")
    b = load_dataset("digits", seed=3)
    assert a.x_train.shape[0] + a.x_test.shape[0] == 1797 and a.input_dim == 64
    assert 350 <= a.x_test.shape[0] <= 370
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_test, b.y_test)
    counts = torch.bincount(a.y_test).numpy()
    assert counts.min() >= 35 and counts.max() <= 37  # stratified 20 %
    assert abs(a.x_train.mean().item()) < 1e-5


def test_digits_without_sklearn(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "sklearn", None)
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    with pytest.raises(UsageError, match="pip install scikit-learn"):
        load_dataset("digits")


def test_digits_are_read_as_sklearn_reads_them(monkeypatch: pytest.MonkeyPatch,
                                               tmp_path: Path) -> None:
    """The bundled file read directly (no scikit-learn import) equals ``load_digits`` bit for
    bit, dtypes included; where the file is not in its usual place, ``load_digits`` itself."""
    import importlib.util

    from sklearn.datasets import load_digits

    from thinwire.data import datasets

    bunch = load_digits()

    def same() -> None:
        data, target = datasets._digits_arrays()
        assert data.dtype == bunch.data.dtype and np.array_equal(data, bunch.data)
        assert target.dtype == np.int64 and np.array_equal(target, bunch.target)

    same()  # the file read directly
    moved = importlib.util.spec_from_loader("sklearn", None, is_package=True)
    assert moved is not None
    moved.submodule_search_locations = [str(tmp_path)]  # no datasets/data/digits.csv.gz here
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: moved)
    same()  # load_digits


def test_teacher_deterministic_and_exact() -> None:
    a = load_dataset("teacher", seed=1, limit_train=512, limit_test=128)
    b = load_dataset("teacher", seed=1, limit_train=512, limit_test=128)
    c = load_dataset("teacher", seed=2, limit_train=512, limit_test=128)
    assert a.x_train.shape == (512, 32) and a.x_test.shape == (128, 32) and a.num_classes == 10
    assert torch.equal(a.x_train, b.x_train) and torch.equal(a.y_train, b.y_train)
    assert not torch.equal(a.x_train, c.x_train)
    logits = make_teacher(1).logits(a.x_train.numpy())
    np.testing.assert_array_equal(logits.argmax(axis=1), a.y_train.numpy())
    default = load_dataset("teacher")
    assert default.x_train.shape == (8192, 32) and default.x_test.shape == (2048, 32)
    counts = torch.bincount(default.y_train, minlength=10)
    assert counts.min() > 0.6 * 819 and counts.max() < 1.4 * 819  # calibrated to near balance


def test_stratified_subset_round_robin() -> None:
    labels = np.array([2, 2, 2, 0, 1, 1, 0, 2])
    np.testing.assert_array_equal(stratified_subset(labels, 3), [0, 3, 4])
    np.testing.assert_array_equal(stratified_subset(labels, 5), [0, 3, 4, 5, 6])  # 0s and 1s first
    np.testing.assert_array_equal(stratified_subset(labels, 100), np.arange(8))
