"""The data a model's default run needs ships with the package: on a machine with no
$THINWIRE_DATA_DIR and an empty user cache, ``thinwire train --model gpt`` and ``--model gcn``
pass the pre-flight with no other option, reading the bundled tiny-shakespeare and Cora."""

from __future__ import annotations

from pathlib import Path

import pytest

from thinwire.config import load
from thinwire.data import DATASETS
from thinwire.data.text import BUNDLED_DIR, TINYSHAKESPEARE_MD5, md5_of, search_paths
from thinwire.run import preflight

CORA_MD5 = "ab6f93c19e80c31efe986306ded59dc4"


@pytest.fixture
def bare(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("THINWIRE_DATA_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path


def test_the_bundled_files_are_the_published_ones() -> None:
    assert md5_of(BUNDLED_DIR / "tinyshakespeare" / "input.txt") == TINYSHAKESPEARE_MD5
    assert md5_of(BUNDLED_DIR / "cora" / "cora.npz") == CORA_MD5


def test_the_bundled_copy_is_searched_last(bare: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = search_paths("cora", "cora.npz")
    assert paths[-1] == BUNDLED_DIR / "cora" / "cora.npz"
    assert paths[-2] == bare / "cache" / "thinwire" / "cora" / "cora.npz"
    assert BUNDLED_DIR not in [p.parents[1] for p in search_paths("cora", "cora.npz", "/d")]
    assert all(BUNDLED_DIR not in p.parents for p in search_paths("other", "x.txt"))


@pytest.mark.parametrize("model, data, classes, train", [
    ("gpt", "tinyshakespeare", 65, 15_685),
    ("gcn", "cora", 7, 140),
])
def test_a_default_run_needs_no_data_option(bare: Path, model: str, data: str, classes: int,
                                            train: int) -> None:
    cfg = load(None, {"model.name": model})
    assert cfg.data.name == data and cfg.data.dir == ""
    ds = preflight(cfg)  # every default worker's shard holds a batch
    assert (ds.name, ds.num_classes, len(ds.x_train)) == (data, classes, train)
    assert cfg.train.batch_size * cfg.runtime.workers <= train


def test_a_dataset_batch_default_yields_to_the_config() -> None:
    assert DATASETS.get("cora").batch_size == 32
    assert load(None, {"model.name": "gcn"}).train.batch_size == 32
    assert load(None, {"model.name": "gcn", "train.batch_size": 8}).train.batch_size == 8
    assert load(None, {"model.name": "mlp"}).train.batch_size == 128
