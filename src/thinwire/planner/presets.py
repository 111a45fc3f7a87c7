"""Named presets and TOML files for models and clusters (read with tomllib).

A preset is ``thinwire/presets/<kind>-<name>.toml``; ``--model``/``--cluster`` take a preset
name, an alias listed in a preset's ``aliases``, or a path to a TOML file of the same form.
Model names ``mlp-<w0>-<w1>-...-<wL>`` build an MLP of those widths without a file. Unknown
keys are rejected so a typo cannot silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from importlib import resources
from pathlib import Path
from typing import Any

from thinwire.errors import UsageError
from thinwire.planner.specs import (
    ClusterSpec,
    CountedSpec,
    MLPSpec,
    ModelSpec,
    TransformerSpec,
    XMLPShapes,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

GIB = 1024**3


def _preset_files(kind: str) -> dict[str, Any]:
    """Preset name -> the packaged ``<kind>-<name>.toml`` resource."""
    root = resources.files("thinwire") / "presets"
    out: dict[str, Any] = {}
    for entry in root.iterdir():
        name = entry.name
        if name.startswith(f"{kind}-") and name.endswith(".toml"):
            out[name[len(kind) + 1 : -5]] = entry
    return out


def _read(entry: Any, label: str) -> dict[str, Any]:
    try:
        return tomllib.loads(entry.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise UsageError(f"cannot read {label}: not UTF-8 text (a binary file?); pass a TOML "
                         "file or a preset name") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"cannot read {label}: {first}; fix the TOML file") from None


def list_presets(kind: str) -> list[str]:
    """Preset names of ``kind`` ("model" or "cluster"), sorted."""
    return sorted(_preset_files(kind))


def _lookup(kind: str, ref: str) -> dict[str, Any]:
    """The TOML data of a file path, a preset name or a preset's alias."""
    if ref.endswith(".toml") or "/" in ref:
        path = Path(ref)
        if not path.is_file():
            raise UsageError(
                f"--{kind} file {ref} does not exist; give a preset name or an existing .toml"
            )
        return _read(path, str(path))
    files = _preset_files(kind)
    if ref in files:
        return _read(files[ref], f"preset {ref}")
    for name, entry in files.items():
        data = _read(entry, f"preset {name}")
        if ref in data.get("aliases", []):
            return data
    raise UsageError(
        f"unknown --{kind} {ref!r}; use one of {', '.join(sorted(files))} or a FILE.toml"
    )


def _build(cls: type, data: dict[str, Any], label: str) -> Any:
    """``cls(**data)`` with unknown and missing keys as one-line errors."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise UsageError(
            f"{label}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}"
        )
    missing = sorted(
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in data
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    )
    if missing:
        raise UsageError(f"{label}: missing key(s) {', '.join(missing)}; add them to the TOML")
    try:
        return cls(**data)
    except TypeError as exc:
        raise UsageError(f"{label}: {exc}; check the value types") from exc


def cluster_from_dict(data: dict[str, Any], label: str = "cluster") -> ClusterSpec:
    """A ClusterSpec from TOML data (``device_memory_gib`` is accepted for bytes)."""
    data = {k: v for k, v in data.items() if k not in ("kind", "aliases", "description")}
    if "device_memory_gib" in data:
        data["device_memory"] = float(data.pop("device_memory_gib")) * GIB
    if "matmul_efficiency" in data:
        data["matmul_efficiency"] = tuple(tuple(p) for p in data["matmul_efficiency"])
    return _build(ClusterSpec, data, label)


_KINDS = {cls.__name__.removesuffix("Spec").lower(): cls
          for cls in (TransformerSpec, MLPSpec, CountedSpec)}
"""A model file's ``kind``: the spec class it describes (transformer, mlp or counted)."""


def model_from_dict(data: dict[str, Any], label: str = "model") -> ModelSpec:
    """A model spec from TOML data; ``kind`` is transformer (default), mlp, counted or extreme
    (:class:`~thinwire.planner.specs.XMLPShapes`' keys and ``name``)."""
    data = dict(data)
    kind = data.pop("kind", "transformer")
    data.pop("aliases", None)
    data.pop("description", None)
    if kind not in _KINDS and kind != "extreme":
        raise UsageError(f"{label}: kind={kind!r}; use one of {', '.join(_KINDS)} or extreme")
    if kind == "extreme":  # an extreme-classification network, counted from its shapes
        name = data.pop("name", label)
        return _build(XMLPShapes, data, label).spec(str(name))  # type: ignore[no-any-return]
    if _KINDS[kind] is MLPSpec and "widths" in data:
        data["widths"] = tuple(data["widths"])
    return _build(_KINDS[kind], data, label)


def load_cluster(ref: str, nodes: int | None = None) -> ClusterSpec:
    """A cluster preset, alias or TOML path; ``nodes`` overrides the node count."""
    spec = cluster_from_dict(_lookup("cluster", ref), f"cluster {ref}")
    if nodes is not None:
        if nodes < 1:
            raise UsageError(f"--nodes={nodes} must be >= 1")
        spec = dataclasses.replace(spec, nodes=nodes)
    return spec


def load_model(ref: str) -> ModelSpec:
    """A model preset, a TOML path, or ``mlp-784-2048-10``-style widths."""
    match = re.fullmatch(r"mlp((?:-\d+){3,})", ref)
    if match and ref not in _preset_files("model"):
        widths = tuple(int(w) for w in match.group(1).strip("-").split("-"))
        return MLPSpec(name=ref, widths=widths)
    return model_from_dict(_lookup("model", ref), f"model {ref}")


def model_spec_from_module(module: Any, name: str = "module", adapter: Any = None
                           ) -> MLPSpec | CountedSpec:
    """Count a torch ``nn.Module``: an MLPSpec when it is a chain of Linear layers with biases
    and no other parameters (IST can partition it), else a CountedSpec of parameters and 6 x
    multiply-adds of its Linear layers. With ``adapter`` (the model's
    :class:`~thinwire.models.adapter.ISTAdapter`, e.g. ``MODELS.get("gpt").ist(model)``) it is
    always a CountedSpec carrying the adapter's plan, so the planner prices IST from the
    adapter's own cut (a module on the meta device counts without memory).

    torch is imported here only, so the planner runs without it.
    """
    from torch import nn

    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    params = sum(p.numel() for p in module.parameters() if p.requires_grad)
    chain = bool(linears) and all(
        a.out_features == b.in_features for a, b in zip(linears, linears[1:])
    )
    if chain and len(linears) >= 2 and adapter is None:
        widths = (linears[0].in_features, *(m.out_features for m in linears))
        spec = MLPSpec(name=name, widths=widths, norm="none")
        if all(m.bias is not None for m in linears) and spec.params == params:
            return spec
    flops = 6.0 * sum(m.in_features * m.out_features for m in linears)
    if flops <= 0:
        raise UsageError(
            f"{name}: no nn.Linear layers to count FLOPs from; describe it in a TOML file"
        )
    if adapter is not None:
        return CountedSpec(name=name, params=params, flops_per_sample=flops, ist=adapter.plan)
    return CountedSpec(name=name, params=params, flops_per_sample=flops)
