"""tinyshakespeare: the corpus, its windows, the search rules and their one-line errors."""

from __future__ import annotations

import io
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import one_line
from hypothesis import given, settings
from hypothesis import strategies as st

from thinwire.data import DATASETS, DataSource
from thinwire.data import text as text_mod
from thinwire.data.text import (
    TINYSHAKESPEARE_MD5,
    decode,
    encode,
    md5_of,
    windows,
)
from thinwire.errors import UsageError
from thinwire.options import OptionError, build_options

ENTRY = DATASETS.get("tinyshakespeare")
CORPUS = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40


def load(source: DataSource, **options: Any) -> Any:
    return ENTRY.load(source, build_options(ENTRY.options, options, "data"), 0)


# ------------------------------------------------------------------------------ the corpus


def test_shared_corpus_md5_vocab_and_windows(shakespeare_dir: Path) -> None:
    path = shakespeare_dir / "tinyshakespeare" / "input.txt"
    assert md5_of(path) == TINYSHAKESPEARE_MD5
    ds = load(DataSource(dir=str(shakespeare_dir)))
    assert ds.kind == "sequence" and ENTRY.kind == "sequence"
    assert ds.num_classes == 65 and len(ds.extra["vocab"]) == 65
    text = path.read_text(encoding="utf-8")
    assert len(text) == 1_115_394
    split = int(len(text) * 0.9)
    assert ds.x_train.shape == ((split - 1) // 64, 64) == (15685, 64)
    assert ds.x_test.shape == ((len(text) - split - 1) // 64, 64) == (1742, 64)
    assert ds.x_train.dtype == ds.y_train.dtype == torch.int64
    assert ds.input_shape == (64,)
    vocab = ds.extra["vocab"]
    assert vocab == "".join(sorted(set(text)))
    assert decode(vocab, ds.x_train[0]) == text[:64]
    assert decode(vocab, ds.y_train[0]) == text[1:65]
    assert decode(vocab, ds.x_test[1]) == text[split + 64: split + 128]
    assert torch.equal(ds.x_train[:, 1:], ds.y_train[:, :-1])


def test_seq_len_and_limits_keep_the_first_windows(shakespeare_dir: Path) -> None:
    full = load(DataSource(dir=str(shakespeare_dir)), seq_len=32)
    part = load(DataSource(dir=str(shakespeare_dir), limit_train=10, limit_test=3), seq_len=32)
    assert full.x_train.shape[1] == 32 and full.input_shape == (32,)
    assert part.x_train.shape == (10, 32) and part.x_test.shape == (3, 32)
    assert torch.equal(part.x_train, full.x_train[:10])
    assert torch.equal(part.y_test, full.y_test[:3])


def test_seq_len_option_is_validated() -> None:
    with pytest.raises(OptionError, match="data.seq_len") as exc:
        build_options(ENTRY.options, {"seq_len": 0}, "data")
    one_line(exc)


# ------------------------------------------------------------------------------ windowing


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(0, 9), max_size=300), seq_len=st.integers(1, 40))
def test_windows_are_non_overlapping_next_token_pairs(ids: list[int], seq_len: int) -> None:
    arr = np.asarray(ids, dtype=np.int64)
    x, y = windows(arr, seq_len)
    n = max(len(ids) - 1, 0) // seq_len
    assert x.shape == y.shape == (n, seq_len)
    assert x.dtype == y.dtype == np.int64
    assert np.array_equal(x.reshape(-1), arr[: n * seq_len])
    assert np.array_equal(y.reshape(-1), arr[1: n * seq_len + 1])
    if n:  # every target is the next token of its input
        assert np.array_equal(x[:, 1:], y[:, :-1])
        assert y[-1, -1] == arr[n * seq_len]


@settings(max_examples=60, deadline=None)
@given(text=st.text(min_size=1, max_size=200))
def test_encode_is_sorted_vocab_and_decodes_back(text: str) -> None:
    vocab, ids = encode(text)
    assert vocab == "".join(sorted(set(text)))
    assert ids.dtype == np.int64 and len(ids) == len(text)
    assert decode(vocab, ids) == text


