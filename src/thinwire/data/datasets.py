"""Real and synthetic classification datasets, loaded offline into normalised float tensors.

Three datasets, all returned as one frozen :class:`Dataset` of torch tensors:

- ``"fashion-mnist"``: Xiao, Rasul, Vollgraf, "Fashion-MNIST: a Novel Image Dataset for
  Benchmarking Machine Learning Algorithms" (2017); 60,000 + 10,000 grey 28x28 images, 10 classes,
  read from the four idx gzip files. Search order: ``data_dir`` alone when given, else
  ``$THINWIRE_DATA_DIR``,
  ``/usr/share/datasets/fashion-mnist/`` (Debian package ``dataset-fashion-mnist``), then the user
  cache ``~/.cache/thinwire/fashion-mnist/`` (``$XDG_CACHE_HOME`` honoured); each directory ``D``
  may hold the files directly or in ``D/fashion-mnist/``. Nothing is downloaded unless
  ``download=True`` is passed. Pixels are scaled to [0, 1] and standardised with the global mean
  and std of the train split.
- ``"digits"``: scikit-learn's bundled 8x8 digits (1797 x 64), split 80/20 stratified with a fixed
  seed (so every run is evaluated on the same 360 images), standardised per feature with the train
  split's statistics (features constant on train keep std 1).
- ``"teacher"``: a synthetic teacher-student task for exact tests. A seeded teacher MLP
  (32 -> 64 tanh -> 10) labels standard-normal inputs by the argmax of its logits, so a student of
  the same shape can reach 100 % accuracy. The inputs are already on the normalised scale and are
  not re-standardised, so ``y == argmax(teacher.logits(x))`` holds exactly.

``limit_train`` / ``limit_test`` take a deterministic *stratified* subset for fast tests and demos:
the examples of each class are kept in split order and the classes are dealt round-robin (first
example of class 0, of class 1, ..., then the second of each, ...), so the subset is as balanced as
the data allows and independent of ``seed``. The kept examples stay in split order. For
``"teacher"`` the limits are simply the sizes generated (defaults 8192 / 2048). Normalisation
statistics always come from the full train split.

The idx format (LeCun's MNIST files): 2 zero bytes, a type code (0x08 = uint8, ...), the number of
dimensions, one big-endian uint32 per dimension, then the big-endian data.

One concept, one file (over 400 lines): the classification datasets and the Dataset they load into.
"""

from __future__ import annotations

import gzip
import os
import struct
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from thinwire.data.registry import DATASETS, DataEntry, DataSource
from thinwire.errors import UsageError

FASHION_MNIST_FILES: tuple[str, ...] = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
FASHION_MNIST_URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
SYSTEM_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
DATA_DIR_ENV = "THINWIRE_DATA_DIR"
FASHION_MNIST_FIX = (
    "apt-get install dataset-fashion-mnist, or pass --data.dir DIR holding the four idx files, "
    "or --data.download true when online"
)

DIGITS_SPLIT_SEED = 0
DIGITS_TEST_FRACTION = 0.2

TEACHER_INPUT_DIM = 32
TEACHER_HIDDEN = 64
TEACHER_CLASSES = 10
TEACHER_TRAIN_DEFAULT = 8192
TEACHER_TEST_DEFAULT = 2048

# idx type code -> (numpy big-endian dtype)
_IDX_DTYPES: dict[int, str] = {
    0x08: ">u1",
    0x09: ">i1",
    0x0B: ">i2",
    0x0C: ">i4",
    0x0D: ">f4",
    0x0E: ">f8",
}


KINDS: tuple[str, ...] = ("classification", "sequence", "node", "click", "extreme")
"""What a dataset's examples are (the task follows from it, :mod:`thinwire.data.task`):
- ``classification``: x [N, ...] features, y [N] class ids;
- ``sequence``: x [N, L] token ids, y [N, L] the next token of each position (language modelling);
- ``node``: x [N] node ids of one graph held in ``extra`` (features, adjacency), y [N] class ids;
- ``click``: x [N, dense + tables] dense features then categorical ids, y [N] clicks (0/1);
- ``extreme``: x [N, 2, P] sparse rows (feature ids, values), y [N, Y] label ids padded with -1
  (extreme multi-label classification, :mod:`thinwire.data.xc`).
"""


