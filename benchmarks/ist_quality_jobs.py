"""The rows of benchmarks/ist_quality.py's tables: (workers, jobs) per process group.

``ablation`` changes one factor at a time from the recommended configuration (the defaults:
the residual stream kept whole, optimizer state dealt with its units, K = 10) and shows the old
defaults beside it; ``target`` runs every model with the defaults against plain training, DP,
local SGD and Streaming DiLoCo, at 2 and 4 workers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ist_quality import Job

Groups = list[tuple[int, list[Job]]]

MODELS = ("mlp", "rescnn", "encoder")
SEEDS = (0, 1, 2)
OLD = {"residual": "channels", "optimizer_state": "reset"}


def _seeds(jobs: list[Job], seeds: tuple[int, ...] = SEEDS) -> list[Job]:
    return [replace(j, seed=s) for j in jobs for s in seeds]


def _refs(model: str, **kw: Any) -> list[Job]:
    return [Job(model, "plain", **kw), Job(model, "dp", **kw),
            Job(model, "localsgd", label="localsgd(H=10)", **kw)]


def _ist(model: str, label: str, lr: float = 3e-3, **options: Any) -> Job:
    return Job(model, "ist", label=label, lr=lr, ist=options)


def ablation() -> Groups:
    jobs: list[Job] = []
    for m in MODELS:
        jobs += _refs(m)
        jobs += [
            _ist(m, "ist defaults"),
            _ist(m, "old defaults (stream cut, state reset)", **OLD),
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
        four += [_ist(m, "ist defaults"), _ist(m, "old defaults (stream cut, state reset)", **OLD),
                 _ist(m, "state dealt", optimizer_state="reindex"),
                 _ist(m, "overlap 2", overlap=2),
                 _ist(m, "overlap 2, state dealt", overlap=2, optimizer_state="reindex"),
                 _ist(m, "overlap 2, K=20", overlap=2, local_steps=20)]
    return [(2, _seeds(jobs)), (4, _seeds(four))]


TABLES: dict[str, Callable[[], Groups]] = {"ablation": ablation}
