"""Command-line options shared by the front ends: the case selection (``harness.runner.Selection``),
how the cases run (lanes, repeats), and the value types that refuse a bad number where argparse reads
it (naming the option)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable, Sequence

from harness.one_line_parser import non_empty, non_empty_path
from harness.placement import OPTION_HELP

__all__ = ["MAX_SECONDS", "add_execution", "budget_seconds", "add_placement", "add_selection", "csv_list", "given_options",
           "non_empty", "non_empty_path", "non_negative_int", "positive_float", "positive_int", "world_sizes"]

#: the longest time an option of seconds may name (a week): a larger one (``1e300``) overflows the
#: deadlines computed from it, so every case would end "not run".
MAX_SECONDS = 7 * 24 * 3600.0


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


def csv_list(text: str) -> list[str]:
    """A comma-separated option value as a list, blanks dropped; a value naming nothing is refused
    (an empty ``--engines ""`` must not mean every engine)."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"must name at least one value, got {text!r}")
    return parts


def _int_at_least(text: str, low: int, words: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a {words} integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be a {words} integer, got {value}")
    return value


def positive_int(text: str) -> int:
    """An option value that must be an integer of at least 1 (argparse names the option)."""
    return _int_at_least(text, 1, "positive")


def _seconds(text: str, zero_ok: bool) -> float:
    words = f"a {'non-negative' if zero_ok else 'positive'} number of seconds, at most {MAX_SECONDS:.0f} (a week)"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {words}, got {text!r}") from None
    if not (0 <= value if zero_ok else 0 < value) or not value <= MAX_SECONDS:  # nan fails both
        raise argparse.ArgumentTypeError(f"must be {words}, got {text}")
    return value


def positive_float(text: str) -> float:
    """An option value that must be a number of seconds above 0 and at most ``MAX_SECONDS`` (nan and
    inf refused; argparse names the option)."""
    return _seconds(text, zero_ok=False)


def budget_seconds(text: str) -> float:
    """A time budget: like ``positive_float``, but 0 is a budget spent before anything starts."""
    return _seconds(text, zero_ok=True)


def world_sizes(text: str) -> list[int]:
    """``--world-size 2,4``: positive integers, a repeated one kept once (running it twice would
    record every case twice)."""
    sizes = [positive_int(part) for part in csv_list(text)]
    if not sizes:
        raise argparse.ArgumentTypeError(f"must name at least one world size, got {text!r}")
    return list(dict.fromkeys(sizes))


def add_selection(p: argparse.ArgumentParser) -> None:
    """The options ``harness.runner.Selection.from_args`` reads, plus ``--world-size``."""
    p.add_argument("--matrix", default="smoke", choices=("smoke", "pairwise", "full"), help="case generator (harness.matrix)")
    p.add_argument("--engines", type=csv_list, default=None, help="comma list of engine names or specs: builtin,torch-fsdp,torch-fsdp2 (default: these), "
                        "an entry point of fsdp_parity.engines, NAME=fsdp1:MODULE, NAME=fsdp2:MODULE, NAME=MODULE:OBJECT")
    p.add_argument("--references", type=csv_list, default=None, help="comma list: ddp,local (default: the matrix's)")
    p.add_argument("--models", type=csv_list, default=None, help="comma list of harness.models.MODELS (default: the matrix's)")
    p.add_argument("--world-size", type=world_sizes, default=None,
                   help="ranks per case, comma list for several pools, repeats kept once (default 2; under torchrun its WORLD_SIZE)")
    p.add_argument("--optimizers", type=csv_list, default=None,
                   help="comma list: sgd,adamw,adamw_groups,two_optimizers (default: sgd)")
    p.add_argument("--clip-grad", type=csv_list, default=None, help="comma list: none,norm (default: none)")
    p.add_argument("--grad-accum", type=csv_list, default=None,
                   help="comma list: none,no_sync,sync: micro-batches per step, skipping synchronization or not (default: none)")
    p.add_argument("--activation-checkpointing", type=csv_list, default=None,
                   help="comma list: none,non_reentrant,reentrant (default: none)")
    p.add_argument("--compile", type=csv_list, default=None,
                   help="comma list: none,compiled: torch.compile, aot_eager on CPU and inductor on GPUs (default: none)")
    p.add_argument("--loop-axes", action="store_true",
                   help="widen every training-loop axis and the optimizers to all their values (harness.matrix.LOOP_SLICE)")
    p.add_argument("--checkpoints", type=csv_list, default=None,
                   help="comma list: none,full,sharded,local: save half-way and resume (default: none)")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps per case (default: CaseConfig's 5)")
    p.add_argument("--check-determinism", action="store_true", help="run each engine twice and require bitwise-equal results")
    p.add_argument("--stress", action="store_true",
                   help="delay the CUDA compute stream where a missing stream wait would show (harness.stress); "
                        "cases get the id segment stress_delay and are unsupported on CPU")
    p.add_argument("--filter", action="append", type=non_empty, default=[], help="keep cases whose full id contains this (repeatable: any of them; a+b: both a and b)")
    p.add_argument("--limit", type=positive_int, default=None, help="run at most this many cases")


def non_negative_int(text: str) -> int:
    """An option value that must be an integer of at least 0 (argparse names the option)."""
    return _int_at_least(text, 0, "non-negative")


def add_execution(p: argparse.ArgumentParser) -> None:
    """How the selected cases run: pools side by side and repeats (``harness.runner.CaseRunner``)."""
    p.add_argument("--pools-per-gpu", "--lanes", dest="pools_per_gpu", type=positive_int, default=None,
                   help="rank pools side by side on each group of GPUs (on CPU: pools in all); default: "
                        "chosen from the GPU memory and the cores (harness.placement.pools_per_group)")
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="run every case N times; runs that disagree make the case flaky (never a pass)")
    p.add_argument("--repeat-failures", type=non_negative_int, default=0,
                   help="run a case that did not pass N more times (fail in every run stays fail, else flaky)")


def add_placement(p: argparse.ArgumentParser) -> None:
    """``--backend`` and ``--device``: where the ranks run, as ``harness.placement.place`` decides."""
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"), help=OPTION_HELP["backend"])
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help=OPTION_HELP["device"])
