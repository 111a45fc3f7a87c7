"""Character-level text for language modelling: Karpathy's tiny-shakespeare corpus.

``tinyshakespeare``: the 1,115,394-character concatenation of Shakespeare's works that Karpathy
published with char-rnn ("The Unreasonable Effectiveness of Recurrent Neural Networks", 2015),
md5 ``6fb458f1232090904fb40fe944165e91``. Any other UTF-8 text file in its place is accepted
(users may bring their own corpus); an empty or undecodable file is a one-line error.

Loading, in steps:
  1. find ``input.txt`` (:func:`locate`): with ``--data.dir DIR`` only ``DIR/input.txt`` and
     ``DIR/tinyshakespeare/input.txt`` are looked at (an explicit directory never falls back
     elsewhere); otherwise ``$THINWIRE_DATA_DIR`` (the same two arrangements), then the user cache
     ``~/.cache/thinwire/tinyshakespeare/`` (``$XDG_CACHE_HOME`` honoured), then the copy that
     ships with thinwire (:data:`BUNDLED_DIR`), so the default needs no set-up;
  2. when it is found nowhere and ``--data.download true`` is given, fetch it from the canonical
     URL (:func:`download_text`) into the cache, or into ``DIR`` when one was named: written to a
     temporary name, md5-checked, then renamed, so no truncated file ever takes the real name;
  3. decode as UTF-8; the vocabulary is the sorted set of the text's characters (65 for
     tiny-shakespeare), and every character becomes its index in it (:func:`encode`);
  4. split: the first 90 % of the characters train, the last 10 % validate (the test split);
  5. cut each split into non-overlapping windows of ``seq_len`` (:func:`windows`): window i is
     x = chars[i L : (i + 1) L] with targets y = chars[i L + 1 : (i + 1) L + 1], int64 [N, L];
  6. ``limit_train`` / ``limit_test`` keep the first N windows of each split.

The dataset's ``extra["vocab"]`` is the vocabulary as one string (index -> character), for
:func:`decode`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from thinwire.data.datasets import DATA_DIR_ENV, Dataset
from thinwire.data.registry import DataEntry, DataSource
from thinwire.errors import UsageError
from thinwire.options import check, opt

TINYSHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
)
TINYSHAKESPEARE_MD5 = "6fb458f1232090904fb40fe944165e91"
TINYSHAKESPEARE_FILE = "input.txt"
TRAIN_FRACTION = 0.9
"""The first 90 % of the characters train, the rest is the validation (test) split."""
BUNDLED_DIR = Path(__file__).resolve().parent / "files"
"""The data that ships inside the package (``BUNDLED_DIR/NAME/FILE``: tiny-shakespeare's
``input.txt``, Cora's ``cora.npz``; sources and licences in its README.md): the last place a
default search looks, so a model's default dataset works on a fresh install."""


# ------------------------------------------------------------------------- files, shared


def cache_dir(name: str) -> Path:
    """The user cache of dataset ``name``: ``$XDG_CACHE_HOME/thinwire/NAME`` (default
    ``~/.cache``)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "thinwire" / name


def search_paths(name: str, filename: str, data_dir: str = "") -> list[Path]:
    """Candidate paths of dataset ``name``'s file, in search order.

    1. ``data_dir`` given: ``data_dir/filename`` and ``data_dir/name/filename``, nothing else;
    2. otherwise ``$THINWIRE_DATA_DIR`` in the same two arrangements (when set), then
       ``cache_dir(name)/filename``, then ``BUNDLED_DIR/name/filename`` (the copy shipped with
       the package, for the datasets that have one).
    """
    if data_dir:
        roots = [Path(data_dir)]
    else:
        env = os.environ.get(DATA_DIR_ENV)
        roots = [Path(env)] if env else []
    paths = [p for root in roots for p in (root / filename, root / name / filename)]
    if not data_dir:
        paths.append(cache_dir(name) / filename)
        bundled = BUNDLED_DIR / name / filename
        if bundled.is_file():
            paths.append(bundled)
    return list(dict.fromkeys(paths))


def locate(name: str, filename: str, data_dir: str = "") -> tuple[Path | None, list[Path]]:
    """(the first existing file of :func:`search_paths`, or None; the paths looked at)."""
    paths = search_paths(name, filename, data_dir)
    for p in paths:
        if p.is_file():
            return p, paths
    return None, paths


def looked_in(paths: list[Path]) -> str:
    """The searched paths for a not-found message, noting which directories do not exist."""
    return "; ".join(f"{p}" if p.parent.is_dir() else f"{p} (no such directory)" for p in paths)


def md5_of(path: str | os.PathLike[str]) -> str:
    """Hex md5 of a file's bytes."""
    digest = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def download_text(url: str, dest: Path, md5: str, *, timeout: float = 60.0) -> Path:
    """Fetch ``url`` to file ``dest``: a temporary name in the same directory, md5-checked, then
    renamed (atomic on one filesystem, so concurrent ranks never see a partial file).

    Raises :class:`UsageError` when offline or when the bytes' md5 is not ``md5``."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            out.write(resp.read())
        got = md5_of(tmp)
        if got != md5:
            raise UsageError(f"download of {url} has md5 {got}, expected {md5}; try again later "
                             f"or place the file at {dest} yourself")
        os.replace(tmp, dest)
    except OSError as exc:
        raise UsageError(f"download of {url} into {dest.parent} failed ({exc}); place the file "
                         f"at {dest} yourself or pass --data.dir DIR holding it") from exc
    finally:
        tmp.unlink(missing_ok=True)
    return dest


# ------------------------------------------------------------------------------ encoding


def encode(text: str) -> tuple[str, np.ndarray]:
    """(vocabulary: the sorted distinct characters as one string, int64 ids of every character).

    Vectorised: the text's code points (UTF-32) are looked up in the sorted unique code points."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
    vocab_codes = np.unique(codes)
    ids = np.searchsorted(vocab_codes, codes).astype(np.int64)
    vocab = "".join(map(chr, vocab_codes.tolist()))
    return vocab, ids


def decode(vocab: str, ids: np.ndarray | torch.Tensor) -> str:
    """The text of token ids under ``vocab`` (inverse of :func:`encode`)."""
    return "".join(vocab[int(i)] for i in np.asarray(ids).reshape(-1))


def windows(ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping next-token windows of ``ids``: x, y int64 [N, seq_len] with
    N = (len(ids) - 1) // seq_len, x[i] = ids[i L:(i+1) L] and y[i] = ids[i L + 1:(i+1) L + 1]."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    n = max(len(ids) - 1, 0) // seq_len
    x = np.ascontiguousarray(ids[: n * seq_len], dtype=np.int64).reshape(n, seq_len)
    y = np.ascontiguousarray(ids[1: n * seq_len + 1], dtype=np.int64).reshape(n, seq_len)
    return x, y


def read_text(path: Path) -> str:
    """The UTF-8 text of ``path``; an unreadable, empty or undecodable file is a one-line
    :class:`UsageError`."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc}; check its permissions") from exc
    if not raw:
        raise UsageError(f"{path} is empty; give a UTF-8 text file (e.g. tiny-shakespeare)")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason}); give a "
                         f"UTF-8 text file (e.g. tiny-shakespeare)") from None


# ------------------------------------------------------------------------ tinyshakespeare


@dataclass(frozen=True)
class Options:
    """``[data]`` options of tiny-shakespeare."""

    seq_len: int = opt(64, "characters per training window (the GPT's context length)")

    def __post_init__(self) -> None:
        check(self.seq_len >= 1, "data.seq_len", f"got {self.seq_len}; use an integer >= 1")


def find_tinyshakespeare(data_dir: str = "") -> Path | None:
    """The corpus file by the search rules of the module docstring, or None."""
    return locate("tinyshakespeare", TINYSHAKESPEARE_FILE, data_dir)[0]


def text_dataset(name: str, text: str, seq_len: int, *, limit_train: int = 0,
                 limit_test: int = 0, origin: str = "") -> Dataset:
    """Steps 3-6 of the module docstring on ``text``: a ``sequence`` :class:`Dataset`."""
    vocab, ids = encode(text)
    split = int(len(ids) * TRAIN_FRACTION)
    x_tr, y_tr = windows(ids[:split], seq_len)
    x_te, y_te = windows(ids[split:], seq_len)
    if len(x_tr) == 0 or len(x_te) == 0:
        where = f" in {origin}" if origin else ""
        raise UsageError(
            f"{name}: the text{where} has {len(ids)} characters, too few for one window of "
            f"data.seq_len={seq_len} in its last 10 %; lower data.seq_len or give a longer text")
    if limit_train > 0:
        x_tr, y_tr = x_tr[:limit_train], y_tr[:limit_train]
    if limit_test > 0:
        x_te, y_te = x_te[:limit_test], y_te[:limit_test]
    return Dataset(
        name=name, x_train=torch.from_numpy(x_tr), y_train=torch.from_numpy(y_tr),
        x_test=torch.from_numpy(x_te), y_test=torch.from_numpy(y_te), num_classes=len(vocab),
        kind="sequence", input_shape=(seq_len,), extra={"vocab": vocab})


def load_tinyshakespeare(source: DataSource, options: Options, seed: int) -> Dataset:
    """The ``tinyshakespeare`` dataset (the module docstring's steps; ``seed`` is unused: the
    split is fixed)."""
    del seed
    path, looked = locate("tinyshakespeare", TINYSHAKESPEARE_FILE, source.dir)
    if path is None:
        if not source.download:
            raise UsageError(
                f"tinyshakespeare not found: need {TINYSHAKESPEARE_FILE}; looked in "
                f"{looked_in(looked)}. Fix: pass --data.dir DIR holding {TINYSHAKESPEARE_FILE} "
                f"(or DIR/tinyshakespeare/{TINYSHAKESPEARE_FILE}), or --data.download true "
                f"when online")
        target = (Path(source.dir) if source.dir else cache_dir("tinyshakespeare"))
        path = download_text(TINYSHAKESPEARE_URL, target / TINYSHAKESPEARE_FILE,
                             TINYSHAKESPEARE_MD5)
    return text_dataset("tinyshakespeare", read_text(path), options.seq_len,
                        limit_train=source.limit_train, limit_test=source.limit_test,
                        origin=str(path))


TINYSHAKESPEARE = DataEntry(
    name="tinyshakespeare", kind="sequence", load=load_tinyshakespeare,
    summary="tiny-shakespeare, 1.1M characters, 65-character vocabulary (char-level LM)",
    options=Options)
