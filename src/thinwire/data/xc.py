"""Extreme multi-label classification data: a synthetic generator and the XC Repository's format.

Examples of kind ``extreme`` (:data:`~thinwire.data.datasets.KINDS`) are sparse: x is float32
[N, 2, P], row 0 the feature ids (exact small integers; padding id 0 with value 0), row 1 their
values; y is int64 [N, Y], the label ids padded with -1. :func:`pack_rows` builds them.

``xc-synth``: a generator from the seed with a known best precision. Steps:
  1. ``labels`` labels; label c is the *primary* label of topic c; topic c's label set is {c}
     plus ``extra`` labels drawn by popularity p(l) ~ 1 / (l + 1)^``zipf``, and its prototype
     is ``proto`` distinct feature ids drawn uniformly from ``features``;
  2. an example picks a topic with probability ~ 1 / (c + 1)^``zipf``, then ``nnz`` features,
     each from the topic's prototype with probability 1 - ``noise`` (uniformly) and uniformly
     from all features otherwise (value 1 each; repeats allowed);
  3. its labels are the topic's label set.
The Bayes posterior of the topic given x is proportional to pi_t gamma^(n_t(x)), n_t(x) the
number of x's draws that fall in t's prototype and gamma = 1 + (1 - noise) F / (proto noise);
ranking the labels by their posterior probability of being in the label set is the best
predictor for precision@k, so :func:`bayes_precision` gives the best precision reachable on
the test split (``extra["best_p1"]``, ``extra["best_p5"]``).

``xc-repo``: the Extreme Classification Repository's text format (Bhatia et al., the XC
Repository; Amazon-670K, Delicious-200K, WikiLSH-325K): a header line ``N F C``, then one line
per example ``l1,l2,... f1:v1 f2:v2 ...`` (0-based ids; a line with no labels starts with a
space). Files are read from ``--data.dir`` (``train_file`` and ``test_file``, default the
names of ``preset``); nothing is downloaded unless ``--data.download true`` and ``url`` (the
base URL holding the two files) are given. Examples without labels are dropped.
"""

from __future__ import annotations

import os
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from thinwire.data.datasets import Dataset
from thinwire.data.registry import DataEntry, DataSource
from thinwire.errors import UsageError
from thinwire.options import check, opt


