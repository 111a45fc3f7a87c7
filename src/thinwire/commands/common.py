"""Argument parsing shared by ``thinwire train``, ``compare`` and ``bench``: the config's options.

Every config option is a ``--section.option`` argument, grouped by section; the options of a
registry entry (a model's, a method's, a dataset's) are grouped under it, each listed once with
the entries that take it. Defaults are shown once, enumerations list their choices. Values are
validated by the config itself (:mod:`thinwire.config`), so a bad one is the config's one-line
error with exit code 2. (Why this is not jsonargparse or tyro: :mod:`thinwire.options`.)
"""

from __future__ import annotations

import argparse
from typing import Any

from thinwire import config as config_mod

SHORTCUTS = {"workers": "runtime.workers", "steps": "train.steps", "out": "run.out"}


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    return str(value)


def add_common(parser: argparse.ArgumentParser, *, names: bool = True) -> None:
    """--config and the shortcuts (``--model gpt`` for ``--model.name gpt``, ...)."""
    g = parser.add_argument_group("general")
    g.add_argument("--config", metavar="FILE", help="TOML config file (sections as below)")
    g.add_argument("--workers", type=int, metavar="N", help="shortcut for --runtime.workers")
    g.add_argument("--steps", type=int, metavar="N", help="shortcut for --train.steps")
    g.add_argument("--out", metavar="DIR", help="shortcut for --run.out")
    g.add_argument("--resume", action="store_true", help="shortcut for --run.resume true")
    g.add_argument("--overwrite", action="store_true", help="shortcut for --run.overwrite true")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument("--model", metavar="NAME", dest="short_model",
                   help="shortcut for --model.name: " + ", ".join(config_mod.models().names()))
    g.add_argument("--data", metavar="NAME", dest="short_data",
                   help="shortcut for --data.name: " + ", ".join(config_mod.datasets().names()))
    if names:
        g.add_argument("--method", metavar="SPEC", dest="short_method",
                       help="the method, optionally with options: e.g. ist, "
                            "ist:local_steps=20, or a codec name for compressed dp (topk)")


def add_config_options(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One ``--section.option`` argument per config option, grouped (module docstring)."""
    parser.usage = "%(prog)s [--config FILE] [--SHORTCUT VALUE ...] [--SECTION.OPTION VALUE ...]"
    groups: dict[str, argparse._ArgumentGroup] = {}
    for dotted, f, _typ, owners in config_mod.iter_options():
        if dotted in skip:
            continue
        section = dotted.partition(".")[0]
        if owners:
            key = f"{section} {owners[0]}"
            title = f"{section} options of {owners[0]}"
        else:
            key, title = section, f"{section} options"
        if key not in groups:
            desc = None
            if section in config_mod.CHOICES and not owners:
                desc = f"{section}.name chooses one of: " + ", ".join(
                    f"{n} ({e.summary})" for n, e in config_mod.CHOICES[section]().entries())
            groups[key] = parser.add_argument_group(title, desc)
        choices = f.metadata.get("choices")
        metavar = "{" + ",".join(map(str, choices)) + "}" if choices else "V"
        also = f" [also {', '.join(owners[1:])}]" if len(owners) > 1 else ""
        groups[key].add_argument(f"--{dotted}", dest=f"cfg:{dotted}", default=None,
                                 metavar=metavar,
                                 help=f"{f.metadata['help']} (default: {_shown(f.default)}){also}")


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config overrides from the parsed arguments (shortcuts first, explicit options win)."""
    from thinwire.run import method_overrides

    out: dict[str, Any] = {}
    if getattr(args, "short_method", None):
        out.update(method_overrides(args.short_method))
    for short, dotted in (("short_model", "model.name"), ("short_data", "data.name")):
        if getattr(args, short, None):
            out[dotted] = getattr(args, short)
    for short, dotted in SHORTCUTS.items():
        if getattr(args, short, None) is not None:
            out[dotted] = getattr(args, short)
    if getattr(args, "resume", False):
        out["run.resume"] = True
    if getattr(args, "overwrite", False):
        out["run.overwrite"] = True
    if getattr(args, "no_progress", False):
        out["run.progress"] = False
    out.update({k[4:]: v for k, v in vars(args).items() if k.startswith("cfg:") and v is not None})
    return out


def metric_of(cfg: Any) -> str:
    """The metric a config's runs are judged by (its dataset's task)."""
    from thinwire.data.task import TASKS

    return TASKS[config_mod.datasets().get(cfg.data.name).kind].metric
