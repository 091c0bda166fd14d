"""``python -m harness``: the command-line front end over the harness library.

One module per command, each with ``add_arguments(parser)`` and ``main(args) -> exit status``:
``run`` and ``list`` (``harness.cli.run``), ``models``, ``bench`` (pool overhead), ``nightly`` (matrix,
fuzz, report, diff in one directory; its shards merged, or submitted as one job array), ``history`` (trend
over nightlies), ``certify`` (conformance certificate of one engine) and ``perf`` (training-step
benchmark against torch). The shared selection options are registered by ``harness.cli.options`` from the
library's options model (``harness.run.options.SelectionOptions``); ``run``, ``nightly`` and ``certify`` run
their cases through one ``harness.run.session.RunSession``. Nothing in the library imports this package.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from harness.cli import bench, certify, history, nightly_submit, perf, run
from harness.cli.options import given_options
from harness.run.one_line_parser import OneLineParser
from harness.run.options import as_typed
from harness.run.runner import SelectionError

__all__ = ["build_parser", "main"]


#: every command: name, help, ``add_arguments`` (or None), ``main``.
COMMANDS: tuple[tuple[str, str, Callable[[argparse.ArgumentParser], None] | None, Callable[[argparse.Namespace], int]], ...] = (
    ("run", "run parity cases and record them", run.add_run_arguments, run.main),
    ("list", "print the full ids of the selected cases", run.add_list_arguments, run.main_list),
    ("models", "describe the model zoo", None, run.main_models),
    ("bench", "per-case overhead: warm pool against spawning the ranks per case", bench.add_arguments, bench.main),
    ("nightly", "the nightly: full matrix, fuzz campaign, report and diff into one directory",
     nightly_submit.add_arguments, nightly_submit.main),
    ("history", "trend page over several nightly directories", history.add_arguments, history.main),
    ("certify", "conformance certificate of one engine: every behaviour family, Markdown/HTML/JSON",
     certify.add_arguments, certify.main),
    ("perf", "training-step benchmark: our engine against torch FSDP1 (and DDP, FSDP2)", perf.add_arguments, perf.main),
)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m harness", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name, help_text, add_arguments, fn in COMMANDS:
        command = sub.add_parser(name, help=help_text)
        if add_arguments is not None:
            add_arguments(command)
        command.set_defaults(fn=fn)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    add_arguments = next(add for name, _, add, _ in COMMANDS if name == args.command)
    # Which options the command line sets, for ``--resume`` to tell a contradiction from a default.
    args.given_options = given_options(add_arguments, argv[argv.index(args.command) + 1:], vars(args)) if add_arguments else frozenset()
    try:
        return int(args.fn(args))
    except SelectionError as exc:
        parser.error(as_typed(str(exc), argv))  # exits with status 2
        raise  # unreachable: parser.error exits
