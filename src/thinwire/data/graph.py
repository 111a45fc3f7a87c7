"""Graphs for node classification: the Cora citation graph and a stochastic block model.

Both give a ``node`` :class:`~thinwire.data.datasets.Dataset`: x = node ids (int64 [N]), y = their
class ids, and the one graph in ``extra``:
- ``"features"``: float32 [nodes, F], dense;
- ``"adjacency"``: the normalised adjacency of Kipf & Welling ("Semi-Supervised Classification
  with Graph Convolutional Networks", ICLR 2017), A_hat = D^-1/2 (A + I) D^-1/2 with D the degrees
  of A + I, as a float32 torch sparse COO tensor [nodes, nodes] (:func:`normalised_adjacency`);
- ``"val_ids"``: int64 node ids of the validation split; ``"labels"``: int64 [nodes], every
  node's class.

``cora`` (Yang, Cohen, Salakhutdinov, "Revisiting Semi-Supervised Learning with Graph
Embeddings", ICML 2016): 2708 papers, 1433 binary bag-of-words features, 7 classes, 5278
undirected citation edges, the standard split of 140 train / 500 validation / 1000 test nodes.
Loading, in steps:
  1. find ``cora.npz`` with the search rules of :func:`thinwire.data.text.search_paths`
     (``DIR/cora.npz`` or ``DIR/cora/cora.npz``; an explicit ``--data.dir`` never falls back;
     the copy shipped with the package, :data:`thinwire.data.text.BUNDLED_DIR`, comes last);
     nothing is downloaded: the public Planetoid files are Python pickles, which are never loaded;
  2. read it with ``np.load(allow_pickle=False)``: arrays ``feature_rows``/``feature_cols`` (the
     nonzero entries of the binary feature matrix), ``num_features`` (optional), ``labels``,
     ``edge_src``/``edge_dst``, ``train_idx``/``val_idx``/``test_idx`` (:data:`CORA_FORMAT`);
  3. features: dense, each row divided by its sum (row normalisation, as Kipf & Welling);
  4. edges: made symmetric, self loops and duplicates dropped, then normalised with I added.

``sbm``: a stochastic block model generated from the seed (:func:`make_sbm`), large enough that a
wide GCN's per-worker memory matters (100,000 nodes by default).

``limit_train`` / ``limit_test`` keep a stratified subset of the train / test node ids
(:func:`~thinwire.data.datasets.stratified_subset`); the graph is always whole.
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from thinwire.data.datasets import Dataset, stratified_subset
from thinwire.data.registry import DataEntry, DataSource
from thinwire.data.text import locate, looked_in
from thinwire.errors import UsageError
from thinwire.options import NoOptions, check, opt

CORA_FILE = "cora.npz"
CORA_FORMAT = (
    "an npz of plain arrays (no pickles): feature_rows, feature_cols (int, the nonzero entries of "
    "the binary node x word matrix), labels (int [nodes]), edge_src, edge_dst (int, directed "
    "entries), train_idx, val_idx, test_idx (int node ids)"
)
CORA_ARRAYS: tuple[str, ...] = ("feature_rows", "feature_cols", "labels", "edge_src", "edge_dst",
                                "train_idx", "val_idx", "test_idx")


# ------------------------------------------------------------------------------ adjacency


def undirected_edges(src: np.ndarray, dst: np.ndarray, nodes: int) -> np.ndarray:
    """The distinct undirected edges {u, v}, u != v, of directed entries src -> dst, as int64
    [E, 2] rows (u < v), sorted."""
    src = np.asarray(src, dtype=np.int64)
    dst = np.asarray(dst, dtype=np.int64)
    keep = src != dst
    lo = np.minimum(src[keep], dst[keep])
    hi = np.maximum(src[keep], dst[keep])
    keys = np.unique(lo * nodes + hi)
    return np.stack([keys // nodes, keys % nodes], axis=1)


def normalised_adjacency(edges: np.ndarray, nodes: int) -> torch.Tensor:
    """A_hat = D^-1/2 (A + I) D^-1/2 of an undirected graph as a coalesced float32 sparse COO
    tensor (COO rather than CSR: it deep-copies, pickles and moves between devices everywhere).

    Steps: 1. A holds both directions of every row (u, v) of ``edges`` (distinct, no self loops);
    2. add one self loop per node; 3. d = row sums of A + I (>= 1); 4. the entry (i, j) is
    1 / sqrt(d_i d_j); 5. sort by (row, column), which makes the tensor coalesced.
    """
    edges = np.asarray(edges, dtype=np.int64).reshape(-1, 2)
    loop = np.arange(nodes, dtype=np.int64)
    rows = np.concatenate([edges[:, 0], edges[:, 1], loop])
    cols = np.concatenate([edges[:, 1], edges[:, 0], loop])
    deg = np.bincount(rows, minlength=nodes).astype(np.float64)
    inv_sqrt = 1.0 / np.sqrt(deg)
    order = np.lexsort((cols, rows))
    rows, cols = rows[order], cols[order]
    values = (inv_sqrt[rows] * inv_sqrt[cols]).astype(np.float32)
    indices = torch.from_numpy(np.stack([rows, cols]))
    return torch.sparse_coo_tensor(indices, torch.from_numpy(values), size=(nodes, nodes),
                                   is_coalesced=True, check_invariants=False)


def node_dataset(name: str, *, features: np.ndarray, labels: np.ndarray, edges: np.ndarray,
                 train_ids: np.ndarray, val_ids: np.ndarray, test_ids: np.ndarray,
                 num_classes: int, source: DataSource) -> Dataset:
    """The ``node`` :class:`Dataset` of one graph (limits applied to train and test ids)."""
    labels = np.asarray(labels, dtype=np.int64)
    train_ids = np.asarray(train_ids, dtype=np.int64)
    test_ids = np.asarray(test_ids, dtype=np.int64)
    if source.limit_train > 0:
        train_ids = train_ids[stratified_subset(labels[train_ids], source.limit_train)]
    if source.limit_test > 0:
        test_ids = test_ids[stratified_subset(labels[test_ids], source.limit_test)]
    nodes = len(labels)
    extra: dict[str, Any] = {
        "features": torch.from_numpy(np.ascontiguousarray(features, dtype=np.float32)),
        "adjacency": normalised_adjacency(edges, nodes),
        "val_ids": torch.from_numpy(np.asarray(val_ids, dtype=np.int64)),
        "labels": torch.from_numpy(labels),
    }
    return Dataset(
        name=name, x_train=torch.from_numpy(train_ids), y_train=torch.from_numpy(labels[train_ids]),
        x_test=torch.from_numpy(test_ids), y_test=torch.from_numpy(labels[test_ids]),
        num_classes=num_classes, kind="node", input_shape=(), extra=extra)


# ----------------------------------------------------------------------------------- cora


def find_cora(data_dir: str = "") -> Path | None:
    """``cora.npz`` by the search rules of the module docstring, or None."""
    return locate("cora", CORA_FILE, data_dir)[0]


def read_cora(path: Path) -> dict[str, np.ndarray]:
    """The arrays of ``cora.npz`` (step 2), checked for presence and consistency; anything wrong
    is a one-line :class:`UsageError` naming the file."""
    fix = f"replace it with {CORA_FORMAT}"
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = [k for k in CORA_ARRAYS if k not in z.files]
            if missing:
                raise UsageError(f"{path} lacks arrays {', '.join(missing)}; {fix}")
            arrays = {k: np.asarray(z[k]) for k in (*CORA_ARRAYS, "num_features")
                      if k in z.files}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise UsageError(f"cannot read {path} as npz without pickles ({exc}); {fix}") from None
    labels = arrays["labels"]
    nodes = len(labels)
    ints = all(np.issubdtype(a.dtype, np.integer) for a in arrays.values())
    ids = [arrays[k] for k in CORA_ARRAYS if k not in ("labels", "feature_cols")]
    if (not ints or labels.ndim != 1 or nodes == 0 or labels.min() < 0
            or any(a.size and (a.min() < 0 or a.max() >= nodes) for a in ids)
            or arrays["feature_rows"].shape != arrays["feature_cols"].shape
            or arrays["edge_src"].shape != arrays["edge_dst"].shape):
        raise UsageError(f"{path} is inconsistent (integer arrays, node ids in [0, "
                         f"{nodes}), paired rows/cols and src/dst expected); {fix}")
    return arrays


def load_cora(source: DataSource, options: NoOptions, seed: int) -> Dataset:
    """The ``cora`` dataset (the module docstring's steps; ``seed`` unused: the split is
    fixed)."""
    del options, seed
    path, looked = locate("cora", CORA_FILE, source.dir)
    if path is None:
        no_download = (" (--data.download cannot help: the public Planetoid files are pickles, "
                       "which thinwire never loads)" if source.download else "")
        raise UsageError(
            f"cora not found: need {CORA_FILE}, {CORA_FORMAT}; looked in {looked_in(looked)}"
            f"{no_download}. Fix: pass --data.dir DIR holding {CORA_FILE} (or DIR/cora/"
            f"{CORA_FILE})")
    a = read_cora(path)
    labels = a["labels"].astype(np.int64)
    nodes = len(labels)
    cols = a["feature_cols"]
    num_features = int(a["num_features"]) if "num_features" in a else (
        int(cols.max()) + 1 if cols.size else 0)
    if cols.size and (cols.min() < 0 or cols.max() >= num_features):
        raise UsageError(f"{path}: feature_cols must lie in [0, {num_features}); replace it "
                         f"with {CORA_FORMAT}")
    features = np.zeros((nodes, num_features), dtype=np.float32)
    features[a["feature_rows"], cols] = 1.0
    row_sum = features.sum(axis=1, keepdims=True)
    features /= np.where(row_sum > 0, row_sum, 1.0)
    return node_dataset(
        "cora", features=features, labels=labels,
        edges=undirected_edges(a["edge_src"], a["edge_dst"], nodes),
        train_ids=a["train_idx"], val_ids=a["val_idx"], test_ids=a["test_idx"],
        num_classes=int(labels.max()) + 1, source=source)


# ------------------------------------------------------------------------------------ sbm


@dataclass(frozen=True)
class SBMOptions:
    """``[data]`` options of the stochastic block model."""

    nodes: int = opt(100_000, "number of nodes")
    communities: int = opt(10, "number of communities (= classes), of near-equal size")
    avg_degree: float = opt(10.0, "mean number of neighbours per node")
    homophily: float = opt(0.8, "fraction of edges joining two nodes of the same community")
    feature_dim: int = opt(128, "features per node")
    feature_noise: float = opt(1.0, "std of the Gaussian noise added to the community mean "
                               "(the means are about 1.4 apart: 1.0 leaves features alone weak)")
    train_per_class: int = opt(20, "labelled training nodes per community")
    val_nodes: int = opt(500, "validation nodes")
    test_nodes: int = opt(10_000, "test nodes")

    def __post_init__(self) -> None:
        check(self.communities >= 2, "data.communities", "use an integer >= 2")
        check(self.nodes >= 2 * self.communities, "data.nodes",
              f"got {self.nodes}; use at least 2 per community (>= {2 * self.communities})")
        check(0.0 <= self.homophily <= 1.0, "data.homophily", "use a fraction in [0, 1]")
        check(0.0 < self.avg_degree <= (self.nodes // self.communities - 1) / 2,
              "data.avg_degree", f"got {self.avg_degree}; use a value in (0, "
              f"{(self.nodes // self.communities - 1) / 2:g}] (sparse graphs only)")
        check(self.feature_dim >= 1, "data.feature_dim", "use an integer >= 1")
        check(self.feature_noise >= 0.0, "data.feature_noise", "use a value >= 0")
        check(self.train_per_class >= 1, "data.train_per_class", "use an integer >= 1")
        check(self.val_nodes >= 0, "data.val_nodes", "use an integer >= 0")
        check(self.test_nodes >= 1, "data.test_nodes", "use an integer >= 1")
        need = self.train_per_class * self.communities + self.val_nodes + self.test_nodes
        check(need <= self.nodes, "data.test_nodes",
              f"train_per_class x communities + val_nodes + test_nodes = {need} exceeds "
              f"data.nodes={self.nodes}; lower them or raise data.nodes")


@dataclass(frozen=True, eq=False)
class SBMGraph:
    """A generated stochastic block model graph (numpy arrays)."""

    labels: np.ndarray
    """int64 [nodes]: each node's community."""
    edges: np.ndarray
    """int64 [E, 2]: distinct undirected edges (u < v), no self loops."""
    features: np.ndarray
    """float32 [nodes, feature_dim]."""
    train_ids: np.ndarray
    val_ids: np.ndarray
    test_ids: np.ndarray


