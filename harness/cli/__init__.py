"""``python -m harness``: the command-line front end over the harness library.

One module per command, each with ``add_arguments(parser)`` and ``main(args) -> exit status``:
``run`` and ``list`` (``harness.cli.run``), ``models``, ``bench`` (pool overhead), ``nightly`` (matrix,
fuzz, report, diff in one directory; its shards merged, or submitted as one job array), ``history`` (trend
over nightlies), ``certify`` (conformance certificate of one engine) and ``perf`` (training-step
benchmark against torch). The shared selection options are registered by ``harness.cli.options`` from the
library's options model (``harness.run.options.SelectionOptions``); ``run``, ``nightly`` and ``certify`` run
their cases through one ``harness.run.session.RunSession``. Nothing in the library imports this package. A command's
module is imported when that command is parsed (``Command``), so a run does not load the reports' pandas
and matplotlib that ``certify`` and ``history`` need.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from harness.cli.options import given_options
from harness.ranks.forkserver import start_early
from harness.run.one_line_parser import OneLineParser
from harness.run.options import as_typed
from harness.run.runner import SelectionError

__all__ = ["build_parser", "main"]

AddArguments = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Command:
    """One command, by its module (``harness.cli.<module>``) and that module's functions' names: by name, so
    that a process imports the module of the command it runs only (torchrun's ranks run ``run``; ``--help``
    imports none)."""

    name: str
    help: str
    module: str
    #: the module's ``add_arguments`` function; None for a command without arguments.
    add_arguments: str | None
    main: str

    def load(self) -> tuple[AddArguments | None, Callable[[argparse.Namespace], int]]:
        module = importlib.import_module(f"harness.cli.{self.module}")
        return (getattr(module, self.add_arguments) if self.add_arguments else None), getattr(module, self.main)


#: every command, in the order ``--help`` lists them.
COMMANDS: tuple[Command, ...] = (
    Command("run", "run parity cases and record them", "run", "add_run_arguments", "main"),
    Command("list", "print the full ids of the selected cases", "run", "add_list_arguments", "main_list"),
    Command("models", "describe the model zoo", "run", None, "main_models"),
    Command("bench", "per-case overhead: warm pool against spawning the ranks per case", "bench", "add_arguments", "main"),
    Command("nightly", "the nightly: full matrix, fuzz campaign, report and diff into one directory",
            "nightly_submit", "add_arguments", "main"),
    Command("history", "trend page over several nightly directories", "history", "add_arguments", "main"),
    Command("certify", "conformance certificate of one engine: every behaviour family, Markdown/HTML/JSON",
            "certify", "add_arguments", "main"),
    Command("perf", "training-step benchmark: our engine against torch FSDP1 (and DDP, FSDP2)", "perf", "add_arguments", "main"),
)


class CommandParser(OneLineParser):
    """A command's parser, given its arguments the first time it parses or prints its help: the parser tree,
    ``--help`` and every error are argparse's as if every command had been filled up front."""

    def __init__(self, *args: Any, command: Command | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._command = command

    def fill(self) -> None:
        if self._command is None:
            return
        command, self._command = self._command, None
        add_arguments, fn = command.load()
        if add_arguments is not None:
            add_arguments(self)
        self.set_defaults(fn=fn)

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None,
                         ) -> tuple[argparse.Namespace, list[str]]:
        if self._command is not None and args is not None and not {"-h", "--help"} & set(args):
            # Before the command's imports: the forkserver imports the rank side meanwhile, on another core.
            start_early(self._command.name, list(args))
        self.fill()
        return super().parse_known_args(args, namespace)

    def format_usage(self) -> str:
        self.fill()
        return super().format_usage()

    def format_help(self) -> str:
        self.fill()
        return super().format_help()


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m harness", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CommandParser)
    for command in COMMANDS:
        sub.add_parser(command.name, help=command.help, command=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    add_arguments, _ = next(c for c in COMMANDS if c.name == args.command).load()
    # Which options the command line sets, for ``--resume`` to tell a contradiction from a default.
    args.given_options = given_options(add_arguments, argv[argv.index(args.command) + 1:], vars(args)) if add_arguments else frozenset()
    try:
        return int(args.fn(args))
    except SelectionError as exc:
        parser.error(as_typed(str(exc), argv))  # exits with status 2
        raise  # unreachable: parser.error exits
