"""Convergence as data: how many steps each method needs to reach a target, from runs.

The per-step crossover (:mod:`thinwire.planner.insight`) says which method moves fewer bytes
and computes less per step; which one reaches a loss or accuracy first also depends on how many
steps each needs, which no formula gives. This module reads it from runs' metrics:

1. each run directory (``summary.json`` + ``metrics.jsonl``, as ``thinwire train``, ``compare``
   and ``bench`` write them) gives its method spec (the registry name and the options that differ
   from the method's defaults, :func:`spec_of`), the task's metric and its evaluation curve;
2. for each target, a run's steps to it are the step of its first evaluation at or past it
   (accuracy at or above, perplexity at or below), the same rule as ``compare``'s and
   ``bench``'s "steps to target" columns; a run that never gets there has none;
3. runs of the same spec are pooled (:func:`fit`): the mean of the steps of the runs that got
   there; a method none of whose runs reached a target *does not reach* it (``None``), and
   never wins there;
4. the factor of a method for a target is its steps over the baseline's (the registry's first
   method at its defaults, plain data parallelism), when both reached it.

A :class:`Convergence` is written and read as JSON (:meth:`Convergence.to_json`,
:func:`load`) with its provenance: the command that produced the runs and the one that fit
them. The project ships tables from its own benchmark runs (``thinwire/presets/
convergence-*.json``), loaded by name (:func:`load`, :func:`shipped`).

Steps are a property of the runs' setting (workers, batch per worker, optimizer, data): the
table records it, and a prediction for another setting is an extrapolation the output names.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError

PRESETS = Path(__file__).resolve().parent.parent / "presets"
PREFIX = "convergence-"


@dataclass(frozen=True)
class Curve:
    """One run: its method spec and label, and its evaluation curve [(step, metric value)]."""

    spec: str
    label: str
    metric: str
    higher_is_better: bool
    points: tuple[tuple[int, float], ...]
    workers: int = 0
    batch_size: int = 0
    family: str = ""
    dataset: str = ""
    path: str = ""

    def reached(self, value: float, target: float) -> bool:
        return value >= target if self.higher_is_better else value <= target

    def steps_to(self, target: float) -> int | None:
        """Step 2: the step of the first evaluation at or past ``target``; None: never."""
        for step, value in self.points:
            if self.reached(value, target):
                return step
        return None

    @property
    def best(self) -> float:
        values = [v for _, v in self.points]
        if not values:
            return math.nan
        return max(values) if self.higher_is_better else min(values)


@dataclass(frozen=True)
class MethodSteps:
    """One method's pooled steps to each target (None: does not reach)."""

    spec: str
    label: str
    steps: dict[float, float | None]
    runs: int
    best: float
    steps_run: int


@dataclass(frozen=True)
class Convergence:
    """Steps to target per method, the first method being the baseline where the runs had it."""

    family: str
    dataset: str
    metric: str
    higher_is_better: bool
    targets: tuple[float, ...]
    methods: tuple[MethodSteps, ...]
    baseline: str = ""
    workers: int = 0
    batch_size: int = 0
    provenance: str = ""
    fit_command: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)
    plan: dict[str, Any] = field(default_factory=dict)
    """The planner inputs of the runs (``model``, ``cluster``, ``devices``,
    ``micro_batch_size``): ``--crossover --convergence NAME`` prices them when ``--model`` and
    ``--cluster`` are not given. A fit from runs leaves it empty (runs know no cluster)."""

    def method(self, spec: str) -> MethodSteps:
        for m in self.methods:
            if m.spec == spec:
                return m
        raise KeyError(spec)

    def steps(self, spec: str, target: float) -> float | None:
        """Steps ``spec`` needs to reach ``target`` (None: does not reach)."""
        return self.method(spec).steps.get(target)

    def factor(self, spec: str, target: float) -> float | None:
        """Step 4: steps to ``target`` relative to the baseline's (None when either never
        reached it or the runs had no baseline)."""
        if not self.baseline:
            return None
        mine, base = self.steps(spec, target), self.steps(self.baseline, target)
        return None if mine is None or base is None else mine / base

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["methods"] = [{**dataclasses.asdict(m), "steps": {_key(t): s for t, s in m.steps.items()}}
                        for m in self.methods]
        return d


def _key(target: float) -> str:
    return repr(float(target))


