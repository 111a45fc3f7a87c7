"""Run configuration: frozen dataclasses <- TOML file <- dotted command-line overrides.

Sections ``[data] [model] [method] [train] [parallel] [memory] [runtime] [run]``. Three of them choose an
entry of a registry by ``name`` and hold that entry's own options beside the section's common
ones: ``[data]`` a dataset (:data:`thinwire.data.DATASETS`), ``[model]`` a model
(:data:`thinwire.models.MODELS`), ``[method]`` a method (:data:`thinwire.strategies.METHODS`).
Each entry declares its options as a dataclass in its own module, so this module names no
method, model or dataset; an option the chosen entry does not take is a one-line error naming
the entries that do.

Every field carries its help text (``metadata["help"]``, shown by ``thinwire train --help``) and
validates itself; a bad value raises :class:`ConfigError` (a :class:`~thinwire.errors.UsageError`)
whose one-line message names the field and the fix. The resolved config is written into the run
directory as TOML and reads back to the same :class:`Config`.

One concept, one file (over 400 lines): the run configuration (its sections, TOML, overrides and
checks).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError
from thinwire.models import MODELS
from thinwire.options import (
    NoOptions,
    OptionError,
    Registry,
    build_options,
    check,
    iter_fields,
    opt,
)
from thinwire.strategies import METHODS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


ConfigError = OptionError
"""An invalid configuration value; the message names the field and the fix."""


@dataclass(frozen=True)
class DataConfig:
    name: str = opt("", "dataset (empty: the model's default dataset)")
    dir: str = opt("", "directory holding the dataset's files (empty: the standard places; when "
                   "given, only this directory is searched)")
    download: bool = opt(False, "download a missing dataset from its canonical source")
    shard: str = opt("iid", "per-worker shards: iid, or skew (label-skewed, heterogeneous)",
                     choices=("iid", "skew"))
    skew: float = opt(0.0, "with --data.shard skew: fraction of each class kept on its home "
                      "worker, 0..1")
    limit_train: int = opt(0, "use only this many training examples (0: all)")
    limit_test: int = opt(0, "use only this many test examples (0: all)")
    options: Any = field(default_factory=NoOptions, metadata={"entry_options": True})

    def __post_init__(self) -> None:
        check(0.0 <= self.skew <= 1.0, "data.skew", f"got {self.skew}; use a value in [0, 1]")
        check(self.shard == "skew" or self.skew == 0.0, "data.skew",
              "is used only with --data.shard skew; add --data.shard skew or drop --data.skew")
        check(self.limit_train >= 0, "data.limit_train", "must be >= 0 (0 means all)")
        check(self.limit_test >= 0, "data.limit_test", "must be >= 0 (0 means all)")


def _first(registry: Registry[Any]) -> str:
    """A registry's first entry: the default of its section."""
    return registry.names()[0]


@dataclass(frozen=True)
class ModelConfig:
    name: str = opt(_first(MODELS), "model")
    options: Any = field(default_factory=NoOptions, metadata={"entry_options": True})


@dataclass(frozen=True)
class MethodConfig:
    name: str = opt(_first(METHODS), "method of distributed training")
    options: Any = field(default_factory=NoOptions, metadata={"entry_options": True})


@dataclass(frozen=True)
class TrainConfig:
    steps: int = opt(600, "optimizer steps per worker")
    batch_size: int = opt(128, "mini-batch size per worker")
    lr: float = opt(0.05, "learning rate")
    momentum: float = opt(0.0, "SGD momentum")
    weight_decay: float = opt(0.0, "weight decay")
    optimizer: str = opt("sgd", "local optimizer", choices=("sgd", "adamw"))
    schedule: str = opt("constant", "learning-rate schedule", choices=("constant", "cosine"))
    clip_norm: float = opt(0.0, "clip the gradient norm to this value before each step (0: off)")
    eval_every: int = opt(100, "evaluate the full model every this many steps (0: only at the end)")
    log_every: int = opt(10, "write a metrics record every this many steps")
    seed: int = opt(0, "seed of the model, the data order and every shared random draw")

    def __post_init__(self) -> None:
        check(1 <= self.steps <= 10**12, "train.steps", "must be in [1, 10**12]")
        check(self.batch_size >= 1, "train.batch_size", "must be >= 1")
        check(0 <= self.lr <= 1e6, "train.lr", "must be in [0, 1e6]")
        check(0 <= self.momentum < 1, "train.momentum", "must be in [0, 1)")
        check(0 <= self.weight_decay <= 1e6, "train.weight_decay", "must be in [0, 1e6]")
        check(self.clip_norm >= 0, "train.clip_norm", "must be >= 0 (0: off)")
        check(self.eval_every >= 0, "train.eval_every", "must be >= 0")
        check(self.log_every >= 1, "train.log_every", "must be >= 1")
        check(0 <= self.seed < 2**63, "train.seed", "must be in [0, 2**63)")


