"""The rows of benchmarks/ist_quality.py's tables: (workers, jobs) per process group.

``ablation`` changes one factor at a time from thinwire.IST's defaults (the residual stream
kept whole, optimizer state auto: dealt with its units except for convolutional models, overlap
auto: max(1, n // 2), K = 10) and shows the old
defaults (the stream cut, disjoint subnets) beside them, at 2 and 4 workers; ``target`` runs
every model with the defaults against plain training, DP, local SGD and DiLoCo at equal samples;
``dealt`` cuts only the heads or only the FFN neurons of the attention models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ist_quality import Job

Groups = list[tuple[int, list[Job]]]

MODELS = ("mlp", "rescnn", "encoder")
SEEDS = (0, 1, 2)
OLD: dict[str, Any] = {"residual": "channels", "optimizer_state": "reset", "overlap": 1}


def _seeds(jobs: list[Job], seeds: tuple[int, ...] = SEEDS) -> list[Job]:
    return [replace(j, seed=s) for j in jobs for s in seeds]


def _refs(model: str, **kw: Any) -> list[Job]:
    return [Job(model, "plain", **kw), Job(model, "dp", **kw),
            Job(model, "localsgd", label="localsgd(H=10)", **kw)]


def _ist(model: str, label: str, lr: float = 3e-3, **options: Any) -> Job:
    return Job(model, "ist", label=label, lr=lr, ist=options)


def ablation() -> Groups:
    two: list[Job] = []
    for m in MODELS:
        two += _refs(m)
        two += [
            _ist(m, "ist defaults"),
            _ist(m, "old defaults (stream cut)", **OLD),
            _ist(m, "stream cut", residual="channels"),
            _ist(m, "state reset", optimizer_state="reset"),
            _ist(m, "state dealt", optimizer_state="reindex"),
            _ist(m, "scale none", scale="none"),
            _ist(m, "K=1", local_steps=1),
            _ist(m, "K=5", local_steps=5),
            _ist(m, "K=20", local_steps=20),
            _ist(m, "lr x2", lr=6e-3),
            _ist(m, "outer Nesterov lr 0.7 m 0.9", outer_lr=0.7, outer_momentum=0.9),
            _ist(m, "outer Nesterov lr 1 m 0.5", outer_lr=1.0, outer_momentum=0.5),
            _ist(m, "deployment sharded", deployment="sharded"),
        ]
    four: list[Job] = []
    for m in MODELS:
        four += _refs(m)
        four += [
            _ist(m, "ist defaults"),
            _ist(m, "old defaults (stream cut)", **OLD),
            _ist(m, "overlap 1 (disjoint)", overlap=1),
            _ist(m, "overlap 3", overlap=3),
            _ist(m, "state reset", optimizer_state="reset"),
            _ist(m, "state dealt", optimizer_state="reindex"),
            _ist(m, "K=20", local_steps=20),
        ]
    return [(2, _seeds(two)), (4, _seeds(four))]


def target() -> Groups:
    groups: Groups = []
    for n in (2, 4):
        jobs: list[Job] = []
        for m in (*MODELS, "resnet"):
            jobs += _seeds([*_refs(m), Job(m, "diloco", label="diloco(H=10)"),
                            _ist(m, "ist defaults")], (0, 1) if m in MODELS else (0,))
        gpt: dict[str, Any] = {"batch": 16, "steps": 300}
        jobs += [Job("gpt", "plain", **gpt), Job("gpt", "dp", **gpt),
                 Job("gpt", "localsgd", label="localsgd(H=10)", **gpt),
                 Job("gpt", "diloco", label="diloco(H=10)", **gpt),
                 Job("gpt", "ist", label="ist defaults", **gpt)]
        groups.append((n, jobs))
    return groups


TABLES: dict[str, Callable[[], Groups]] = {"ablation": ablation, "target": target}


def language() -> Groups:
    """thinwire's GPT on tiny-shakespeare (batch 16 windows of 64, 300 steps): the factors that
    matter for a language model, at 2 and 4 workers."""
    gpt: dict[str, Any] = {"batch": 16, "steps": 300}
    groups: Groups = []
    for n in (2, 4):
        jobs = [Job("gpt", "plain", **gpt), Job("gpt", "dp", **gpt),
                Job("gpt", "localsgd", label="localsgd(H=10)", **gpt),
                # each cut unit of a subnet sees 1/n (overlap r: r/n) of the samples: plain
                # training on half of them is the yardstick of that cause
                Job("gpt", "plain", label="plain, half the samples", batch=8, steps=300)]
        rows: list[tuple[str, dict[str, Any]]] = [
            ("ist defaults", {}), ("state reset", {"optimizer_state": "reset"}),
            ("K=1", {"local_steps": 1}), ("K=5", {"local_steps": 5}),
            ("K=20", {"local_steps": 20}), ("scale none", {"scale": "none"}),
            ("lr x2", {})]
        if n == 4:
            rows += [("overlap 1 (disjoint)", {"overlap": 1}), ("overlap 3", {"overlap": 3})]
        for label, options in rows:
            jobs.append(Job("gpt", "ist", label=label, ist=options,
                            lr=6e-3 if label == "lr x2" else 3e-3, **gpt))
        groups.append((n, jobs))
    return groups


TABLES["language"] = language


def fashion() -> Groups:
    """The residual CNN (16 channels) on Fashion-MNIST, 4 workers, 300 steps: a task still far
    from converged, where each cut unit's share of the samples shows."""
    m = "rescnn-fmnist"
    kw: dict[str, Any] = {"steps": 300}
    jobs = [Job(m, "plain", **kw), Job(m, "dp", **kw),
            Job(m, "plain", label="plain, half the samples", batch=16, **kw),
            Job(m, "localsgd", label="localsgd(H=10)", **kw),
            Job(m, "ist", label="ist defaults", **kw),
            Job(m, "ist", label="old defaults (stream cut)", ist=OLD, **kw),
            Job(m, "ist", label="overlap 3", ist={"overlap": 3}, **kw),
            Job(m, "ist", label="state dealt", ist={"optimizer_state": "reindex"}, **kw)]
    return [(4, jobs)]