@dataclass(frozen=True, eq=False)
class Dataset:
    """A dataset split into train and test, ready for training."""

    name: str
    """The registry name (:data:`thinwire.data.DATASETS`)."""
    x_train: torch.Tensor
    """[N, ...]: float32 features (normalised with train statistics), int64 tokens or node ids."""
    y_train: torch.Tensor
    """int64 [N] class ids, or [N, L] next tokens."""
    x_test: torch.Tensor
    """[M, ...] as ``x_train``."""
    y_test: torch.Tensor
    """int64 [M] or [M, L]."""
    num_classes: int
    """Number of classes (labels 0 .. num_classes - 1), or the vocabulary size."""
    kind: str = "classification"
    """One of :data:`KINDS`."""
    input_shape: tuple[int, ...] = ()
    """Shape of one example as a model sees it (e.g. (1, 28, 28) for images stored flat);
    empty: ``x_train.shape[1:]``."""
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Whatever the model needs beyond the examples (a graph's features and adjacency)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        for split, x, y in (
            ("train", self.x_train, self.y_train),
            ("test", self.x_test, self.y_test),
        ):
            if x.dim() < 1 or y.dim() < 1 or x.shape[0] != y.shape[0]:
                raise ValueError(
                    f"{self.name} {split}: x must be [N, ...] and y [N, ...], got "
                    f"{tuple(x.shape)} and {tuple(y.shape)}"
                )
        if self.x_train.shape[1:] != self.x_test.shape[1:]:
            raise ValueError(f"{self.name}: train and test example shapes differ")
        if not self.input_shape:
            object.__setattr__(self, "input_shape", tuple(int(s) for s in self.x_train.shape[1:]))

    @property
    def input_dim(self) -> int:
        """Number of input features D (the product of ``input_shape``)."""
        return int(np.prod(self.input_shape, dtype=np.int64)) if self.input_shape else 1

    @property
    def labels(self) -> np.ndarray | None:
        """Per-example class ids for label-skewed sharding (None when examples have no one
        class, as in language modelling)."""
        return self.y_train.numpy() if self.y_train.dim() == 1 else None

    def __repr__(self) -> str:
        return (
            f"Dataset({self.name!r}, {self.kind}, train={tuple(self.x_train.shape)}, "
            f"test={tuple(self.x_test.shape)}, classes={self.num_classes})"
        )