@dataclass(frozen=True)
class ParallelConfig:
    pp: int = opt(1, "pipeline-parallel degree (stages); data-parallel degree = workers / (pp tp)")
    tp: int = opt(1, "tensor-parallel degree")

    def __post_init__(self) -> None:
        check(self.pp >= 1, "parallel.pp", "must be >= 1")
        check(self.tp >= 1, "parallel.tp", "must be >= 1")


RECOMPUTE = ("none", "block", "selective")
"""``[memory] recompute`` of a run (the planner's names for them:
:data:`thinwire.planner.specs.MEGATRON_RECOMPUTE`)."""
OFFLOAD = ("none", "params")


@dataclass(frozen=True)
class MemoryConfig:
    """Memory options, orthogonal to the method (:mod:`thinwire.strategies.memory`)."""

    zero: int = opt(0, "ZeRO stage: 0 none, 1 sharded optimizer state, 2 FSDP2 (+ gradients and "
                    "parameters sharded at rest, gathered once per step), 3 FSDP2 resharding "
                    "after each block's forward", choices=(0, 1, 2, 3))
    recompute: str = opt("none", "activation recomputation: none, block (every block of the "
                         "model), selective (the model's selective parts, e.g. attention)",
                         choices=RECOMPUTE)
    offload: str = opt("none", "params: sharded parameters, gradients and optimizer state in "
                       "host memory (FSDP2 CPUOffloadPolicy; needs zero >= 2; no bytes move on "
                       "a CPU run)", choices=OFFLOAD)

    def __post_init__(self) -> None:
        check(self.offload in ("none",) or self.offload not in OFFLOAD or self.zero >= 2,
              "memory.offload",
              "params offload is FSDP2's; add --memory.zero 2 or 3")


@dataclass(frozen=True)
class RuntimeConfig:
    workers: int = opt(4, "number of local worker processes")
    backend: str = opt("auto", "torch.distributed backend (auto: nccl on CUDA, else gloo)",
                       choices=("auto", "gloo", "nccl"))
    device: str = opt("auto", "device (auto: cuda when available)", choices=("auto", "cpu", "cuda"))
    timeout_s: float = opt(120.0, "a dead or stuck worker ends the job after this many seconds")
    threads: int = opt(0, "torch threads per worker (0: cores / workers, at least 1)")
    max_restarts: int = opt(0, "restart the workers this many times after a failure, resuming "
                            "from the newest complete checkpoint")
    fault_tolerance: str = opt("none", "torchft: keep training without a restart when a worker "
                               "dies (a quorum of the live workers at every outer step; "
                               "docs/FAULT_TOLERANCE.md)", choices=("none", "torchft"))
    min_workers: int = opt(1, "with fault_tolerance torchft: the fewest live workers the job "
                           "goes on with")

    def __post_init__(self) -> None:
        check(1 <= self.workers <= 1024, "runtime.workers", "must be in [1, 1024]")
        check(0 < self.timeout_s <= 7 * 24 * 3600, "runtime.timeout_s",
              "must be in (0, 604800] seconds")
        check(0 <= self.threads <= 1024, "runtime.threads", "must be in [0, 1024]")
        check(0 <= self.max_restarts <= 100, "runtime.max_restarts", "must be in [0, 100]")
        check(1 <= self.min_workers <= self.workers, "runtime.min_workers",
              f"must be in [1, runtime.workers = {self.workers}]")
        if self.fault_tolerance != "none":
            check(self.max_restarts == 0, "runtime.max_restarts",
                  "restarts every worker; with --runtime.fault_tolerance the survivors go on "
                  "instead: drop one of the two")


