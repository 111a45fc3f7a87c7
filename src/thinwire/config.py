"""Run configuration: frozen dataclasses <- TOML file <- dotted command-line overrides.

Every field carries its help text in ``metadata["help"]`` (shown by ``thinwire train --help``)
and every section validates itself in ``__post_init__``. A bad value raises :class:`ConfigError`
(a :class:`~thinwire.errors.UsageError`) whose one-line message names the field and the fix.
The resolved config is written into the run directory as TOML, so a run can be repeated exactly.
"""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(UsageError):
    """An invalid configuration value; the message names the field and the fix."""


def opt(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field with its help text (the per-field docstring)."""
    if isinstance(default, (list, dict, set)):
        raise TypeError("use tuples for defaults")
    return field(default=default, metadata={"help": help, **kw})


def _check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{name}: {msg}")


METHODS = ("dp", "localsgd", "diloco", "ist")
COMPRESSORS = ("none", "topk", "randk", "qsgd", "int8", "fp16", "bf16", "sign", "powersgd")


@dataclass(frozen=True)
class DataConfig:
    name: str = opt("fashion-mnist", "dataset: fashion-mnist, digits or teacher (synthetic)")
    dir: str = opt("", "directory holding the dataset files (empty: the standard places)")
    download: bool = opt(False, "download a missing dataset from its canonical source")
    shard: str = opt("iid", "per-worker shards: iid or skew (label-skewed, heterogeneous)")
    skew: float = opt(0.0, "with shard=skew: fraction of each class kept on its home worker, 0..1")
    limit_train: int = opt(0, "use only this many training examples (0: all)")
    limit_test: int = opt(0, "use only this many test examples (0: all)")

    def __post_init__(self) -> None:
        _check(self.shard in ("iid", "skew"), "data.shard", f"got {self.shard!r}; use iid or skew")
        _check(0.0 <= self.skew <= 1.0, "data.skew", f"got {self.skew}; use a value in [0, 1]")
        _check(self.limit_train >= 0, "data.limit_train", "must be >= 0 (0 means all)")
        _check(self.limit_test >= 0, "data.limit_test", "must be >= 0 (0 means all)")


@dataclass(frozen=True)
class ModelConfig:
    hidden: tuple[int, ...] = opt((1024, 1024), "hidden layer widths of the MLP, e.g. 2048,2048")
    norm: str = opt("batch", "normalisation after each layer: batch (IST's original), layer or none")
    activation: str = opt("relu", "hidden activation: relu or tanh")

    def __post_init__(self) -> None:
        _check(len(self.hidden) >= 1, "model.hidden", "give at least one hidden width")
        _check(all(h >= 1 for h in self.hidden), "model.hidden", "every width must be >= 1")
        _check(self.norm in ("batch", "layer", "none"), "model.norm",
               f"got {self.norm!r}; use batch, layer or none")
        _check(self.activation in ("relu", "tanh"), "model.activation",
               f"got {self.activation!r}; use relu or tanh")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = opt(600, "optimizer steps per worker")
    batch_size: int = opt(128, "mini-batch size per worker")
    lr: float = opt(0.05, "learning rate")
    momentum: float = opt(0.0, "SGD momentum")
    weight_decay: float = opt(0.0, "weight decay")
    optimizer: str = opt("sgd", "local optimizer: sgd or adamw")
    schedule: str = opt("constant", "learning-rate schedule: constant or cosine")
    eval_every: int = opt(100, "evaluate the full model every this many steps (0: only at the end)")
    log_every: int = opt(10, "write a metrics record every this many steps")
    seed: int = opt(0, "seed of the model, the data order and every shared random draw")

    def __post_init__(self) -> None:
        _check(self.steps >= 1, "train.steps", "must be >= 1")
        _check(self.batch_size >= 1, "train.batch_size", "must be >= 1")
        _check(self.lr >= 0, "train.lr", "must be >= 0")
        _check(0 <= self.momentum < 1, "train.momentum", "must be in [0, 1)")
        _check(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        _check(self.optimizer in ("sgd", "adamw"), "train.optimizer",
               f"got {self.optimizer!r}; use sgd or adamw")
        _check(self.schedule in ("constant", "cosine"), "train.schedule",
               f"got {self.schedule!r}; use constant or cosine")
        _check(self.eval_every >= 0, "train.eval_every", "must be >= 0")
        _check(self.log_every >= 1, "train.log_every", "must be >= 1")


@dataclass(frozen=True)
class MethodConfig:
    name: str = opt("dp", "method: " + ", ".join(METHODS))
    period: int = opt(10, "localsgd/diloco: local steps between averaging (H)")
    local_steps: int = opt(10, "ist: local steps per round (K)")
    deployment: str = opt("central", "ist: central (rank 0 holds the model) or sharded")
    scale: str = opt("batchnorm", "ist: activation scale: batchnorm (batch statistics) or dropout")
    optimizer_state: str = opt("reset", "ist: optimizer state at repartition: reset or reindex")
    switch_at: int = opt(0, "ist: hybrid schedule, switch to local SGD at this step (0: never)")
    outer_lr: float = opt(0.7, "diloco: outer Nesterov learning rate")
    outer_momentum: float = opt(0.9, "diloco: outer Nesterov momentum")
    compressor: str = opt("none", "gradient compressor for dp: " + ", ".join(COMPRESSORS))
    ratio: float = opt(0.01, "topk/randk: fraction of elements kept")
    levels: int = opt(16, "qsgd: quantization levels s")
    rank: int = opt(2, "powersgd: rank r")
    error_feedback: bool = opt(True, "keep the compression residual and add it back (EF)")

    def __post_init__(self) -> None:
        _check(self.name in METHODS, "method.name", f"got {self.name!r}; use one of {', '.join(METHODS)}")
        _check(self.period >= 1, "method.period", "must be >= 1")
        _check(self.local_steps >= 1, "method.local_steps", "must be >= 1")
        _check(self.deployment in ("central", "sharded"), "method.deployment",
               f"got {self.deployment!r}; use central or sharded")
        _check(self.scale in ("batchnorm", "dropout"), "method.scale",
               f"got {self.scale!r}; use batchnorm or dropout")
        _check(self.optimizer_state in ("reset", "reindex"), "method.optimizer_state",
               f"got {self.optimizer_state!r}; use reset or reindex")
        _check(self.switch_at >= 0, "method.switch_at", "must be >= 0")
        _check(self.compressor in COMPRESSORS, "method.compressor",
               f"got {self.compressor!r}; use one of {', '.join(COMPRESSORS)}")
        _check(0 < self.ratio <= 1, "method.ratio", "must be in (0, 1]")
        _check(self.levels >= 1, "method.levels", "must be >= 1")
        _check(self.rank >= 1, "method.rank", "must be >= 1")

    @property
    def sync_every(self) -> int:
        """Steps between points where every worker holds the same full model."""
        if self.name in ("localsgd", "diloco"):
            return self.period
        if self.name == "ist":
            return self.local_steps
        return 1


@dataclass(frozen=True)
class RuntimeConfig:
    workers: int = opt(4, "number of local worker processes")
    backend: str = opt("auto", "torch.distributed backend: auto (nccl on CUDA, else gloo), gloo or nccl")
    device: str = opt("auto", "auto (cuda when available), cpu or cuda")
    timeout_s: float = opt(120.0, "collective timeout: a dead or stuck worker ends the job after this")
    threads: int = opt(0, "torch threads per worker (0: cores / workers, at least 1)")

    def __post_init__(self) -> None:
        _check(self.workers >= 1, "runtime.workers", "must be >= 1")
        _check(self.backend in ("auto", "gloo", "nccl"), "runtime.backend",
               f"got {self.backend!r}; use auto, gloo or nccl")
        _check(self.device in ("auto", "cpu", "cuda"), "runtime.device",
               f"got {self.device!r}; use auto, cpu or cuda")
        _check(self.timeout_s > 0, "runtime.timeout_s", "must be > 0")
        _check(self.threads >= 0, "runtime.threads", "must be >= 0")


@dataclass(frozen=True)
class RunConfig:
    out: str = opt("runs", "parent directory of run directories")
    name: str = opt("", "run directory name (empty: the method's name)")
    checkpoint_every: int = opt(0, "checkpoint every this many steps (0: only at the end)")
    resume: bool = opt(False, "continue from the newest checkpoint in the run directory")
    progress: bool = opt(True, "show a progress bar on rank 0")

    def __post_init__(self) -> None:
        _check(self.checkpoint_every >= 0, "run.checkpoint_every", "must be >= 0")


@dataclass(frozen=True)
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        sync = self.method.sync_every
        for name, every in (("train.steps", self.train.steps),
                            ("train.eval_every", self.train.eval_every),
                            ("run.checkpoint_every", self.run.checkpoint_every)):
            _check(every % sync == 0, name,
                   f"{every} is not a multiple of {sync}, the steps between synchronisations "
                   f"of {self.method.name}; use a multiple of {sync}")
        if self.method.name == "ist":
            _check(min(self.model.hidden) >= self.runtime.workers, "model.hidden",
                   f"IST cuts each hidden layer into {self.runtime.workers} groups; "
                   f"use widths >= {self.runtime.workers}")
            _check(self.method.scale != "batchnorm" or self.model.norm == "batch", "method.scale",
                   "batchnorm scaling needs --model.norm batch; with other norms use "
                   "--method.scale dropout")
            _check(self.method.switch_at % self.method.local_steps == 0, "method.switch_at",
                   f"must be a multiple of method.local_steps ({self.method.local_steps})")

    @property
    def run_name(self) -> str:
        return self.run.name or self.method.name

    @property
    def run_dir(self) -> Path:
        return Path(self.run.out) / self.run_name


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}  # type: ignore[misc]


def iter_options() -> Iterator[tuple[str, dataclasses.Field[Any], type]]:
    """Every (dotted name, field, section class) of the config, in declaration order."""
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            yield f"{section}.{f.name}", f, hints[f.name]


def _coerce(name: str, typ: Any, value: Any) -> Any:
    """Convert a TOML or command-line value to the field's type, or fail naming the field."""
    origin = typing.get_origin(typ)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.replace(" ", "").split(",") if v]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{name}: expected a list such as 1024,1024, got {value!r}")
        (inner, *_rest) = typing.get_args(typ)
        return tuple(_coerce(name, inner, v) for v in value)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(typ) if a is not type(None)][0]
        return _coerce(name, inner, value)
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{name}: expected true or false, got {value!r}")
    if typ in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{name}: expected a number, got {value!r}")
        try:
            if typ is int:
                if isinstance(value, float) and not value.is_integer():
                    raise ValueError
                return int(value)
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{name}: expected {'an integer' if typ is int else 'a number'}, "
                              f"got {value!r}") from None
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{name}: expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {typ} for {name}")


