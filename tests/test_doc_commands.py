"""Every ``thinwire ...`` command line quoted in README.md, docs/*.md and docs/benchmarks/*.md
(code blocks, inline code, and the ``printed by:`` comments above recorded outputs) still parses
and validates: the sub-command's arguments, then what the command checks before it trains or
writes anything (train, compare, bench: the configs and the target; theory: the experiments and
their parameters); plan commands that name what they price and only print are run. Placeholders
(``FILE``, ``METHOD``, ``...``, ``[--option]``) and commands that name their sub-command only are
left out. Nothing is trained and nothing is written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from thinwire.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]
PLACEHOLDER = re.compile(r"\.\.\.|\[|\{|\*|\bFILE\b|FILE\.|\bSRC\b|\bMETHOD\b|\bNAME\b|\bDIR\b|"
                         r"RUN_DIR|SHAPE|XMLP\.toml|\bM --cluster C\b|\bC\b$")
WRITES = ("--out", "--calibrate", "--plots")  # plan/theory options that write files
READS_RUNS = re.compile(r"(^|\s)runs/")  # run directories of the documented runs


def _joined(block: str) -> list[str]:
    """A code block's lines, backslash continuations joined."""
    out: list[str] = []
    for line in block.split("\n"):
        if out and out[-1].endswith("\\"):
            out[-1] = out[-1][:-1].rstrip() + " " + line.strip()
        else:
            out.append(line.strip())
    return out


def quoted_commands() -> list[tuple[str, str]]:
    """(file name, command line) of every quoted ``thinwire`` command, without its comment."""
    found: list[tuple[str, str]] = []
    for path in DOCS:
        text = path.read_text()
        lines = [ln for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
                 for ln in _joined(block)]
        lines += re.findall(r"`(thinwire [^`]+)`", text.replace("\n", " "))
        lines += re.findall(r"<!-- (?:printed by|output of): (thinwire [^>]*?) -->", text)
        for line in lines:
            line = re.sub(r"^(sudo |\$ )", "", line.strip()).split(" # ")[0].strip()
            if line.startswith("thinwire ") and len(line.split()) > 2 \
                    and not PLACEHOLDER.search(line):
                found.append((path.name, re.sub(r"\s+", " ", line)))
    return sorted(set(found))


COMMANDS = quoted_commands()


def test_the_docs_quote_commands() -> None:
    assert len(COMMANDS) > 40, COMMANDS  # the extraction still finds them
    assert ("README.md", "thinwire plan --crossover --convergence mlp-fashion-mnist") in COMMANDS


def _validate(argv: list[str]) -> None:
    """Parse ``argv`` and run the command's own checks up to, not including, its work."""
    from thinwire import config as config_mod
    from thinwire.commands.common import metric_of, overrides

    args = build_parser(argv).parse_args(argv)
    if getattr(args, "config", None) and not Path(args.config).is_absolute():
        args.config = str(ROOT / args.config)
    if args.command == "train":
        config_mod.load(args.config, overrides(args))
    elif args.command in ("compare", "bench"):
        from thinwire.report.tables import check_target
        from thinwire.run import method_configs, split_methods

        if args.command == "bench":
            from thinwire.testbed.rates import parse_links

            parse_links(args.link, args.delay)
        for cfg in method_configs(split_methods(args.methods), args.config, overrides(args)):
            check_target(args.target, metric_of(cfg))
    elif args.command == "theory":
        from thinwire.commands.theory import plan
        from thinwire.theory.experiments import default_registry

        if not args.list:
            plan(args, default_registry())


@pytest.mark.parametrize("where,line", COMMANDS, ids=[c for _, c in COMMANDS])
def test_a_quoted_command_line_parses_and_validates(where: str, line: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    argv = shlex.split(line)[1:]
    # a plan that names what it prices (not a prose mention of one option) and only prints
    prints_only = argv[0] == "plan" and not any(a in WRITES for a in argv) \
        and not READS_RUNS.search(line) and "--config" not in argv \
        and any(a in argv for a in ("--model", "--convergence", "--validate", "--list"))
    try:
        if prints_only:
            assert main(argv) == 0, capsys.readouterr().err
        else:
            _validate(argv)
    except SystemExit as exc:  # argparse refused it (or printed --help: exit 0)
        if exc.code:
            pytest.fail(f"{where}: {line}: {capsys.readouterr().err.strip()} (exit {exc.code})")
