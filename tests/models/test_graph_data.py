"""Graph datasets: Cora against its README, the normalised adjacency, the SBM generator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from harness import one_line

from thinwire.data import DATASETS, DataSource
from thinwire.data.graph import (
    SBMOptions,
    make_sbm,
    normalised_adjacency,
    undirected_edges,
)
from thinwire.errors import UsageError
from thinwire.options import OptionError, build_options

CORA = DATASETS.get("cora")
SBM = DATASETS.get("sbm")
SMALL_SBM: dict[str, Any] = {"nodes": 3000, "communities": 5, "avg_degree": 8.0,
                             "feature_dim": 16, "train_per_class": 10, "val_nodes": 100,
                             "test_nodes": 500}


def load_cora(directory: Path, **source: Any) -> Any:
    return CORA.load(DataSource(dir=str(directory), **source), CORA.options(), 0)


# ---------------------------------------------------------------------------------- cora


def test_cora_matches_its_readme(cora_dir: Path) -> None:
    ds = load_cora(cora_dir)
    assert ds.kind == CORA.kind == "node"
    features, adjacency = ds.extra["features"], ds.extra["adjacency"]
    labels = ds.extra["labels"]
    assert features.shape == (2708, 1433) and features.dtype == torch.float32
    assert ds.num_classes == 7
    assert torch.bincount(labels).tolist() == [351, 217, 418, 818, 426, 298, 180]
    assert (len(ds.x_train), len(ds.extra["val_ids"]), len(ds.x_test)) == (140, 500, 1000)
    assert ds.x_train.dtype == ds.x_test.dtype == torch.int64
    assert torch.equal(ds.y_train, labels[ds.x_train])
    assert torch.equal(ds.y_test, labels[ds.x_test])
    assert torch.bincount(ds.y_train).tolist() == [20] * 7
    train, val, test = (set(t.tolist()) for t in (ds.x_train, ds.extra["val_ids"], ds.x_test))
    assert not (train & val or train & test or val & test)
    # row-normalised bag of words: every row sums to 1 (Cora has no empty rows)
    assert torch.allclose(features.sum(1), torch.ones(2708), atol=1e-5)
    # 10,858 directed entries hold 5,278 distinct undirected edges; A_hat adds one loop per node
    assert adjacency.is_sparse and adjacency.shape == (2708, 2708)
    assert adjacency._nnz() == 2 * 5278 + 2708


def test_cora_limits_are_stratified(cora_dir: Path) -> None:
    ds = load_cora(cora_dir, limit_train=35, limit_test=70)
    assert torch.bincount(ds.y_train).tolist() == [5] * 7
    assert torch.bincount(ds.y_test, minlength=7).tolist() == [10] * 7
    assert ds.extra["features"].shape[0] == 2708  # the graph stays whole


def test_normalised_adjacency_is_kipf_welling() -> None:
    src = np.array([0, 1, 1, 2, 2, 3, 3, 0])  # a path 0-1-2-3, a duplicate, a self loop 3-3
    dst = np.array([1, 0, 2, 1, 3, 3, 2, 1])
    edges = undirected_edges(src, dst, 5)
    assert edges.tolist() == [[0, 1], [1, 2], [2, 3]]
    a_hat = normalised_adjacency(edges, 5).to_dense()
    a = torch.zeros(5, 5)
    for u, v in edges.tolist():
        a[u, v] = a[v, u] = 1.0
    a += torch.eye(5)
    d = a.sum(1).rsqrt()
    assert torch.allclose(a_hat, d[:, None] * a * d[None, :])
    assert torch.equal(a_hat, a_hat.T)
    assert a_hat[4, 4] == 1.0  # an isolated node keeps itself


def test_cora_missing_is_one_line_naming_the_format(isolated: Path) -> None:
    (isolated / "empty").mkdir()
    with pytest.raises(UsageError, match="cora not found") as exc:
        load_cora(isolated / "empty")
    message = one_line(exc)
    assert str(isolated / "empty" / "cora.npz") in message
    assert "feature_rows" in message and "--data.dir" in message
    with pytest.raises(UsageError, match="pickles") as exc:
        load_cora(isolated / "empty", download=True)
    one_line(exc)


def test_cora_explicit_dir_never_falls_back(isolated: Path, monkeypatch: pytest.MonkeyPatch,
                                            cora_dir: Path) -> None:
    monkeypatch.setenv("THINWIRE_DATA_DIR", str(cora_dir))
    assert CORA.load(DataSource(), CORA.options(), 0).x_train.shape == (140,)
    (isolated / "empty").mkdir()
    with pytest.raises(UsageError, match="cora not found") as exc:
        load_cora(isolated / "empty")
    assert str(cora_dir) not in one_line(exc)


def test_cora_refuses_pickles_and_broken_files(isolated: Path) -> None:
    d = isolated / "d"
    d.mkdir()
    arrays = {k: np.zeros(2, dtype=np.int64) for k in
              ("feature_rows", "feature_cols", "edge_src", "edge_dst", "train_idx", "val_idx",
               "test_idx")}
    np.savez(d / "cora.npz", labels=np.array([{"a": 1}, 2], dtype=object), **arrays)
    with pytest.raises(UsageError, match="without pickles") as exc:
        load_cora(d)
    one_line(exc)
    (d / "cora.npz").write_bytes(b"not a zip file")
    with pytest.raises(UsageError, match="cannot read") as exc:
        load_cora(d)
    one_line(exc)
    np.savez(d / "cora.npz", labels=np.zeros(3, dtype=np.int64))
    with pytest.raises(UsageError, match="lacks arrays") as exc:
        load_cora(d)
    one_line(exc)
    arrays["edge_dst"] = np.array([0, 7])  # node 7 of 2
    np.savez(d / "cora.npz", labels=np.zeros(2, dtype=np.int64), **arrays)
    with pytest.raises(UsageError, match="inconsistent") as exc:
        load_cora(d)
    one_line(exc)


# ----------------------------------------------------------------------------------- sbm


def test_sbm_same_seed_same_graph_other_seed_other_graph() -> None:
    options = SBMOptions(**SMALL_SBM)
    a, b, c = make_sbm(options, 3), make_sbm(options, 3), make_sbm(options, 4)
    for field in ("labels", "edges", "features", "train_ids", "val_ids", "test_ids"):
        assert np.array_equal(getattr(a, field), getattr(b, field)), field
    assert not np.array_equal(a.edges, c.edges)
    assert not np.array_equal(a.features, c.features)


def test_sbm_size_homophily_and_split() -> None:
    o = SBMOptions(**{**SMALL_SBM, "homophily": 0.7})
    g = make_sbm(o, 0)
    n, c = o.nodes, o.communities
    assert np.bincount(g.labels).tolist() == [n // c] * c
    assert g.edges.shape == (round(n * o.avg_degree / 2), 2)  # exactly m distinct edges
    u, v = g.edges[:, 0], g.edges[:, 1]
    assert (u < v).all() and len(np.unique(u * n + v)) == len(u)  # no loops, no duplicates
    inside = float((g.labels[u] == g.labels[v]).mean())
    assert abs(inside - 0.7) < 0.03, inside
    assert g.features.shape == (n, 16) and g.features.dtype == np.float32
    assert np.bincount(g.labels[g.train_ids]).tolist() == [10] * c
    assert (len(g.val_ids), len(g.test_ids)) == (100, 500)
    ids = np.concatenate([g.train_ids, g.val_ids, g.test_ids])
    assert len(np.unique(ids)) == len(ids)


def test_sbm_dataset_through_the_registry() -> None:
    options = build_options(SBM.options, {k: str(v) for k, v in SMALL_SBM.items()}, "data")
    ds = SBM.load(DataSource(limit_test=50), options, 1)
    assert ds.kind == "node" and ds.num_classes == 5
    assert ds.x_train.shape == (50,) and ds.x_test.shape == (50,)
    a_hat = ds.extra["adjacency"]
    assert a_hat.shape == (3000, 3000) and a_hat._nnz() == 2 * 12000 + 3000
    assert torch.equal(ds.y_test, ds.extra["labels"][ds.x_test])


def test_sbm_default_size() -> None:
    g = make_sbm(SBMOptions(), 0)
    assert g.edges.shape == (500_000, 2) and g.features.shape == (100_000, 128)
    ds = SBM.load(DataSource(), SBM.options(), 0)  # the same graph with its normalised A_hat
    assert ds.extra["adjacency"]._nnz() == 2 * 500_000 + 100_000
    assert np.array_equal(ds.extra["features"].numpy(), g.features)
    assert (len(ds.x_train), len(ds.extra["val_ids"]), len(ds.x_test)) == (200, 500, 10_000)


@pytest.mark.parametrize("values, name", [
    ({"homophily": 1.5}, "data.homophily"),
    ({"communities": 1}, "data.communities"),
    ({"nodes": 2000, "test_nodes": 1900}, "data.test_nodes"),
    ({"avg_degree": 0.0}, "data.avg_degree"),
])
def test_sbm_options_are_validated(values: dict[str, Any], name: str) -> None:
    with pytest.raises(OptionError, match=name) as exc:
        build_options(SBM.options, values, "data")
    one_line(exc)
