"""``python -m harness``: the command-line front end over the harness library.

One module per command, each with ``add_arguments(parser)`` and ``main(args) -> exit status``:
``run`` and ``list`` (``harness.cli.run``), ``models``, ``bench`` (pool overhead), ``nightly`` (matrix,
fuzz, report, diff in one directory), ``history`` (trend over nightlies), ``certify`` (conformance
certificate of one engine) and ``perf`` (training-step benchmark against torch). The shared selection
options live in ``harness.cli.options``; every command runs cases through ``harness.runner``. Nothing
in the library imports this package.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from harness.cli import bench, certify, history, nightly, perf, run
from harness.runner import SelectionError

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = [
        ("run", "run parity cases and record them", run.add_run_arguments, run.main),
        ("list", "print the full ids of the selected cases", run.add_list_arguments, run.main_list),
        ("models", "describe the model zoo", None, run.main_models),
        ("bench", "per-case overhead: warm pool against spawning the ranks per case", bench.add_arguments, bench.main),
        ("nightly", "the nightly: full matrix, fuzz campaign, report and diff into one directory",
         nightly.add_arguments, nightly.main),
        ("history", "trend page over several nightly directories", history.add_arguments, history.main),
        ("certify", "conformance certificate of one engine: every behaviour family, Markdown/HTML/JSON",
         certify.add_arguments, certify.main),
        ("perf", "training-step benchmark: our engine against torch FSDP1 (and DDP, FSDP2)", perf.add_arguments, perf.main),
    ]
    for name, help_text, add_arguments, fn in commands:
        command = sub.add_parser(name, help=help_text)
        if add_arguments is not None:
            add_arguments(command)
        command.set_defaults(fn=fn)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.fn(args))
    except SelectionError as exc:
        parser.error(str(exc))  # exits with status 2
        raise  # unreachable: parser.error exits