@dataclass(frozen=True)
class RunConfig:
    out: str = opt("runs", "parent directory of run directories")
    name: str = opt("", "run directory name, a plain name (empty: the method's name)")
    checkpoint_every: int = opt(0, "checkpoint every this many steps (0: only at the end)")
    resume: bool = opt(False, "continue from the newest complete checkpoint in the run directory")
    overwrite: bool = opt(False, "replace an existing run directory of the same name")
    progress: bool = opt(True, "show a progress bar on rank 0")
    loggers: str = opt("jsonl", "metrics loggers, a comma list: jsonl (metrics.jsonl, always), "
                       "tensorboard (event files in RUN_DIR/tensorboard; needs "
                       "thinwire[tensorboard])")

    def __post_init__(self) -> None:
        from thinwire.loggers import parse_loggers

        parse_loggers(self.loggers)
        check(self.checkpoint_every >= 0, "run.checkpoint_every", "must be >= 0")
        check(not (self.resume and self.overwrite), "run.overwrite",
              "cannot be combined with --resume; choose one")
        if self.name:
            from thinwire.rundir import check_name

            check_name(self.name)


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        sync = self.sync_every
        for name, every in (("train.steps", self.train.steps),
                            ("train.eval_every", self.train.eval_every),
                            ("run.checkpoint_every", self.run.checkpoint_every)):
            check(every % sync == 0, name,
                  f"{every} is not a multiple of {sync}, the steps between synchronisations "
                  f"of {self.method.name}; use a multiple of {sync}")
        mp = self.parallel.pp * self.parallel.tp
        check(self.runtime.workers % mp == 0, "parallel",
              f"pp x tp = {mp} must divide runtime.workers ({self.runtime.workers})")
        model = models().get(self.model.name)
        data_kind = datasets().get(self.data.name).kind
        check(data_kind in model.data_kinds, "data.name",
              f"model {self.model.name} trains on {' or '.join(model.data_kinds)} data, but "
              f"{self.data.name} is {data_kind} data; use e.g. --data.name {model.default_data}")
        entry = methods().get(self.method.name)
        if entry.check is not None:
            entry.check(self)
        self._check_parallel(entry)
        self._check_memory(entry, model)
        self._check_fault_tolerance(entry)

    def _check_fault_tolerance(self, entry: Any) -> None:
        """``runtime.fault_tolerance`` only for methods that run over a quorum."""
        if self.runtime.fault_tolerance == "none":
            return
        able = [n for n, e in methods().entries() if e.fault_tolerant]
        check(entry.fault_tolerant, "runtime.fault_tolerance",
              f"method {self.method.name} cannot run over a torchft quorum yet (methods that "
              f"can: {', '.join(able)}); drop --runtime.fault_tolerance or choose one of them")
        check(not self.run.resume or entry.rescales(self.method.options), "run.resume",
              f"method {self.method.name}'s fault-tolerant checkpoint holds one worker's own "
              "state (codec residuals, fragments, a subnet) that the others cannot load: resume "
              "it without --runtime.fault_tolerance on one worker, or choose options whose "
              "checkpoint is every worker's (no codec, one fragment)")

    def _check_parallel(self, entry: Any) -> None:
        """Model-parallel degrees only for methods that declare them (MethodEntry.parallel)."""
        for key, what in (("pp", "pipeline stages"), ("tp", "tensor-parallel layers")):
            others = [n for n, e in methods().entries() if key in e.parallel]
            check(getattr(self.parallel, key) == 1 or key in entry.parallel, f"parallel.{key}",
                  f"method {self.method.name} has no {what} (methods that do: "
                  f"{', '.join(others) or 'none'}); drop --parallel.{key} or choose one of them")

    def _check_memory(self, entry: Any, model: Any) -> None:
        """The memory options the method and the model support (one line each)."""
        mem = self.memory
        for key, off in (("zero", 0), ("recompute", "none")):
            check(getattr(mem, key) == off or key in entry.memory, f"memory.{key}",
                  f"method {self.method.name} does not take it (methods that do: "
                  f"{', '.join(n for n, e in methods().entries() if key in e.memory) or 'none'}"
                  f"); drop --memory.{key}")
        check(mem.zero == 0 or self.parallel.pp * self.parallel.tp == 1, "memory.zero",
              "shards over data-parallel replicas only; use --parallel.pp 1 --parallel.tp 1")
        parts = {"block": model.blocks, "selective": model.selective}.get(mem.recompute, ("-",))
        check(bool(parts), "memory.recompute",
              f"model {self.model.name} declares no {mem.recompute} parts; use "
              f"--memory.recompute {'block' if model.blocks else 'none'}")
        check(mem.zero < 2 or bool(model.blocks), "memory.zero",
              f"model {self.model.name} declares no blocks to shard; use --memory.zero 1")

    @property
    def sync_every(self) -> int:
        """Steps between points where every worker holds the same full model."""
        return methods().get(self.method.name).sync_every_for(
            self.method.options, models().get(self.model.name).ist)

    @property
    def run_name(self) -> str:
        return self.run.name or self.method.name

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out) / self.run_name

    @property
    def dp_degree(self) -> int:
        return self.runtime.workers // (self.parallel.pp * self.parallel.tp)


