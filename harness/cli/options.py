"""Command-line options shared by the front ends: the case selection and placement, registered from the
one options model (``harness.run.options.SelectionOptions``, which the pytest plugin registers its options from
too), how the cases run (lanes, repeats), and the value types that refuse a bad number where argparse reads
it (naming the option).

The one place an argparse namespace becomes the library's options: ``selection_options``.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from harness.ranks.mps import MPS_CHOICES, MPS_HELP
from harness.run import options as model
from harness.run.one_line_parser import non_empty, non_empty_path
from harness.run.options import MAX_SECONDS, OptionSpec, OptionValueError, SelectionOptions, option_specs

__all__ = ["MAX_SECONDS", "add_case_timeout", "add_execution", "budget_seconds", "add_placement", "add_selection",
           "csv_list", "given_options", "non_empty", "non_empty_path", "non_negative_int", "positive_float",
           "positive_int", "selection_options", "world_sizes"]


class _Unset(list):  # type: ignore[type-arg]
    """A default no command line set: a list, so that argparse's ``append`` can copy it."""


def given_options(add_arguments: Callable[[argparse.ArgumentParser], None], argv: Sequence[str],
                  dests: Iterable[str]) -> frozenset[str]:
    """The ``dests`` that ``argv`` (the command's own arguments) sets: a default is not a choice a user
    made. Parsed again over a namespace of markers, which argparse leaves where no option sets them."""
    probe = argparse.ArgumentParser(add_help=False)
    add_arguments(probe)
    marks = {dest: _Unset() for dest in dests}
    namespace = argparse.Namespace(**marks)
    probe.parse_known_args(list(argv), namespace)
    return frozenset(d for d, mark in marks.items() if getattr(namespace, d) is not mark)


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` as argparse's ``type``: its ``OptionValueError`` becomes the error argparse prints after
    the option's name (a plain ValueError would read "invalid value"), and a tuple a list, as the commands'
    namespaces have always held (``SelectionOptions`` freezes it)."""
    def read(text: str) -> Any:
        try:
            value = parse(text)
        except OptionValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return list(value) if isinstance(value, tuple) else value

    read.__name__ = parse.__name__
    return read


#: the library's value types as argparse types, under the names the commands import.
csv_list = _argparse_type(model.csv_values)
positive_int = _argparse_type(model.positive_int)
non_negative_int = _argparse_type(model.non_negative_int)
positive_float = _argparse_type(model.positive_seconds)
budget_seconds = _argparse_type(model.budget_seconds)
world_sizes = _argparse_type(model.world_size_list)


def _add_option(p: argparse.ArgumentParser, spec: OptionSpec, default: Any) -> None:
    """One option of the model, and each alias as an option of its own into the same destination: an
    error then names the spelling that was typed (``argument --timeout: ...``), not both."""
    kw: dict[str, Any] = {"dest": spec.field}
    if spec.kind == "flag":
        kw["action"] = "store_true"
    else:
        kw["metavar"] = spec.metavar
        kw["type"] = _argparse_type(spec.parse) if spec.parse is not None else None
        kw["choices"] = spec.choices
        if spec.kind == "append":
            kw["action"] = "append"
            default = list(default)  # argparse's ``append`` copies the default and appends to it
    p.add_argument(spec.flag, default=default, help=spec.help_for("cli"), **kw)
    for alias in spec.aliases_for("cli"):
        p.add_argument(alias, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)


def _add_fields(p: argparse.ArgumentParser, fields: Iterable[str]) -> None:
    defaults = {f.name: f.default for f in dataclasses.fields(SelectionOptions)}
    for spec in option_specs("cli", fields):
        _add_option(p, spec, defaults[spec.field])


#: the selection options in the order ``--help`` lists them.
SELECTION_FIELDS = ("matrix", "engines", "references", "models", "world_sizes", "optimizers", "clip_grad", "grad_accum",
                    "activation_checkpointing", "compile", "loop_axes", "checkpoints", "steps", "check_determinism",
                    "stress", "filters", "limit")


def selection_options(args: argparse.Namespace) -> SelectionOptions:
    """The options model of a parsed command line: every ``SelectionOptions`` field its command registered
    (the others keep their defaults). The library takes this, never the namespace."""
    given = vars(args)
    return SelectionOptions(**{f.name: given[f.name] for f in dataclasses.fields(SelectionOptions) if f.name in given})


def add_selection(p: argparse.ArgumentParser) -> None:
    """The selection options (``SELECTION_FIELDS`` of ``harness.run.options.SelectionOptions``)."""
    _add_fields(p, SELECTION_FIELDS)


def add_case_timeout(p: argparse.ArgumentParser) -> None:
    """``--case-timeout`` (also ``--timeout``): seconds per case before it is a timeout."""
    _add_fields(p, ["case_timeout_s"])


def add_execution(p: argparse.ArgumentParser) -> None:
    """How the selected cases run: pools side by side and repeats (``harness.run.runner.CaseRunner``)."""
    p.add_argument("--pools-per-gpu", "--lanes", dest="pools_per_gpu", type=positive_int, default=None,
                   help="rank pools side by side on each group of GPUs (on CPU: pools in all); default: "
                        "chosen from the GPU memory and the cores (harness.ranks.placement.pools_per_group)")
    p.add_argument("--mps", choices=MPS_CHOICES, default="auto", help=MPS_HELP + " (default: auto)")
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="run every case N times; runs that disagree make the case flaky (never a pass)")
    p.add_argument("--repeat-failures", type=non_negative_int, default=0,
                   help="run a case that did not pass N more times (fail in every run stays fail, else flaky)")


def add_placement(p: argparse.ArgumentParser) -> None:
    """``--backend`` and ``--device``: where the ranks run, as ``harness.ranks.placement.place`` decides."""
    _add_fields(p, ["backend", "device"])
