"""``thinwire train``: train one method on N local workers through the elastic launcher.

Every config field is an option (``--train.lr 0.05``); ``--config FILE`` reads a TOML file first.
The resolved config is written to ``RUN_DIR/config.toml``; ``metrics.jsonl`` and
``summary.json`` are written beside it; ``thinwire report RUN_DIR`` tabulates and plots them.
"""

from __future__ import annotations

import argparse

from thinwire import config as config_mod
from thinwire.commands.common import add_common, overrides, run_config
from thinwire.config import METHODS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.description = (
        "Train one method on N local workers (torch's elastic launcher; gloo on CPU, nccl on "
        f"CUDA). Methods: {', '.join(METHODS)}; dp takes --method.compressor. "
        "For several machines run `torchrun ... -m thinwire.worker RUN_DIR/config.toml`.")
    add_common(parser)
    parser.add_argument("--method", metavar="NAME",
                        help=f"shortcut for --method.name ({', '.join(METHODS)}) or a compressor "
                             "name for compressed dp (topk, randk, qsgd, int8, fp16, bf16, sign, powersgd)")
    config_mod.add_override_options(parser)


def run(args: argparse.Namespace) -> int:
    from thinwire.commands.compare import method_overrides
    from thinwire.report.tables import summary_table

    extra = overrides(args)
    if args.method:
        extra = {**method_overrides(args.method), **extra}
    cfg = config_mod.load(args.config, extra)
    summary = run_config(cfg)
    print(summary_table([summary]))
    print(f"run directory: {cfg.run_dir}")
    return 0