def spec_of(method: dict[str, Any]) -> str:
    """Step 1: a run's ``config.method`` section -> the spec ``thinwire train`` takes for it:
    the name, then the options that differ from the method's defaults (sorted), so that equal
    methods get equal specs and :func:`thinwire.planner.methods.resolve` reads them back."""
    from thinwire.strategies import METHODS

    name = str(method.get("name", ""))
    if name not in METHODS:
        raise UsageError(f"a run's method {name!r} is not registered here; use runs of one of "
                         f"{', '.join(METHODS.names())}")
    defaults = dataclasses.asdict(METHODS.get(name).options())
    parts = [f"{k}={_value(v)}" for k, v in sorted(method.items())
             if k != "name" and k in defaults and defaults[k] != v]
    return name + (":" + ",".join(parts) if parts else "")


def _value(v: Any) -> str:
    text = str(v).lower() if isinstance(v, bool) else str(v)
    return f"({text})" if "," in text or ":" in text else text


def baseline_spec() -> str:
    """The registry's first method at its defaults (plain data parallelism)."""
    from thinwire.strategies import METHODS

    return str(METHODS.names()[0])


def curve_of(path: Path) -> Curve:
    """Step 1 for one run directory (a one-line UsageError if it is not one)."""
    from thinwire.report.tables import load_run

    run = load_run(path)
    cfg = run.summary.get("config", {})
    if "method" not in cfg:
        raise UsageError(f"{path}/summary.json records no config.method; re-run it with this "
                         "version of thinwire")
    points = tuple((int(r["step"]), float(r[run.metric])) for r in run.evals if run.metric in r)
    model, data = cfg.get("model", {}), cfg.get("data", {})
    label = run.label.split(" [")[0]  # without the model's bracketed options
    prefix = f"{model.get('name', '')}:"
    label = label[len(prefix):] if label.startswith(prefix) else label
    return Curve(spec_of(cfg["method"]), label, run.metric,
                 run.higher_is_better, points,
                 int(run.summary.get("workers", cfg.get("runtime", {}).get("workers", 0))),
                 int(cfg.get("train", {}).get("batch_size", 0)), _family(model),
                 str(data.get("name", "")), str(path))


def _family(model: dict[str, Any]) -> str:
    """The model's name and its hidden widths where it has them (``name-1024-1024``)."""
    name = str(model.get("name", ""))
    hidden = model.get("hidden")
    if hidden is None:
        return name
    widths = hidden if isinstance(hidden, list) else [hidden]
    return "-".join([name, *map(str, widths)])


def run_dirs(paths: Iterable[str | Path]) -> list[Path]:
    """Run directories in ``paths``: each path a run directory or a folder holding them (up to
    two levels down, as ``compare`` and ``bench`` lay them out), in sorted order."""
    out: list[Path] = []
    for p in map(Path, paths):
        if (p / "summary.json").is_file():
            out.append(p)
            continue
        if not p.is_dir():
            raise UsageError(f"--convergence {p}: no such run directory or folder; give run "
                             "directories, folders of them, a convergence JSON or a shipped name")
        found = sorted({s.parent for s in [*p.glob("*/summary.json"), *p.glob("*/*/summary.json")]})
        if not found:
            raise UsageError(f"--convergence {p}: no run directory (summary.json) inside")
        out += found
    return out


def fit(curves: Sequence[Curve], targets: Sequence[float] = (), provenance: str = "",
        fit_command: str = "") -> Convergence:
    """Steps 2-4 over runs of one task. ``targets`` default to :func:`default_targets`."""
    if not curves:
        raise UsageError("--convergence: no runs given")
    first = curves[0]
    for c in curves[1:]:
        if (c.metric, c.family, c.dataset) != (first.metric, first.family, first.dataset):
            raise UsageError(f"--convergence: runs of different tasks ({first.path}: "
                             f"{first.family} on {first.dataset}; {c.path}: {c.family} on "
                             f"{c.dataset}); fit one model and dataset at a time")
    ts = tuple(sorted(set(map(float, targets or default_targets(curves))),
                      reverse=not first.higher_is_better))
    specs = list(dict.fromkeys(c.spec for c in curves))
    base = baseline_spec()
    if base in specs:
        specs.remove(base)
        specs.insert(0, base)
    methods = []
    for spec in specs:
        mine = [c for c in curves if c.spec == spec]
        steps: dict[float, float | None] = {}
        for t in ts:
            hit = [s for c in mine if (s := c.steps_to(t)) is not None]
            steps[t] = sum(hit) / len(hit) if hit else None
        best = [c.best for c in mine]
        methods.append(MethodSteps(spec, mine[0].label, steps, len(mine),
                                   max(best) if first.higher_is_better else min(best),
                                   max((c.points[-1][0] for c in mine if c.points), default=0)))
    return Convergence(first.family, first.dataset, first.metric, first.higher_is_better, ts,
                       tuple(methods), base if base in specs else "", first.workers,
                       first.batch_size, provenance, fit_command)


