"""A synthetic click log with known structure (``clicks``), for recommendation models.

No real click-through dataset (Criteo, Avazu) installs offline here, so this one is generated,
deterministically from the run's seed; every number measured on it is on synthetic data. Its
structure is that of a factorisation-machine world, the model class DLRM's dot interactions
express, so a DLRM can learn it and the best possible AUC is known:

  1. ``tables`` categorical features; feature t has ``rows`` values, drawn with Zipf-like
     popularity p(v) ~ 1 / (v + 1)^``zipf`` (a few values dominate, as item and user ids do);
  2. each value of each feature has a latent vector u_t[v] ~ N(0, I_k / k) (k = ``latent``) and a
     bias b_t[v] ~ N(0, 0.25); the dense features are ``dense`` standard normals z with weights
     w ~ N(0, 0.25 / dense);
  3. the click logit of an impression is
     ``s = w.z + sum_t b_t[v_t] + scale * sum_{t<t'} u_t[v_t].u_t'[v_t'] + c``, with ``scale``
     chosen so the interaction term has unit variance and c so that the mean click rate is
     ``ctr``; the label is a Bernoulli draw with probability sigmoid(s).

Examples: x [N, dense + tables] float32, the dense features then the categorical ids as exact
small integers (ids < 2^24 are exact in float32); y [N] int64 clicks (0/1). ``extra`` holds the
tables' sizes, the number of dense features and the Bayes-optimal probabilities of the test
split (``p_test``), so a report can print the best reachable AUC next to the model's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from thinwire.data.datasets import Dataset
from thinwire.data.registry import DataEntry, DataSource
from thinwire.options import check, opt


@dataclass(frozen=True)
class Options:
    tables: int = opt(8, "categorical features (embedding tables)")
    rows: int = opt(1000, "values per categorical feature")
    dense: int = opt(8, "dense features")
    latent: int = opt(4, "rank of the true pairwise interactions")
    zipf: float = opt(1.05, "popularity exponent of the categorical values")
    ctr: float = opt(0.25, "mean click rate")
    train: int = opt(65536, "training impressions")
    test: int = opt(8192, "test impressions")

    def __post_init__(self) -> None:
        check(self.tables >= 2, "data.tables", "must be >= 2 (interactions need two)")
        check(1 <= self.rows < 2**24, "data.rows", "must be in [1, 2**24)")
        check(self.dense >= 1, "data.dense", "must be >= 1")
        check(self.latent >= 1, "data.latent", "must be >= 1")
        check(self.zipf >= 0, "data.zipf", "must be >= 0")
        check(0 < self.ctr < 1, "data.ctr", "must be in (0, 1)")
        check(self.train >= 1 and self.test >= 1, "data.train", "train and test must be >= 1")


def _terms(rng: np.random.Generator, o: Options, n: int, world: dict[str, np.ndarray]
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps 1 and 3 for n impressions: x, the linear terms w.z + sum_t b_t, and the unscaled
    pairwise term sum_{t<t'} u_t.u_t'."""
    pop = 1.0 / (np.arange(o.rows) + 1.0) ** o.zipf
    pop /= pop.sum()
    ids = np.stack([rng.choice(o.rows, size=n, p=pop) for _ in range(o.tables)], axis=1)
    z = rng.standard_normal((n, o.dense))
    u = np.stack([world["u"][t][ids[:, t]] for t in range(o.tables)], axis=1)  # [n, T, k]
    s = u.sum(axis=1)
    pair = 0.5 * ((s * s).sum(-1) - (u * u).sum(axis=(1, 2)))  # sum over t < t'
    linear = z @ world["w"] + sum(world["b"][t][ids[:, t]] for t in range(o.tables))
    return np.concatenate([z, ids], axis=1).astype(np.float32), linear, pair


def make_clicks(o: Options, seed: int) -> tuple[np.ndarray, ...]:
    """(x_train, y_train, x_test, y_test, p_test): the generator of the module docstring."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0xC11C])))
    world = {"u": rng.standard_normal((o.tables, o.rows, o.latent)) / np.sqrt(o.latent),
             "b": 0.5 * rng.standard_normal((o.tables, o.rows)),
             "w": 0.5 * rng.standard_normal(o.dense) / np.sqrt(o.dense)}
    # 3. the interaction's scale (unit variance) and the offset c from a calibration sample
    _, lin, pair = _terms(rng, o, 8192, world)
    scale = 1.0 / max(float(np.std(pair)), 1e-9)
    calib = lin + scale * pair
    lo, hi = -30.0, 30.0
    for _ in range(60):  # bisection: the mean click rate is increasing in c
        c = (lo + hi) / 2
        lo, hi = (c, hi) if np.mean(1 / (1 + np.exp(-(calib + c)))) < o.ctr else (lo, c)
    c = (lo + hi) / 2
    x_tr, lin_tr, pair_tr = _terms(rng, o, o.train, world)
    x_te, lin_te, pair_te = _terms(rng, o, o.test, world)
    p_tr = 1 / (1 + np.exp(-(lin_tr + scale * pair_tr + c)))
    p_te = 1 / (1 + np.exp(-(lin_te + scale * pair_te + c)))
    y_tr = (rng.random(o.train) < p_tr).astype(np.int64)
    y_te = (rng.random(o.test) < p_te).astype(np.int64)
    return x_tr, y_tr, x_te, y_te, p_te


def load_clicks(source: DataSource, options: Options, seed: int) -> Dataset:
    """The ``clicks`` dataset from ``seed`` (``limit_train`` / ``limit_test`` take prefixes)."""
    x_tr, y_tr, x_te, y_te, p_te = make_clicks(options, seed)
    if source.limit_train:
        x_tr, y_tr = x_tr[:source.limit_train], y_tr[:source.limit_train]
    if source.limit_test:
        x_te, y_te, p_te = (x_te[:source.limit_test], y_te[:source.limit_test],
                            p_te[:source.limit_test])
    return Dataset(
        name="clicks", x_train=torch.from_numpy(x_tr), y_train=torch.from_numpy(y_tr),
        x_test=torch.from_numpy(x_te), y_test=torch.from_numpy(y_te), num_classes=2,
        kind="click", extra={"dense": options.dense, "rows": (options.rows,) * options.tables,
                             "p_test": torch.from_numpy(p_te)})


CLICKS = DataEntry(
    name="clicks", kind="click", load=load_clicks, options=Options,
    summary="synthetic click log (generated from the seed): dense + Zipf categorical features, "
            "factorisation-machine clicks with a known best AUC")