# ---------------------------------------------------------------------------- search rules


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


@pytest.mark.parametrize("layout", ["input.txt", "tinyshakespeare/input.txt"])
def test_explicit_dir_in_both_layouts(isolated: Path, layout: str) -> None:
    write(isolated / "mine" / layout, CORPUS)
    ds = load(DataSource(dir=str(isolated / "mine")), seq_len=8)
    assert ds.extra["vocab"] == "".join(sorted(set(CORPUS)))  # any UTF-8 corpus is accepted


def test_env_dir_then_cache(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(isolated / "cache" / "thinwire" / "tinyshakespeare" / "input.txt", CORPUS)
    assert load(DataSource(), seq_len=8).num_classes == len(set(CORPUS))
    other = CORPUS.upper()
    write(isolated / "env" / "tinyshakespeare" / "input.txt", other)
    monkeypatch.setenv("THINWIRE_DATA_DIR", str(isolated / "env"))
    assert load(DataSource(), seq_len=8).extra["vocab"] == "".join(sorted(set(other)))


def test_explicit_empty_dir_never_falls_back(isolated: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write(isolated / "cache" / "thinwire" / "tinyshakespeare" / "input.txt", CORPUS)
    write(isolated / "env" / "input.txt", CORPUS)
    monkeypatch.setenv("THINWIRE_DATA_DIR", str(isolated / "env"))
    (isolated / "empty").mkdir()
    with pytest.raises(UsageError) as exc:
        load(DataSource(dir=str(isolated / "empty")))
    message = one_line(exc)
    assert str(isolated / "empty" / "input.txt") in message
    assert str(isolated / "env") not in message and str(isolated / "cache") not in message
    assert "--data.dir" in message and "--data.download true" in message


def test_not_found_names_where_it_looked(isolated: Path) -> None:
    with pytest.raises(UsageError, match="tinyshakespeare not found") as exc:
        load(DataSource())
    message = one_line(exc)
    assert str(isolated / "cache" / "thinwire" / "tinyshakespeare" / "input.txt") in message


@pytest.mark.parametrize("content, match", [
    (b"", "is empty"),
    (b"caf\xe9 latin-1 text\n" * 20, "not UTF-8"),
    (b"tiny", "too few"),
])
def test_bad_files_are_one_line_errors(isolated: Path, content: bytes, match: str) -> None:
    write(isolated / "d" / "input.txt", content)
    with pytest.raises(UsageError, match=match) as exc:
        load(DataSource(dir=str(isolated / "d")))
    one_line(exc)


class FakeResponse(io.BytesIO):
    def __enter__(self) -> FakeResponse:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def test_download_is_md5_checked_and_atomic(isolated: Path, monkeypatch: pytest.MonkeyPatch,
                                            shakespeare_dir: Path) -> None:
    good = (shakespeare_dir / "tinyshakespeare" / "input.txt").read_bytes()
    cache = isolated / "cache" / "thinwire" / "tinyshakespeare"
    urls: list[str] = []

    def fake(payload: bytes) -> Any:
        def urlopen(url: str, timeout: float = 0.0) -> FakeResponse:
            urls.append(url)
            return FakeResponse(payload)
        return urlopen

    monkeypatch.setattr(urllib.request, "urlopen", fake(b"not the corpus\n" * 100))
    with pytest.raises(UsageError, match="md5") as exc:
        load(DataSource(download=True))
    one_line(exc)
    assert list(cache.iterdir()) == []  # nothing half-written under any name
    monkeypatch.setattr(urllib.request, "urlopen", fake(good))
    ds = load(DataSource(download=True, limit_train=2, limit_test=2))
    assert urls == [text_mod.TINYSHAKESPEARE_URL] * 2
    assert [p.name for p in cache.iterdir()] == ["input.txt"]
    assert md5_of(cache / "input.txt") == TINYSHAKESPEARE_MD5
    assert ds.num_classes == 65