@dataclass(frozen=True, eq=False)
class TeacherMLP:
    """The teacher of the ``"teacher"`` dataset: logits = tanh(x W1 + b1) W2 + b2."""

    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Teacher logits for inputs ``x`` [N, input_dim], computed in float64."""
        h = np.tanh(np.asarray(x, dtype=np.float64) @ self.w1 + self.b1)
        return h @ self.w2 + self.b2


# --------------------------------------------------------------------------------------- idx


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Parse an idx file (gzip-compressed or raw) into a native-endian numpy array.

    Raises :class:`UsageError` naming the file when it cannot be read or is not valid idx
    (bad magic, unknown type code, or a data length that does not match the header).
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise UsageError(
            f"cannot read idx file {path}: {exc}; delete it and fetch it again"
        ) from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise UsageError(
            f"corrupt idx file {path}: bad magic {raw[:4].hex() or '(empty)'}; "
            "delete it and fetch it again"
        )
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise UsageError(f"corrupt idx file {path}: truncated header; delete it and fetch it again")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise UsageError(
            f"corrupt idx file {path}: header says shape {shape} ({expected} data bytes) but the "
            f"file holds {len(raw) - header}; delete it and fetch it again"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape)
    return data.astype(dtype.newbyteorder("="))  # a writable, native-endian copy


# ----------------------------------------------------------------------------- fashion-mnist


def cache_dir() -> Path:
    """The user cache for Fashion-MNIST: ``$XDG_CACHE_HOME/thinwire/fashion-mnist`` (default
    ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "thinwire" / "fashion-mnist"


def fashion_mnist_search_dirs(data_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Directories searched for the four idx files, in order (see the module docstring). An
    explicit ``data_dir`` is the only place searched: it never silently falls back elsewhere."""
    if data_dir is not None:
        return [Path(data_dir), Path(data_dir) / "fashion-mnist"]
    roots: list[Path] = []
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        roots.append(Path(env))
    dirs: list[Path] = []
    for root in roots:
        dirs += [root, root / "fashion-mnist"]
    dirs += [SYSTEM_FASHION_MNIST_DIR, cache_dir()]
    return list(dict.fromkeys(dirs))


def _missing_files(directory: Path) -> list[str]:
    return [f for f in FASHION_MNIST_FILES if not (directory / f).is_file()]


def find_fashion_mnist(data_dir: str | os.PathLike[str] | None = None) -> Path | None:
    """The first search directory holding all four idx files, or None."""
    for d in fashion_mnist_search_dirs(data_dir):
        if not _missing_files(d):
            return d
    return None


def _not_found_message(dirs: list[Path]) -> str:
    looked = []
    for d in dirs:
        if not d.is_dir():
            looked.append(f"{d} (no such directory)")
        else:
            looked.append(f"{d} (missing {', '.join(_missing_files(d))})")
    return (
        f"Fashion-MNIST not found: need {', '.join(FASHION_MNIST_FILES)}; looked in "
        f"{'; '.join(looked)}. Fix: {FASHION_MNIST_FIX}"
    )


def download_fashion_mnist(
    dest: str | os.PathLike[str] | None = None, *, timeout: float = 60.0
) -> Path:
    """Fetch the four idx files from Zalando's canonical host into ``dest`` (default the cache).

    Files already present are kept. Each file is written to a temporary name and renamed, so an
    interrupted download never leaves a truncated file. Raises :class:`UsageError` when offline.
    """
    target = Path(dest) if dest is not None else cache_dir()
    target.mkdir(parents=True, exist_ok=True)
    for name in _missing_files(target):
        tmp = target / (name + ".part")
        try:
            with urllib.request.urlopen(FASHION_MNIST_URL + name, timeout=timeout) as resp:
                tmp.write_bytes(resp.read())
            read_idx(tmp)  # validate before it takes the real name
            tmp.replace(target / name)
        except (OSError, UsageError) as exc:
            tmp.unlink(missing_ok=True)
            raise UsageError(
                f"download of {FASHION_MNIST_URL}{name} into {target} failed ({exc}). "
                f"Fix: {FASHION_MNIST_FIX}"
            ) from exc
    return target


def _load_fashion_mnist(
    data_dir: str | os.PathLike[str] | None, download: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    directory = find_fashion_mnist(data_dir)
    if directory is None:
        dirs = fashion_mnist_search_dirs(data_dir)
        if not download:
            raise UsageError(_not_found_message(dirs))
        directory = download_fashion_mnist()
    arrays = [read_idx(directory / f) for f in FASHION_MNIST_FILES]
    x_tr, y_tr, x_te, y_te = arrays
    for fname, x, y in ((FASHION_MNIST_FILES[0], x_tr, y_tr), (FASHION_MNIST_FILES[2], x_te, y_te)):
        if x.ndim != 3 or x.shape[1:] != (28, 28) or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise UsageError(
                f"corrupt Fashion-MNIST in {directory}: {fname} has shape {x.shape} with "
                f"{y.shape} labels, expected [N, 28, 28] and [N]; delete the files and fetch again"
            )
        if y.size and int(y.max()) >= 10:
            raise UsageError(
                f"corrupt Fashion-MNIST labels in {directory}: label {int(y.max())} >= 10"
            )
    return x_tr.reshape(len(x_tr), -1), y_tr, x_te.reshape(len(x_te), -1), y_te


# ---------------------------------------------------------------------------------- digits


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (data, target): its bundled ``digits.csv.gz`` read as its
    ``load_digits`` reads it (64 pixel columns then the label, float64), found without
    importing scikit-learn (a second of every worker's start-up); ``load_digits`` itself where
    the file is not in its usual place."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None:
        raise UsageError("dataset 'digits' needs scikit-learn: pip install scikit-learn")
    for root in spec.submodule_search_locations or []:
        path = Path(root) / "datasets" / "data" / "digits.csv.gz"
        if path.is_file():
            with gzip.open(path, "rt") as f:
                data = np.loadtxt(f, delimiter=",")
            return data[:, :-1], data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.data, bunch.target


def _load_digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    data, target = _digits_arrays()
    x = np.asarray(data, dtype=np.float64)
    y = np.asarray(target, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(DIGITS_SPLIT_SEED)))
    test_mask = np.zeros(len(y), dtype=bool)
    for c in np.unique(y):
        idx = rng.permutation(np.flatnonzero(y == c))
        test_mask[idx[: int(round(DIGITS_TEST_FRACTION * len(idx)))]] = True
    return x[~test_mask], y[~test_mask], x[test_mask], y[test_mask]


# --------------------------------------------------------------------------------- teacher


def make_teacher(
    seed: int = 0,
    input_dim: int = TEACHER_INPUT_DIM,
    hidden: int = TEACHER_HIDDEN,
    num_classes: int = TEACHER_CLASSES,
) -> TeacherMLP:
    """The seeded teacher MLP of the ``"teacher"`` dataset.

    Steps: 1. draw W1 ~ N(0, 1/input_dim) and b1 ~ N(0, 0.1^2), W2 ~ N(0, 1/hidden), b2 = 0;
    2. calibrate b2 on 8192 standard-normal inputs (100 damped steps b2 -= 0.3 log(count / target)
    on the argmax counts) so the classes are near-balanced instead of a few dominating the argmax.
    """
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0])))
    w1 = rng.standard_normal((input_dim, hidden)) / np.sqrt(input_dim)
    b1 = 0.1 * rng.standard_normal(hidden)
    w2 = rng.standard_normal((hidden, num_classes)) / np.sqrt(hidden)
    b2 = np.zeros(num_classes)
    calib = rng.standard_normal((8192, input_dim))
    h = np.tanh(calib @ w1 + b1) @ w2
    target = len(calib) / num_classes
    for _ in range(100):
        counts = np.bincount((h + b2).argmax(axis=1), minlength=num_classes)
        b2 -= 0.3 * np.log((counts + 1) / target)
    return TeacherMLP(w1=w1, b1=b1, w2=w2, b2=b2)


def _load_teacher(seed: int, n_train: int, n_test: int) -> tuple[np.ndarray, ...]:
    teacher = make_teacher(seed)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 1])))
    x_tr = rng.standard_normal((n_train, TEACHER_INPUT_DIM)).astype(np.float32)
    x_te = rng.standard_normal((n_test, TEACHER_INPUT_DIM)).astype(np.float32)
    y_tr = teacher.logits(x_tr).argmax(axis=1).astype(np.int64)
    y_te = teacher.logits(x_te).argmax(axis=1).astype(np.int64)
    return x_tr, y_tr, x_te, y_te


# ---------------------------------------------------------------------------------- common


def stratified_subset(labels: np.ndarray, limit: int) -> np.ndarray:
    """Indices of a deterministic stratified subset of size ``min(limit, len(labels))``.

    Classes are dealt round-robin in split order (see the module docstring); the result is sorted.
    """
    labels = np.asarray(labels)
    if limit >= len(labels):
        return np.arange(len(labels))
    # rank of each example within its class, in split order
    order = np.argsort(labels, kind="stable")
    sorted_labels = labels[order]
    starts = np.searchsorted(sorted_labels, sorted_labels, side="left")
    rank_in_class = np.empty(len(labels), dtype=np.int64)
    rank_in_class[order] = np.arange(len(labels)) - starts
    keep = np.lexsort((labels, rank_in_class))[:limit]
    return np.sort(keep)


def _uint8_pixel_stats(x: np.ndarray) -> tuple[float, float]:
    """Mean and std of ``x / 255`` for a uint8 array, exact via integer sums (fast: no float copy)."""
    n = x.size
    total = int(x.sum(dtype=np.uint64))
    flat = x.reshape(-1)
    squares = int(np.einsum("i,i->", flat, flat, dtype=np.uint64))
    mean = total / n
    var = max(squares / n - mean * mean, 0.0)
    std = float(np.sqrt(var)) if var > 0 else 255.0
    return mean / 255.0, std / 255.0


def _normalise(x: np.ndarray, mean: float | np.ndarray, std: float | np.ndarray) -> torch.Tensor:
    """float32 tensor of ``(x / 255 - mean) / std`` for uint8 pixels (one table lookup), else of
    ``(x - mean) / std``."""
    if x.dtype == np.uint8:
        lut = ((np.arange(256) / 255.0 - mean) / std).astype(np.float32)
        out = lut[x]
    else:
        out = ((x - mean) / std).astype(np.float32, copy=False)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def _check_limit(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise UsageError(f"{name} must be a positive integer or unset, got {value!r}")


def _classification(name: str, arrays: tuple[np.ndarray, ...], mean: float | np.ndarray,
                    std: float | np.ndarray, num_classes: int, source: DataSource,
                    input_shape: tuple[int, ...] = ()) -> Dataset:
    """A classification :class:`Dataset` from raw (x_train, y_train, x_test, y_test): the
    source's stratified limits applied, then ``(x - mean) / std`` (uint8 pixels as ``x / 255``)."""
    x_tr, y_tr, x_te, y_te = arrays
    if source.limit_train:
        keep = stratified_subset(y_tr, source.limit_train)
        x_tr, y_tr = x_tr[keep], y_tr[keep]
    if source.limit_test:
        keep = stratified_subset(y_te, source.limit_test)
        x_te, y_te = x_te[keep], y_te[keep]

    def as_y(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))

    return Dataset(
        name=name,
        x_train=_normalise(x_tr, mean, std),
        y_train=as_y(y_tr),
        x_test=_normalise(x_te, mean, std),
        y_test=as_y(y_te),
        num_classes=num_classes,
        input_shape=input_shape,
    )


def load_fashion_mnist(source: DataSource, options: Any, seed: int) -> Dataset:
    """The ``fashion-mnist`` dataset (the module docstring; ``seed`` unused: the split is
    fixed), standardised with the train split's global pixel mean and std."""
    del options, seed
    arrays = _load_fashion_mnist(source.dir or None, source.download)
    mean, std = _uint8_pixel_stats(arrays[0])
    return _classification("fashion-mnist", arrays, mean, std, 10, source, (1, 28, 28))


def load_digits(source: DataSource, options: Any, seed: int) -> Dataset:
    """The ``digits`` dataset (fixed split; ``seed`` unused), standardised per feature with the
    train split's statistics (features constant on train keep std 1)."""
    del options, seed
    arrays = _load_digits()
    mean, std = arrays[0].mean(axis=0), arrays[0].std(axis=0)
    return _classification("digits", arrays, mean, np.where(std > 0, std, 1.0), 10, source,
                           (1, 8, 8))


def load_teacher(source: DataSource, options: Any, seed: int) -> Dataset:
    """The ``teacher`` dataset drawn from ``seed``: the limits are the sizes generated
    (defaults 8192 / 2048), the inputs kept raw so the labels stay exact."""
    del options
    n_train = source.limit_train or TEACHER_TRAIN_DEFAULT
    n_test = source.limit_test or TEACHER_TEST_DEFAULT
    arrays = _load_teacher(seed, n_train, n_test)
    return _classification("teacher", arrays, 0.0, 1.0, TEACHER_CLASSES,
                           DataSource(dir=source.dir, download=source.download))


def load_dataset(
    name: str,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    seed: int = 0,
    limit_train: int | None = None,
    limit_test: int | None = None,
    download: bool = False,
) -> Dataset:
    """Load dataset ``name`` (any of :data:`thinwire.data.DATASETS`, through its entry's
    ``load``) with its default options.

    ``data_dir`` is searched first (and alone) for the dataset's files; ``seed`` drives
    synthetic data only (real splits are fixed); ``limit_train`` / ``limit_test`` take a
    stratified subset (sizes for ``"teacher"``); ``download=True`` allows fetching missing files
    where the dataset has a canonical source. Raises :class:`UsageError` for an unknown name or
    missing/corrupt data.
    """
    _check_limit("limit_train", limit_train)
    _check_limit("limit_test", limit_test)
    entry = DATASETS.get(name)
    source = DataSource(dir=str(data_dir) if data_dir is not None else "", download=download,
                        limit_train=limit_train or 0, limit_test=limit_test or 0)
    return entry.load(source, entry.options(), seed)  # type: ignore[no-any-return]


FASHION_MNIST = DataEntry(
    name="fashion-mnist", kind="classification", load=load_fashion_mnist,
    summary="Fashion-MNIST, 60k + 10k 28x28 grey images, 10 classes (Debian dataset-fashion-mnist)")
DIGITS = DataEntry(
    name="digits", kind="classification", load=load_digits,
    summary="scikit-learn's 8x8 digits, 1797 images, 10 classes (bundled, offline)")
TEACHER = DataEntry(
    name="teacher", kind="classification", load=load_teacher,
    summary="synthetic teacher-student task, 32 inputs, 10 classes (exact, for tests)")