def _draw_member(rng: np.random.Generator, community: np.ndarray, members: np.ndarray,
                 starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """One uniformly random node of each given community (``members`` sorted by community)."""
    offset = np.floor(rng.random(len(community)) * sizes[community]).astype(np.int64)
    return members[starts[community] + np.minimum(offset, sizes[community] - 1)]


def make_sbm(options: SBMOptions, seed: int) -> SBMGraph:
    """A stochastic block model graph drawn from ``seed`` (vectorised numpy, no per-node loops).

    Steps:
      1. communities: node i gets ``i mod C``, then the labels are shuffled (sizes differ by <= 1);
      2. m = round(nodes x avg_degree / 2) undirected edges: each candidate edge takes a uniform
         source node u; with probability ``homophily`` its other end is a uniform node of u's
         community, otherwise a uniform node of a uniform other community; 5 % extra candidates
         are drawn, self loops dropped, duplicates ({u, v} seen before) dropped, and the first m
         survivors in draw order kept;
      3. features: community means drawn N(0, 1/F) per coordinate (so two means are about
         sqrt(2) apart), plus ``feature_noise`` x N(0, 1) noise per node and coordinate;
      4. split, from one permutation of the nodes: the first ``train_per_class`` of each
         community train, then ``val_nodes`` and ``test_nodes`` of the remaining nodes in order.
    """
    o = options
    n, c = o.nodes, o.communities
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x5B3])))
    labels = rng.permutation(np.arange(n, dtype=np.int64) % c)
    members = np.argsort(labels, kind="stable")
    sizes = np.bincount(labels, minlength=c).astype(np.int64)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)

    m = int(round(n * o.avg_degree / 2))
    draws = m + m // 20 + 16
    u = rng.integers(0, n, size=draws, dtype=np.int64)
    inside = rng.random(draws) < o.homophily
    other = (labels[u] + rng.integers(1, c, size=draws, dtype=np.int64)) % c
    v = _draw_member(rng, np.where(inside, labels[u], other), members, starts, sizes)
    ok = u != v
    u, v = u[ok], v[ok]
    keys = np.minimum(u, v) * n + np.maximum(u, v)
    _, first = np.unique(keys, return_index=True)
    kept = keys[np.sort(first)[:m]]
    edges = np.stack([kept // n, kept % n], axis=1)

    means = rng.standard_normal((c, o.feature_dim), dtype=np.float32)
    means *= np.float32(1.0 / np.sqrt(o.feature_dim))
    features = rng.standard_normal((n, o.feature_dim), dtype=np.float32)
    features *= np.float32(o.feature_noise)
    features += means[labels]

    order = rng.permutation(n)
    rank = np.empty(n, dtype=np.int64)  # position of each node within its community in `order`
    by_class = np.argsort(labels[order], kind="stable")
    rank[order[by_class]] = np.arange(n) - starts[labels[order[by_class]]]
    is_train = rank < o.train_per_class
    train_ids = order[is_train[order]]
    rest = order[~is_train[order]]
    val_ids = rest[: o.val_nodes]
    test_ids = rest[o.val_nodes: o.val_nodes + o.test_nodes]
    return SBMGraph(labels=labels, edges=edges, features=features, train_ids=train_ids,
                    val_ids=val_ids, test_ids=test_ids)


def load_sbm(source: DataSource, options: SBMOptions, seed: int) -> Dataset:
    """The ``sbm`` dataset drawn from ``seed`` (:func:`make_sbm`); ``dir`` and ``download`` are
    unused."""
    g = make_sbm(options, seed)
    return node_dataset("sbm", features=g.features, labels=g.labels, edges=g.edges,
                        train_ids=g.train_ids, val_ids=g.val_ids, test_ids=g.test_ids,
                        num_classes=options.communities, source=source)


CORA = DataEntry(
    name="cora", kind="node", load=load_cora,
    summary="Cora citation graph, 2708 nodes, 1433 features, 7 classes, 140/500/1000 split",
    batch_size=32)
SBM = DataEntry(
    name="sbm", kind="node", load=load_sbm,
    summary="stochastic block model graph from the seed (100k nodes, 10 communities by default)",
    options=SBMOptions)
