"""The ``thinwire`` command: one sub-command per capability.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``; modules are imported only when their sub-command is used, so
``thinwire plan`` and ``thinwire theory`` start without importing torch.distributed.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from thinwire.errors import RunFailed, UsageError

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("thinwire.commands.train", "train one method on N local workers (or under torchrun)"),
    "compare": ("thinwire.commands.compare", "train several methods on the same data and compare"),
    "report": ("thinwire.commands.report", "tables and plots from run directories"),
    "plan": ("thinwire.commands.plan", "predict memory, bytes and step time; search plans"),
    "theory": ("thinwire.commands.theory", "IST on quadratics: reproduce Shulgin & Richtarik"),
    "bench": ("thinwire.commands.bench", "thin-wire testbed: workers in rate-limited namespaces"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error in one line (and exit code 2)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="thinwire",
        description="Train neural networks across workers joined by thin links.",
    )
    from thinwire import __version__

    parser.add_argument("--version", action="version", version=f"thinwire {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except UsageError as exc:
        print(f"thinwire {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"thinwire {args.command}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        from thinwire.launch import ignore_signals

        ignore_signals()  # handled once: a second Ctrl-C cannot cut the exit short
        print(f"thinwire {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