def pack_rows(features: list[tuple[np.ndarray, np.ndarray]], labels: list[np.ndarray]
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse rows (ids, values) and label lists -> x [N, 2, P] and y [N, Y] (module doc)."""
    n = len(features)
    p = max((len(i) for i, _ in features), default=1) or 1
    q = max((len(lab) for lab in labels), default=1) or 1
    x = np.zeros((n, 2, p), dtype=np.float32)
    y = np.full((n, q), -1, dtype=np.int64)
    for r, ((ids, vals), lab) in enumerate(zip(features, labels)):
        x[r, 0, :len(ids)] = ids
        x[r, 1, :len(ids)] = vals
        y[r, :len(lab)] = lab
    return torch.from_numpy(x), torch.from_numpy(y)


# --- xc-synth -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class SynthOptions:
    labels: int = opt(10000, "labels (output width), 10^4 to 10^6")
    features: int = opt(20000, "input features")
    proto: int = opt(16, "features in a topic's prototype")
    nnz: int = opt(8, "feature draws per example")
    noise: float = opt(0.5, "probability that a draw is a uniform random feature")
    extra: int = opt(2, "labels of a topic beside its primary one")
    zipf: float = opt(0.6, "popularity exponent of topics and extra labels")
    train: int = opt(60000, "training examples")
    test: int = opt(2000, "test examples")

    def __post_init__(self) -> None:
        check(10 <= self.labels <= 2 * 10**6, "data.labels", "must be in [10, 2e6]")
        check(self.features >= self.proto >= 1, "data.features", "must be >= data.proto >= 1")
        check(self.features <= 10**7 and self.proto <= 1000 and self.nnz <= 1000,
              "data.features", "features <= 1e7, proto and nnz <= 1000")
        check(self.nnz >= 1, "data.nnz", "must be >= 1")
        check(0 < self.noise < 1, "data.noise", "must be in (0, 1)")
        check(0 <= self.extra < min(self.labels, 101), "data.extra",
              "must be in [0, min(data.labels, 101))")
        check(self.zipf >= 0, "data.zipf", "must be >= 0")
        check(1 <= self.train <= 10**7 and 1 <= self.test <= 10**6, "data.train",
              "train must be in [1, 1e7] and test in [1, 1e6]")


def _popularity(n: int, a: float) -> np.ndarray:
    p = 1.0 / (np.arange(n) + 1.0) ** a
    return p / p.sum()


def _distinct_rows(rng: np.random.Generator, n: int, k: int, high: int) -> np.ndarray:
    """[n, k] ids in [0, high), distinct within each row (rows with a repeat are redrawn)."""
    out = rng.integers(0, high, size=(n, k))
    while True:
        s = np.sort(out, axis=1)
        bad = np.nonzero((s[:, 1:] == s[:, :-1]).any(axis=1))[0] if k > 1 else np.zeros(0, int)
        if not bad.size:
            return out
        out[bad] = rng.integers(0, high, size=(bad.size, k))


def make_synth(o: SynthOptions, seed: int) -> dict[str, np.ndarray]:
    """The world and both splits of the generator (module docstring, steps 1-3)."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x5C1DE])))
    C, Fn = o.labels, o.features
    pop = _popularity(C, o.zipf)
    protos = _distinct_rows(rng, C, o.proto, Fn)
    extra = rng.choice(C, size=(C, o.extra), p=pop) if o.extra else np.zeros((C, 0), np.int64)
    sets = np.concatenate([np.arange(C)[:, None], extra], axis=1)

    def split(n: int) -> tuple[np.ndarray, ...]:
        topic = rng.choice(C, size=n, p=pop)
        from_proto = rng.random((n, o.nnz)) >= o.noise
        pick = protos[topic[:, None], rng.integers(0, o.proto, size=(n, o.nnz))]
        feats = np.where(from_proto, pick, rng.integers(0, Fn, size=(n, o.nnz)))
        return topic, feats

    t_tr, f_tr = split(o.train)
    t_te, f_te = split(o.test)
    return {"protos": protos, "sets": sets, "pop": pop, "topic_train": t_tr, "x_train": f_tr,
            "topic_test": t_te, "x_test": f_te}


def _labels_of(sets: np.ndarray, topics: np.ndarray) -> torch.Tensor:
    """Label sets as y [N, Y]: duplicates inside a set become padding (-1)."""
    y = np.sort(sets[topics], axis=1)
    dup = np.zeros_like(y, dtype=bool)
    dup[:, 1:] = y[:, 1:] == y[:, :-1]
    return torch.from_numpy(np.where(dup, -1, y).astype(np.int64))


BAYES_CELLS = 1 << 24
"""The most [rows, labels] cells one chunk of :func:`bayes_precision` holds in each of its
buffers (64 MiB of float32)."""


def bayes_precision(o: SynthOptions, world: dict[str, np.ndarray], ks: tuple[int, ...] = (1, 5),
                    chunk: int = 256) -> dict[int, float]:
    """Precision@k on the test split of the predictor that ranks labels by their posterior
    probability of being in the example's label set (the best one; module docstring). Rows go
    ``chunk`` at a time, fewer where that would hold more than :data:`BAYES_CELLS` cells a
    buffer (every worker loads the data: at 1,000,000 labels 256 rows were 1 GB a buffer)."""
    C, feats = o.labels, world["x_test"]
    chunk = max(1, min(chunk, BAYES_CELLS // (C + 1)))
    gamma = float(np.log1p((1 - o.noise) * o.features / (o.proto * o.noise)))
    # feature -> the topics whose prototype holds it, padded with the sentinel C
    topic = np.repeat(np.arange(C), o.proto)
    feat = world["protos"].reshape(-1)
    order = np.argsort(feat, kind="stable")
    counts = np.bincount(feat, minlength=o.features)
    start = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = np.arange(feat.size) - start[feat[order]]
    table = np.full((o.features, max(int(counts.max()), 1)), C, dtype=np.int64)
    table[feat[order], slot] = topic[order]
    table_t = torch.from_numpy(table)
    sets = np.sort(world["sets"], axis=1)
    dup = np.zeros_like(sets, dtype=bool)
    dup[:, 1:] = sets[:, 1:] == sets[:, :-1]
    sets_t = torch.from_numpy(np.where(dup, C, sets))
    logpi = torch.from_numpy(np.log(world["pop"])).float()
    hits = {k: 0.0 for k in ks}
    y = _labels_of(world["sets"], world["topic_test"])
    for i in range(0, len(feats), chunk):
        f = torch.from_numpy(feats[i:i + chunk]).long()
        b = f.shape[0]
        near = table_t[f].reshape(b, -1)  # topics hit by each draw
        n_t = torch.zeros(b, C + 1).scatter_add_(1, near, torch.ones(near.shape))[:, :C]
        post = torch.softmax(logpi + gamma * n_t, dim=1)
        marg = torch.zeros(b, C + 1)
        for j in range(sets_t.shape[1]):  # P(l in Y | x) = sum of the topics holding l
            marg.index_add_(1, sets_t[:, j], post)
        marg = marg[:, :C]
        yb = y[i:i + chunk]
        for k in ks:
            top = marg.topk(k, dim=1).indices
            hits[k] += float(((top.unsqueeze(-1) == yb.unsqueeze(1)) & (yb.unsqueeze(1) >= 0))
                             .any(-1).float().sum()) / k
    return {k: hits[k] / len(feats) for k in ks}


def _synth_x(feats: np.ndarray) -> torch.Tensor:
    n, p = feats.shape
    x = np.zeros((n, 2, p), dtype=np.float32)
    x[:, 0] = feats
    x[:, 1] = 1.0
    return torch.from_numpy(x)


def load_synth(source: DataSource, options: SynthOptions, seed: int) -> Dataset:
    o = options
    n_tr = source.limit_train or o.train
    n_te = source.limit_test or o.test
    if (n_tr, n_te) != (o.train, o.test):
        import dataclasses

        o = dataclasses.replace(o, train=n_tr, test=n_te)
    world = make_synth(o, seed)
    best = bayes_precision(o, world) if o.labels * min(o.test, 256) <= 3 * 10**8 else {}
    freq = np.bincount(world["sets"][world["topic_train"]].reshape(-1), minlength=o.labels)
    return Dataset(
        "xc-synth", _synth_x(world["x_train"]), _labels_of(world["sets"], world["topic_train"]),
        _synth_x(world["x_test"]), _labels_of(world["sets"], world["topic_test"]),
        num_classes=o.labels, kind="extreme",
        extra={"features": o.features, "best_p1": best.get(1, float("nan")),
               "best_p5": best.get(5, float("nan")), "label_counts": freq})


# --- xc-repo ------------------------------------------------------------------------------------
PRESETS: dict[str, tuple[str, str]] = {
    "amazon-670k": ("amazon_train.txt", "amazon_test.txt"),
    "delicious-200k": ("deliciousLarge_train.txt", "deliciousLarge_test.txt"),
    "wikilsh-325k": ("wikiLSHTC_train.txt", "wikiLSHTC_test.txt"),
    "plain": ("train.txt", "test.txt"),
}
REPO_PAGE = "http://manikvarma.org/downloads/XC/XMLRepository.html"


@dataclass(frozen=True)
class RepoOptions:
    preset: str = opt("plain", "file names: amazon-670k, delicious-200k, wikilsh-325k or plain "
                      "(train.txt, test.txt)", choices=tuple(PRESETS))
    train_file: str = opt("", "training file in --data.dir (empty: the preset's)")
    test_file: str = opt("", "test file in --data.dir (empty: the preset's)")
    url: str = opt("", "with --data.download true: base URL holding the two files")


def parse_xc(path: Path) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[np.ndarray], int,
                                  int]:
    """One XC Repository file: (rows, label lists, features, labels); one-line errors."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: cannot be read ({exc}); pass a readable XC-format file") \
            from None
    if not lines:
        raise UsageError(f"{path}: empty; expected a header line 'N F C'")
    head = lines[0].split()
    if len(head) != 3 or not all(h.isdigit() for h in head):
        raise UsageError(f"{path}:1: header {lines[0][:60]!r} is not 'N F C' (three integers)")
    n, nf, nc = (int(h) for h in head)
    rows: list[tuple[np.ndarray, np.ndarray]] = []
    labels: list[np.ndarray] = []
    for no, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        first, _, rest = line.partition(" ")
        try:
            lab = np.array([int(v) for v in first.split(",") if v != ""], dtype=np.int64)
            pairs = [t.split(":") for t in rest.split()]
            ids = np.array([int(a) for a, _ in pairs], dtype=np.int64)
            vals = np.array([float(b) for _, b in pairs], dtype=np.float32)
        except ValueError:
            raise UsageError(f"{path}:{no}: not 'l1,l2 f:v f:v' ({line[:60]!r}); fix the file") \
                from None
        if (lab.size and (lab.min() < 0 or lab.max() >= nc)) or \
                (ids.size and (ids.min() < 0 or ids.max() >= nf)):
            raise UsageError(f"{path}:{no}: an id is outside the header's {nf} features / {nc} "
                             "labels; fix the file or its header")
        if lab.size:
            rows.append((ids, vals))
            labels.append(lab)
    if len(lines) - 1 < n:
        raise UsageError(f"{path}: header says {n} examples, file has {len(lines) - 1}; the "
                         "file is truncated")
    return rows, labels, nf, nc


def _fetch(url: str, dest: Path) -> None:
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(dest, "wb") as f:
            f.write(r.read())
    except OSError as exc:
        raise UsageError(f"download of {url} failed ({exc}); fetch it by hand into "
                         f"{dest.parent}") from None


def load_repo(source: DataSource, options: RepoOptions, seed: int) -> Dataset:
    del seed
    tr_name, te_name = PRESETS[options.preset]
    tr_name, te_name = options.train_file or tr_name, options.test_file or te_name
    if not source.dir:
        raise UsageError(f"xc-repo reads from --data.dir DIR holding {tr_name} and {te_name} "
                         f"(the XC Repository's text format; {REPO_PAGE})")
    d = Path(os.path.expanduser(source.dir))
    for name in (tr_name, te_name):
        if not (d / name).is_file():
            if source.download and options.url:
                d.mkdir(parents=True, exist_ok=True)
                _fetch(options.url.rstrip("/") + "/" + name, d / name)
            else:
                raise UsageError(f"{d / name} not found; put the XC Repository's {name} there "
                                 f"({REPO_PAGE}), or pass --data.download true --data.url URL")
    rows, labs, nf, nc = parse_xc(d / tr_name)
    rows_te, labs_te, nf_te, nc_te = parse_xc(d / te_name)
    if (nf, nc) != (nf_te, nc_te):
        raise UsageError(f"{d}: train has {nf} features / {nc} labels, test {nf_te} / {nc_te}; "
                         "use files of one dataset")
    if source.limit_train:
        rows, labs = rows[:source.limit_train], labs[:source.limit_train]
    if source.limit_test:
        rows_te, labs_te = rows_te[:source.limit_test], labs_te[:source.limit_test]
    x, y = pack_rows(rows, labs)
    xt, yt = pack_rows(rows_te, labs_te)
    p, q = max(x.shape[2], xt.shape[2]), max(y.shape[1], yt.shape[1])
    x, xt = (torch.nn.functional.pad(t, (0, p - t.shape[2])) for t in (x, xt))
    y, yt = (torch.nn.functional.pad(t, (0, q - t.shape[1]), value=-1) for t in (y, yt))
    freq = np.bincount(np.concatenate(labs), minlength=nc) if labs else np.zeros(nc, np.int64)
    return Dataset("xc-repo", x, y, xt, yt, num_classes=nc, kind="extreme",
                   extra={"features": nf, "label_counts": freq})


SYNTH = DataEntry(
    name="xc-synth", kind="extreme", load=load_synth, options=SynthOptions,
    summary="synthetic extreme multi-label classification from the seed (10^4-10^6 labels, "
            "sparse inputs, known best precision@1/@5)")
REPO = DataEntry(
    name="xc-repo", kind="extreme", load=load_repo, options=RepoOptions,
    summary="Extreme Classification Repository text format (Amazon-670K, Delicious-200K, "
            "WikiLSH-325K) from --data.dir")
