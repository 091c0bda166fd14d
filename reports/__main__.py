"""``python -m reports build RESULTS... --out DIR``, ``python -m reports diff OLD NEW`` and
``python -m reports history NIGHTLY_DIR... --out DIR``.

``build`` exits 2 when its inputs hold no readable record (and no ``--not-run`` list): an empty
report must not pass for a green one. ``history`` warns of unreadable lines in the newest night and
exits 1 when that night holds no readable record at all (its cases are unknown, never green).
``build`` and ``history`` write their report whole or not at all (``reports.api.staged``): a read-only or
full disk is one line and exit 2, Ctrl-C exit 130, and the directory is left as it was.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.cases.records import parse_not_run
from harness.collect.collector import out_path_problem
from harness.run.one_line_parser import OneLineParser, non_empty_path
from reports import api, render
from reports.diff import RATIO_FACTOR, RATIO_FLOOR
from reports.scope import PARTS_KEY


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="python -m reports", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    b = sub.add_parser("build", help="build a report directory from results files")
    b.add_argument("results", nargs="+", type=Path, help="results files (JSON Lines) or report directories")
    b.add_argument("--out", required=True, type=non_empty_path, help="report directory to write")
    b.add_argument("--cases", type=lambda t: [x.strip() for x in t.split(",") if x.strip()], default=[],
                   help="comma list of full ids (engine:reference:case_id) that get a case page even if they pass")
    b.add_argument("--not-run", type=Path, default=None,
                   help="file of selected cases that were not run (not_run.txt: '<full id>\\t<why>\\t<case config JSON>' "
                        "per line, harness.cases.records.NotRun); "
                        "default: not_run.txt/nightly.json next to the results")
    b.add_argument("--selected", type=int, default=None, help="how many cases the run selected (for the banner)")

    add_history_arguments(sub.add_parser("history", help="trend page over several nightly directories"))

    d = sub.add_parser("diff", help="compare two results; exits 1 on a regression")
    d.add_argument("old", type=Path, help="report directory or results file")
    d.add_argument("new", type=Path, help="report directory or results file")
    d.add_argument("--ratio-factor", type=float, default=RATIO_FACTOR,
                   help=f"a worst ratio grown more than this many times regresses (default {RATIO_FACTOR})")
    d.add_argument("--ratio-floor", type=float, default=RATIO_FLOOR,
                   help=f"... if it is now at least this (default {RATIO_FLOOR})")
    d.add_argument("--md", type=Path, help="also write the diff as Markdown here")
    d.add_argument("--json", type=Path, help="also write the diff as JSON here")
    return parser


def add_history_arguments(p: argparse.ArgumentParser) -> None:
    """``history``'s arguments (``python -m harness history`` has the same: its alias)."""
    p.add_argument("dirs", nargs="+", type=Path, help="nightly (or run) directories, ordered by name")
    p.add_argument("--out", required=True, type=non_empty_path, help="directory to write history.md/.html/.json and plots into")


def _out_problem(args: argparse.Namespace) -> str | None:
    """Why an output path of the command cannot be written (checked before anything is read), or None."""
    if args.command in ("build", "history") and args.out.exists() and not args.out.is_dir():
        return f"--out {args.out} is a file; the report is a directory: name a new or existing directory"
    for option in ("md", "json"):
        path = getattr(args, option, None)
        problem = out_path_problem(path) if path is not None else None
        if problem:
            return f"--{option}: {problem}"
    return None


def _left_as_it_was(args: argparse.Namespace) -> str:
    out = getattr(args, "out", None)  # diff writes no directory
    return f"; no report written, {out} is left as it was" if out is not None else ""


def main(argv: list[str] | None = None) -> int:
    return run(_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """The parsed command ``args.command`` with its arguments: what ``main`` runs, and the one
    implementation of ``python -m harness history`` (an alias) too."""
    problem = _out_problem(args)
    if problem:
        print(f"python -m reports {args.command}: {problem}", file=sys.stderr)
        return 2
    try:
        if args.command == "history":
            from reports.history import history

            result = history(args.dirs, args.out)
            print(f"{len(result.nights)} nights, {len(result.of_kind('regressed'))} regression(s), "
                  f"{len(result.of_kind('fixed'))} fix(es), {len(result.failing)} failing now -> {args.out}/: "
                  f"{', '.join(result.files)}")
            if result.newest_unreadable:
                print(f"warning: {result.newest_unreadable}", file=sys.stderr)
            # A newest night with no readable record says nothing of the cases: never a green exit.
            return 1 if result.newest_unknown else 0
        if args.command == "build":
            not_run = parse_not_run(args.not_run.read_text(encoding="utf-8")) if args.not_run else None
            if not not_run:
                loaded = api.load(args.results)
                if loaded.frame.empty:  # one line: a file that is no results file has thousands of lines
                    first = f", the first {loaded.bad_lines[0]}" if loaded.bad_lines else ""
                    print(f"python -m reports build: no readable record in {', '.join(map(str, args.results))} "
                          f"({len(loaded.bad_lines)} unreadable line(s){first}); nothing to report, no report written",
                          file=sys.stderr)
                    return 2
            summary = api.build(args.results, args.out, cases=args.cases, not_run=not_run, selected=args.selected)
            v = summary.verdicts
            pages = sum(f.endswith(".html") and f.startswith("cases/") for f in summary.files)
            shown = [f for f in summary.files if not f.startswith("cases/")]
            print(f"{summary.cases} cases ({', '.join(f'{k} {n}' for k, n in v.items() if n) or 'none'}) "
                  f"-> {args.out}/: {', '.join(shown)}, {pages} case page(s) in cases/")
            for bad in summary.bad_lines:
                print(f"warning: unreadable line {bad}", file=sys.stderr)
            for problem in (summary.scope or {}).get(PARTS_KEY) or []:
                print(f"warning: incomplete run: {problem}", file=sys.stderr)
            return 0
        result = api.diff(args.old, args.new, ratio_factor=args.ratio_factor, ratio_floor=args.ratio_floor)
    except (FileNotFoundError, ValueError) as e:
        print(f"python -m reports {args.command}: {e}", file=sys.stderr)
        return 2
    except OSError as exc:  # a read-only or full disk: the report is written whole or not at all (api.staged)
        print(f"python -m reports {args.command}: {exc.strerror or exc}: {exc.filename}{_left_as_it_was(args)}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"python -m reports {args.command}: interrupted{_left_as_it_was(args)}", file=sys.stderr)
        return 130
    text = render.diff_markdown(result, str(args.old), str(args.new))
    print(text, end="")
    try:
        if args.md:
            args.md.write_text(text, encoding="utf-8")
        if args.json:
            args.json.write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    except OSError as exc:  # a full disk, a directory that vanished: one line, not a traceback
        print(f"python -m reports diff: cannot write {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