# --- registries of the choice sections --------------------------------------------------------
def datasets() -> Registry[Any]:
    from thinwire.data import DATASETS

    return DATASETS


def models() -> Registry[Any]:
    from thinwire.models import MODELS

    return MODELS


def methods() -> Registry[Any]:
    from thinwire.strategies import METHODS

    return METHODS


CHOICES: dict[str, Any] = {"data": datasets, "model": models, "method": methods}
"""Sections that choose a registry entry by ``name``: section -> its registry."""

SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


def common_fields(section: str) -> list[dataclasses.Field[Any]]:
    """The fields of a section that every entry shares (``options`` excluded)."""
    return [f for f in dataclasses.fields(SECTIONS[section]) if not f.metadata.get("entry_options")]


def iter_options() -> Iterator[tuple[str, dataclasses.Field[Any], Any, tuple[str, ...]]]:
    """Every option: (dotted name, field, type, entries that take it — empty for common ones).

    An entry option several entries declare (``method.period``) is listed once, with the first
    declaration's field."""
    for section, cls in SECTIONS.items():
        for f, typ in iter_fields(cls):
            if not f.metadata.get("entry_options"):
                yield f"{section}.{f.name}", f, typ, ()
        if section in CHOICES:
            seen: dict[str, tuple[dataclasses.Field[Any], Any, list[str]]] = {}
            for name, entry in CHOICES[section]().entries():
                for f, typ in iter_fields(entry.options):
                    seen.setdefault(f.name, (f, typ, []))[2].append(name)
            for key, (f, typ, owners) in seen.items():
                yield f"{section}.{key}", f, typ, tuple(owners)


def _entry_options(section: str, name: str, values: Mapping[str, Any]) -> Any:
    registry = CHOICES[section]()
    entry = registry.get(name)
    known = {f.name for f in dataclasses.fields(entry.options)}
    for key in values:
        if key not in known:
            owners = [n for n, e in registry.entries()
                      if key in {f.name for f in dataclasses.fields(e.options)}]
            if owners:
                raise ConfigError(f"{section}.{key} is an option of {section} "
                                  f"{', '.join(owners)}, not of {name}; drop it or choose "
                                  f"--{section}.name {owners[0]}")
            listing = ", ".join(sorted(known)) or "none"
            raise ConfigError(f"unknown option {section}.{key}; {section} {name} takes: {listing}")
    return build_options(entry.options, values, section, owner=f"{section} {name}")


def _build_section(section: str, content: Mapping[str, Any]) -> Any:
    cls = SECTIONS[section]
    common = {f.name: f for f in common_fields(section)}
    own = {k: v for k, v in content.items() if k in common}
    rest = {k: v for k, v in content.items() if k not in common}
    if section not in CHOICES:
        if rest:
            key = next(iter(rest))
            raise ConfigError(f"unknown option {section}.{key}; known in [{section}]: "
                              f"{', '.join(sorted(common))}")
        return build_options(cls, own, section)
    base = build_options(cls, own, section)
    if section == "data" and not base.name:
        return base  # resolved once the model is known (its default dataset)
    return dataclasses.replace(base, options=_entry_options(section, base.name, rest))


def build(values: Mapping[str, Mapping[str, Any]]) -> Config:
    """A validated Config from nested ``{section: {option: value}}``; unknown keys are errors."""
    for section, content in values.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]; known: {', '.join(SECTIONS)}")
        if not isinstance(content, Mapping):
            raise ConfigError(f"{section}: expected a table of options")
    method_name = values.get("method", {}).get("name", MethodConfig().name)
    if method_name in methods():  # the method's own defaults for options left unset
        own: dict[str, dict[str, Any]] = {s: dict(v) for s, v in values.items()}
        entry = methods().get(method_name)
        for dotted, value in entry.defaults.items():
            section, _, key = dotted.partition(".")
            own.setdefault(section, {}).setdefault(key, value)
        if entry.model_kinds and "name" not in own.get("model", {}):
            fit = [n for n, m in models().entries() if set(m.data_kinds) & set(entry.model_kinds)]
            if fit:
                own.setdefault("model", {})["name"] = fit[0]
        values = own
    sections = {s: _build_section(s, values.get(s, {})) for s in SECTIONS}
    if not sections["data"].name:  # the model's default dataset
        content = dict(values.get("data", {}))
        content["name"] = models().get(sections["model"].name).default_data
        sections["data"] = _build_section("data", content)
    if "batch_size" not in values.get("train", {}):  # the dataset's own default, if it has one
        batch = datasets().get(sections["data"].name).batch_size
        if batch:
            sections["train"] = dataclasses.replace(sections["train"], batch_size=batch)
    return Config(**sections)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Nested plain values; a choice section's entry options sit beside its common ones."""
    out: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        value = getattr(cfg, section)
        d = {f.name: getattr(value, f.name) for f in common_fields(section)}
        if section in CHOICES:
            d.update(dataclasses.asdict(value.options))
        out[section] = d
    return out