TABLES["fashion"] = fashion


def norms() -> Groups:
    """BatchNorm statistics at evaluation: recomputed on the assembled model (every table) or
    as the subnets left them (each BatchNorm's running statistics of the channels a worker
    held, written back with them; the stream's, averaged over the workers), beside DP's own."""
    groups: Groups = []
    for n in (2, 4):
        jobs: list[Job] = []
        for m in ("rescnn", "resnet"):
            jobs += _seeds([Job(m, "plain"), Job(m, "dp"),
                            Job(m, "dp", label="dp, statistics as trained", recal=False),
                            _ist(m, "ist defaults"),
                            replace(_ist(m, "ist, statistics as trained"), recal=False)])
        groups.append((n, jobs))
    return groups


TABLES["norms"] = norms


def _layers(model: str, n_layers: int = 2) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The submodules that hold a model's attention and its FFN, every layer: the ``shared``
    names that keep the heads (first) or the FFN neurons (second) whole."""
    if model == "encoder":  # nn.TransformerEncoder, one traced node: its rule honours shared
        return (tuple(f"encoder.layers.{i}.self_attn" for i in range(n_layers)),
                tuple(f"encoder.layers.{i}.{f}" for i in range(n_layers)
                      for f in ("linear1", "linear2")))
    # thinwire's GPT is traced into its Linears: its attention's and FFN's own layers are named
    # (shared=("blocks.0.attn",) fails to derive: the meta tracer its forward needs records
    # the kept module's inner calls)
    return (tuple(f"blocks.{i}.attn.{f}" for i in range(n_layers) for f in ("q", "k", "v", "proj")),
            tuple(f"blocks.{i}.mlp.{f}" for i in range(n_layers) for f in ("fc1", "fc2")))


def dealt() -> Groups:
    """What is dealt on the attention models, at 2 and 4 workers: IST's defaults (heads and FFN
    neurons both cut, the stream whole) against cutting only the heads (every FFN kept whole
    with ``shared=``) and only the FFN neurons (every self-attention kept whole). The encoder
    over 3 seeds, thinwire's GPT (300 steps of 16 windows) over 1."""
    gpt: dict[str, Any] = {"batch": 16, "steps": 300}
    groups: Groups = []
    for n in (2, 4):
        jobs: list[Job] = []
        for m, kw, seeds in (("encoder", {}, SEEDS), ("gpt", gpt, (0,))):
            attention, ffn = _layers(m)
            jobs += _seeds([Job(m, "plain", **kw), Job(m, "dp", **kw),
                            Job(m, "ist", label="ist defaults (heads and FFN cut)", **kw),
                            Job(m, "ist", label="heads cut, FFN whole", ist={"shared": ffn},
                                **kw),
                            Job(m, "ist", label="FFN cut, attention whole",
                                ist={"shared": attention}, **kw)], seeds)
        groups.append((n, jobs))
    return groups


TABLES["dealt"] = dealt