def default_targets(curves: Sequence[Curve]) -> list[float]:
    """The best value every run reached (the common target), an easier one, and the
    baseline's best where it is beyond the common target (some methods may not reach it);
    rounded to 3 decimals towards the easier side, so the runs that set them do reach them."""
    sign = 1 if curves[0].higher_is_better else -1
    common = min(sign * c.best for c in curves) * sign
    base = [c for c in curves if c.spec == baseline_spec()]
    out = [common - sign * abs(common) * 0.02, common]
    if base:
        out.append(max(sign * c.best for c in base) * sign)
    rnd = math.floor if sign > 0 else math.ceil
    return sorted({rnd(t * 1000) / 1000 for t in out}, reverse=sign < 0)


def from_runs(paths: Sequence[str | Path], targets: Sequence[float] = (),
              provenance: str = "", fit_command: str = "") -> Convergence:
    """:func:`fit` of the run directories in ``paths`` (:func:`run_dirs`)."""
    curves = [curve_of(p) for p in run_dirs(paths)]
    return fit(curves, targets, provenance or _recorded_command(paths), fit_command)


def _recorded_command(paths: Sequence[str | Path]) -> str:
    """The command a bench or compare folder recorded for its runs (``command.txt``), if any."""
    for p in map(Path, paths):
        for where in (p, p.parent, p.parent.parent):
            f = where / "command.txt"
            if f.is_file():
                return f.read_text().strip()
    return ""


def from_json(d: dict[str, Any], where: str = "convergence table") -> Convergence:
    """A :class:`Convergence` from :meth:`Convergence.to_json`'s dict (one-line error if not)."""
    try:
        methods = tuple(
            MethodSteps(str(m["spec"]), str(m["label"]),
                        {float(t): (None if s is None else float(s)) for t, s in m["steps"].items()},
                        int(m["runs"]), float(m["best"]), int(m["steps_run"]))
            for m in d["methods"])
        return Convergence(str(d["family"]), str(d["dataset"]), str(d["metric"]),
                           bool(d["higher_is_better"]), tuple(float(t) for t in d["targets"]),
                           methods, str(d.get("baseline", "")), int(d.get("workers", 0)),
                           int(d.get("batch_size", 0)), str(d.get("provenance", "")),
                           str(d.get("fit_command", "")), tuple(d.get("notes", ())),
                           dict(d.get("plan", {})))
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
        raise UsageError(f"{where} is not a convergence table ({type(exc).__name__}: {exc}); "
                         "write it with thinwire plan --convergence RUNS --out FILE") from None


def shipped() -> list[str]:
    """Names of the convergence tables shipped with thinwire."""
    return sorted(p.stem[len(PREFIX):] for p in PRESETS.glob(PREFIX + "*.json"))


def load(sources: Sequence[str], targets: Sequence[float] = (), fit_command: str = ""
         ) -> Convergence:
    """``--convergence``: one shipped table's name, one JSON file, or run directories (fit
    here, at ``targets``). A table read from a file is re-cut to ``targets`` only where it has
    them (its steps are fixed)."""
    if len(sources) == 1:
        src = sources[0]
        path = PRESETS / f"{PREFIX}{src}.json"
        if src in shipped() or (src.endswith(".json") and Path(src).is_file()):
            f = path if src in shipped() else Path(src)
            try:
                conv = from_json(json.loads(f.read_text()), str(f))
            except json.JSONDecodeError:
                raise UsageError(f"{f} is not valid JSON; write it with thinwire plan "
                                 "--convergence RUNS --out FILE") from None
            missing = [t for t in targets if t not in conv.targets]
            if missing:
                raise UsageError(f"--target {missing[0]:g}: {f.name} has steps for "
                                 f"{', '.join(f'{t:g}' for t in conv.targets)} only; pick one or "
                                 "fit runs at it (--convergence RUN_DIR...)")
            return dataclasses.replace(conv, targets=tuple(targets) or conv.targets)
        if src.endswith(".json"):
            raise UsageError(f"--convergence {src}: no such file; shipped tables: "
                             f"{', '.join(shipped()) or 'none'}")
    return from_runs(sources, targets, fit_command=fit_command)


def command_line(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