def build(values: Mapping[str, Mapping[str, Any]]) -> Config:
    """A validated Config from nested ``{section: {field: value}}``; unknown keys are errors."""
    sections: dict[str, Any] = {}
    for section, content in values.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown section [{section}]; known: {', '.join(SECTIONS)}")
        if not isinstance(content, Mapping):
            raise ConfigError(f"{section}: expected a table of options")
    for section, cls in SECTIONS.items():
        content = dict(values.get(section, {}))
        hints = typing.get_type_hints(cls)
        known = {f.name for f in dataclasses.fields(cls)}
        for key in content:
            if key not in known:
                raise ConfigError(f"unknown option {section}.{key}; known in [{section}]: "
                                  f"{', '.join(sorted(known))}")
        kwargs = {k: _coerce(f"{section}.{k}", hints[k], v) for k, v in content.items()}
        sections[section] = cls(**kwargs)
    return Config(**sections)


def to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    return {s: dataclasses.asdict(getattr(cfg, s)) for s in SECTIONS}


def merge(base: Mapping[str, Mapping[str, Any]], overrides: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Apply ``{"train.lr": "0.05"}`` style overrides on nested values."""
    out = {s: dict(v) for s, v in base.items()}
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override {dotted!r}: use SECTION.OPTION, e.g. train.lr")
        out.setdefault(section, {})[key] = value
    return out


def read_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} not found; pass an existing TOML file to --config")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p}: invalid TOML ({exc}); fix the syntax") from None


def load(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> Config:
    """TOML file (optional) plus dotted overrides, validated."""
    base = read_toml(path) if path else {}
    return build(merge(base, overrides or {}))


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


def add_override_options(parser: Any, skip: Sequence[str] = ()) -> None:
    """Add one ``--section.option`` argument per config field, with its help and default."""
    for dotted, f, _typ in iter_options():
        if dotted in skip:
            continue
        default = f.default
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        parser.add_argument(f"--{dotted}", dest=f"cfg:{dotted}", default=None, metavar="V",
                            help=f"{f.metadata['help']} (default: {shown})")


def overrides_from_args(args: Any) -> dict[str, Any]:
    return {k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:") and v is not None}