def merge(base: Mapping[str, Mapping[str, Any]], overrides: Mapping[str, Any]
          ) -> dict[str, dict[str, Any]]:
    """Apply ``{"train.lr": "0.05"}`` style overrides on nested values.

    Choosing another entry (``model.name``) drops the file's options of the previous entry."""
    out = {s: dict(v) if isinstance(v, Mapping) else v for s, v in base.items()}
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override {dotted!r}: use SECTION.OPTION, e.g. train.lr")
        target = out.setdefault(section, {})
        if not isinstance(target, dict):
            raise ConfigError(f"{section}: expected a table of options")
        if key == "name" and section in CHOICES and target.get("name", value) != value:
            common = {f.name for f in common_fields(section)} if section in SECTIONS else set()
            for k in [k for k in target if k not in common]:
                del target[k]
        target[key] = value
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} not found; pass an existing TOML file to --config")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"config file {p}: not valid TOML ({first}); fix the file") from None
    except OSError as exc:
        raise ConfigError(f"config file {p}: cannot be read ({exc.strerror}); check its "
                          "permissions") from None


def load(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """TOML file (optional) plus dotted overrides, validated."""
    base = read_toml(path) if path else {}
    if path:
        check_toml_types(base, path)
    return build(merge(base, overrides or {}))


def check_toml_types(values: Mapping[str, Any], path: str | Path) -> None:
    """TOML has types: a number or a boolean written as a string (``steps = "10"``) is an
    error naming the key and the fix (the command line's text values are converted instead)."""
    kinds = {dotted: typ for dotted, _f, typ, _owners in iter_options()}
    for section, content in values.items():
        if not isinstance(content, Mapping):
            continue
        for key, value in content.items():
            typ = kinds.get(f"{section}.{key}")
            if typ in (int, float, bool) and isinstance(value, str):
                want = "true or false" if typ is bool else "a number"
                raise ConfigError(f"config file {path}: {section}.{key} = {value!r} is a "
                                  f"string; write {want} without quotes, e.g. {key} = "
                                  f"{value.strip() or ('true' if typ is bool else '1')}")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(type(v))


def dumps(cfg: Config) -> str:
    """The resolved config as TOML (read back by :func:`load` to the same Config)."""
    lines: list[str] = []
    for section, values in to_dict(cfg).items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def label(cfg: Config) -> str:
    """A short human name: the method's label plus train and model options that differ from
    their defaults and change what is trained (e.g. ``ist(K=10,central) [lr=0.1, norm=layer]``)."""
    name = methods().get(cfg.method.name).label_of(cfg.method.options)
    extras = []
    defaults = TrainConfig()
    for key in ("lr", "schedule", "optimizer", "momentum"):
        value = getattr(cfg.train, key)
        if value != getattr(defaults, key):
            extras.append(f"{key}={value:g}" if isinstance(value, float) else str(value))
    mdefaults = type(cfg.model.options)()
    for f in dataclasses.fields(cfg.model.options):
        value = getattr(cfg.model.options, f.name)
        if value != getattr(mdefaults, f.name):
            shown = ",".join(map(str, value)) if isinstance(value, tuple) else value
            extras.append(f"{f.name}={shown}")
    mem = MemoryConfig()
    extras += [f"{k}={getattr(cfg.memory, k)}" for k in ("zero", "recompute", "offload")
               if getattr(cfg.memory, k) != getattr(mem, k)]
    if cfg.model.name != ModelConfig().name:
        name = f"{cfg.model.name}:{name}"
    return name + (f" [{', '.join(extras)}]" if extras else "")


__all__ = [
    "Config", "ConfigError", "DataConfig", "MemoryConfig", "MethodConfig", "ModelConfig", "ParallelConfig",
    "RunConfig", "RuntimeConfig", "TrainConfig", "UsageError", "build", "dumps", "iter_options",
    "label", "load", "merge", "read_toml", "to_dict",
]
