"""``thinwire train``: train one method on N local workers through the elastic launcher.

Every config field is an option (``--train.lr 0.05``); ``--config FILE`` reads a TOML file first.
The resolved config is written to ``RUN_DIR/config.toml``; ``metrics.jsonl``, ``summary.json``
and the final ``model.pt`` are written beside it; ``thinwire report RUN_DIR`` tabulates them.
"""

from __future__ import annotations

import argparse

from thinwire import config as config_mod
from thinwire.commands.common import add_common, add_config_options, overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Train one method on N local workers (torch's elastic launcher; gloo on CPU, nccl on "
        "CUDA), e.g. `thinwire train --model gpt --method ist:local_steps=20 --workers 4`. "
        "For several machines run `torchrun ... -m thinwire.worker RUN_DIR/config.toml`.")
    add_common(parser)
    add_config_options(parser)


def run(args: argparse.Namespace) -> int:
    from thinwire.report.tables import summary_table
    from thinwire.run import run_config

    cfg = config_mod.load(args.config, overrides(args))
    summary = run_config(cfg)
    print(summary_table([summary]))
    for lost in summary.get("fault_tolerance", {}).get("lost", []):
        print(f"worker {lost['worker']} lost at step {lost['step']} ({lost['ended']}); "
              "its survivors finished")
    print(f"run directory: {cfg.run_dir}")
    return 0
