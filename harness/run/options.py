"""The options that select cases and place their ranks: one model for every front end.

``SelectionOptions`` is a frozen dataclass whose every field is one option: its flag, the older spellings
it still accepts (``aliases``), how its text is read (``OptionSpec.parse``), its help, and the front ends
that offer it. The command line (``harness.cli.options``) and the pytest plugin (``harness.pytest_plugin``)
register their options from these fields, so an option has one name, one check and one error message
wherever it is given; ``SelectionOptions.selection`` turns it into the ``harness.run.runner.Selection`` the
library runs (and ``harness.run.stored_selection`` stores).

Renamed options keep their old spellings: ``--engines`` (also ``--engine``), ``--references`` (also
``--reference``), ``--case-timeout`` (also ``--timeout``, on the command line only: pytest-timeout owns
pytest's ``--timeout``). An alias is registered as an option of its own with the same destination, so
that an error names the option as it was typed.

Nothing here reads an argparse namespace: a front end hands the values it parsed to the dataclass.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from harness.ranks.placement import OPTION_HELP

if TYPE_CHECKING:
    from harness.run.runner import Selection

__all__ = [
    "MAX_SECONDS",
    "OptionSpec",
    "OptionValueError",
    "SelectionOptions",
    "as_typed",
    "budget_seconds",
    "csv_values",
    "non_negative_int",
    "option_specs",
    "positive_int",
    "positive_seconds",
    "world_size_list",
]

#: the longest time an option of seconds may name (a week): a larger one (``1e300``) overflows the
#: deadlines computed from it, so every case would end "not run".
MAX_SECONDS = 7 * 24 * 3600.0

Front = Literal["cli", "pytest"]


class OptionValueError(ValueError):
    """A value an option cannot take. The message says what the value must be; the front end names the
    option (argparse as ``argument --flag: ...``, ``SelectionOptions.parse`` as ``--flag: ...``)."""


# ---------------------------------------------------------------------------------------------------
# Value types: text -> value, or OptionValueError saying what to give instead


def csv_values(text: str) -> tuple[str, ...]:
    """A comma-separated list, blanks dropped. A list naming nothing is refused (an empty ``--engines ""``
    must not mean every engine), and so is a value named twice (a typo, or a list pasted twice)."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    if not parts:
        raise OptionValueError(f"must name at least one value, got {text!r}")
    repeated = sorted({p for p in parts if parts.count(p) > 1})
    if repeated:
        raise OptionValueError(f"names {', '.join(repeated)} more than once, got {text!r}; name each value once")
    return tuple(parts)


def _int_at_least(text: str, low: int, words: str) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise OptionValueError(f"must be a {words} integer, got {text!r}") from None
    if value < low:
        raise OptionValueError(f"must be a {words} integer, got {value}")
    return value


def positive_int(text: str) -> int:
    """An integer of at least 1."""
    return _int_at_least(text, 1, "positive")


def non_negative_int(text: str) -> int:
    """An integer of at least 0."""
    return _int_at_least(text, 0, "non-negative")


def world_size_list(text: str) -> tuple[int, ...]:
    """``2,4``: positive integers; a repeated one is kept once (running it twice would record every case
    twice, and ``2,2`` means what ``2`` does, so unlike a repeated name it is no typo to refuse)."""
    parts = [part.strip() for part in str(text).split(",") if part.strip()]
    if not parts:
        raise OptionValueError(f"must name at least one world size, got {text!r}")
    return tuple(dict.fromkeys(positive_int(part) for part in parts))


def _seconds(text: str | float, zero_ok: bool) -> float:
    words = f"a {'non-negative' if zero_ok else 'positive'} number of seconds, at most {MAX_SECONDS:.0f} (a week)"
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise OptionValueError(f"must be {words}, got {text!r}") from None
    if not (0 <= value if zero_ok else 0 < value) or not value <= MAX_SECONDS:  # nan fails both
        raise OptionValueError(f"must be {words}, got {text}")
    return value


def positive_seconds(text: str | float) -> float:
    """Seconds above 0 and at most ``MAX_SECONDS`` (nan and inf refused)."""
    return _seconds(text, zero_ok=False)


def budget_seconds(text: str | float) -> float:
    """A time budget: like ``positive_seconds``, but 0 is a budget spent before anything starts."""
    return _seconds(text, zero_ok=True)


def non_empty_text(text: str) -> str:
    """A value that must not be blank (an empty ``--filter ""`` would match every case)."""
    if not str(text).strip():
        raise OptionValueError(f"must not be empty, got {text!r}")
    return str(text)


# ---------------------------------------------------------------------------------------------------
# The options


@dataclass(frozen=True)
class OptionSpec:
    """How one ``SelectionOptions`` field is given on a command line."""

    #: the dataclass field, and the destination every front end parses the option into.
    field: str
    #: the option's name.
    flag: str
    help: str
    #: ``value`` (one text), ``flag`` (present or not), ``append`` (repeatable, every text kept).
    kind: Literal["value", "flag", "append"] = "value"
    #: text -> value; None for a flag.
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    #: older spellings still accepted, each registered as an option of its own (see the module docstring).
    aliases: tuple[str, ...] = ()
    #: the front ends that offer it: the pytest plugin only what a generated suite can use.
    fronts: frozenset[str] = frozenset({"cli"})
    #: the pytest plugin's help where the option does something else there (``--loop-axes`` deselects).
    pytest_help: str | None = None

    @property
    def metavar(self) -> str | None:
        """``WORLD_SIZE`` for ``--world-size`` (argparse would say the field's ``WORLD_SIZES``); None with choices."""
        return None if self.choices is not None or self.kind == "flag" else self.flag.lstrip("-").replace("-", "_").upper()

    def aliases_for(self, front: Front) -> tuple[str, ...]:
        # pytest-timeout registers pytest's own ``--timeout``: the plugin must not claim it.
        return tuple(a for a in self.aliases if not (front == "pytest" and a == "--timeout"))

    def help_for(self, front: Front) -> str:
        text = self.pytest_help if front == "pytest" and self.pytest_help else self.help
        aliases = self.aliases_for(front)
        return text + (f" (also {', '.join(aliases)})" if aliases else "")

    def read(self, text: Any) -> Any:
        """``text`` as this option's value; ValueError naming the option when it cannot be."""
        if self.kind == "flag":
            return bool(text)
        if self.kind == "append":
            return tuple(self._one(t) for t in text or ())
        return self._one(text)

    def _one(self, text: Any) -> Any:
        if self.choices is not None and text not in self.choices:
            raise ValueError(f"{self.flag}: {text!r} is not one of {list(self.choices)}")
        try:
            return self.parse(text) if self.parse is not None else text
        except OptionValueError as exc:
            raise OptionValueError(f"{self.flag}: {exc}") from None


def _option(flag: str, help: str, default: Any = None, *, pytest: bool = False, **spec: Any) -> Any:
    """A ``SelectionOptions`` field that is an option (its ``OptionSpec`` in the field's metadata)."""
    fronts = frozenset({"cli", "pytest"} if pytest else {"cli"})
    return field(default=default, metadata={"option": dict(flag=flag, help=help, fronts=fronts, **spec)})


_LIST = dict(parse=csv_values)
_GENERATORS = ("smoke", "pairwise", "full")


@dataclass(frozen=True)
class SelectionOptions:
    """Which cases of the matrix to run and where their ranks run, as the options give them. None: the
    option was not given (the matrix's values; a front end's own default, ``ParityOptions``'s for pytest)."""

    matrix: str = _option("--matrix", "case generator (harness.selection.matrix)", "smoke", pytest=True, choices=_GENERATORS,
                          pytest_help="lane: how each generated suite walks its slice of the case matrix (default: smoke)")
    engines: tuple[str, ...] | None = _option(
        "--engines", "comma list of engine names or specs: builtin,torch-fsdp,torch-fsdp2 (default: these), an entry "
        "point of fsdp_parity.engines, NAME=fsdp1:MODULE, NAME=fsdp2:MODULE, NAME=MODULE:OBJECT", pytest=True,
        aliases=("--engine",), **_LIST,
        pytest_help="comma list of engines under test: registered names or specs NAME=fsdp1:MODULE, NAME=fsdp2:MODULE, "
                    "NAME=MODULE:OBJECT (harness.engines.registry; default: builtin,torch-fsdp,torch-fsdp2); the ported suites "
                    "run the ones with torch FSDP1's API")
    references: tuple[str, ...] | None = _option(
        "--references", "comma list: ddp,local (default: the matrix's)", pytest=True, aliases=("--reference",), **_LIST,
        pytest_help="comma list of references: ddp,local (default: both)")
    models: tuple[str, ...] | None = _option("--models", "comma list of harness.cases.models.MODELS (default: the matrix's)", **_LIST)
    world_sizes: tuple[int, ...] | None = _option(
        "--world-size", "ranks per case, comma list for several pools, repeats kept once (default 2; under torchrun "
        "its WORLD_SIZE)", pytest=True, parse=world_size_list,
        pytest_help="ranks per case, comma list for several, repeats kept once (default 2); cases needing more GPUs "
                    "than this process has are skipped with the reason")
    optimizers: tuple[str, ...] | None = _option(
        "--optimizers", "comma list: sgd,adamw,adamw_groups,two_optimizers (default: sgd)", **_LIST)
    clip_grad: tuple[str, ...] | None = _option("--clip-grad", "comma list: none,norm (default: none)", **_LIST)
    grad_accum: tuple[str, ...] | None = _option(
        "--grad-accum", "comma list: none,no_sync,sync: micro-batches per step, skipping synchronization or not "
        "(default: none)", **_LIST)
    activation_checkpointing: tuple[str, ...] | None = _option(
        "--activation-checkpointing", "comma list: none,non_reentrant,reentrant (default: none)", **_LIST)
    compile: tuple[str, ...] | None = _option(
        "--compile", "comma list: none,compiled: torch.compile, aot_eager on CPU and inductor on GPUs (default: none)",
        **_LIST)
    loop_axes: bool = _option(
        "--loop-axes", "widen every training-loop axis and the optimizers to all their values (harness.selection.matrix.LOOP_SLICE)",
        False, pytest=True, kind="flag",
        pytest_help="run only the generated suites that vary the training-loop axes (harness.selection.matrix.LOOP_SLICE: "
                    "optimizers, clip_grad, grad_accum, activation_checkpointing, compile); the other generated cases "
                    "are deselected")
    checkpoints: tuple[str, ...] | None = _option(
        "--checkpoints", "comma list: none,full,sharded,local: save half-way and resume (default: none)", **_LIST)
    steps: int | None = _option("--steps", "training steps per case (default: CaseConfig's 5)", parse=positive_int)
    check_determinism: bool = _option("--check-determinism", "run each engine twice and require bitwise-equal results",
                                      False, kind="flag")
    stress: bool = _option(
        "--stress", "delay the CUDA compute stream where a missing stream wait would show (harness.compare.stress); cases get "
        "the id segment stress_delay and are unsupported on CPU", False, kind="flag")
    filters: tuple[str, ...] = _option(
        "--filter", "keep cases whose full id contains this (repeatable: any of them; a+b: both a and b)", (),
        kind="append", parse=non_empty_text)
    limit: int | None = _option("--limit", "run at most this many cases", parse=positive_int)
    backend: str = _option("--backend", OPTION_HELP["backend"], "auto", pytest=True, choices=("auto", "gloo", "nccl"))
    device: str = _option("--device", OPTION_HELP["device"], "auto", pytest=True, choices=("auto", "cpu", "cuda"))
    case_timeout_s: float = _option("--case-timeout", "seconds per case before it is a timeout", 300.0, pytest=True,
                                    parse=positive_seconds, aliases=("--timeout",))

    def __post_init__(self) -> None:
        # Lists given as lists (a caller's, argparse's ``append``) are kept as tuples: the options are frozen.
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, list):
                object.__setattr__(self, f.name, tuple(value))

    @classmethod
    def parse(cls, texts: Mapping[str, Any], front: Front = "pytest") -> "SelectionOptions":
        """From option texts by field (a field left out or None keeps its default): every text read by its
        option's ``OptionSpec``; ValueError names the option. What the pytest plugin does with its option
        strings; argparse reads the command line's with the same specs (``harness.cli.options``)."""
        specs = {s.field: s for s in option_specs(front)}
        unknown = sorted(set(texts) - set(specs))
        if unknown:
            raise TypeError(f"SelectionOptions.parse: {unknown} are no options of {front}")
        return cls(**{name: specs[name].read(text) for name, text in texts.items() if text is not None})

    def selection(self) -> "Selection":
        """The case selection these options name (``--loop-axes`` widened into the loop axes)."""
        from harness.run.runner import LOOP_OPTION_AXES, Selection
        from harness.selection.matrix import LOOP_SLICE

        # ``--loop-axes`` first (every value of each loop axis), then each axis's own option.
        loop = {a: list(LOOP_SLICE[a]) for a in LOOP_OPTION_AXES} if self.loop_axes else {}
        loop.update({a: list(v) for a in LOOP_OPTION_AXES if (v := getattr(self, a))})
        optimizers = self.optimizers or (tuple(LOOP_SLICE["optimizer"]) if self.loop_axes else None)
        as_list = lambda v: list(v) if v is not None else None  # noqa: E731 - Selection stores lists
        return Selection(
            matrix=self.matrix, engines=as_list(self.engines), references=as_list(self.references),
            models=as_list(self.models), steps=self.steps, optimizers=as_list(optimizers),
            checkpoints=as_list(self.checkpoints), loop_axes=loop, check_determinism=self.check_determinism,
            stress="delay" if self.stress else "none", filters=list(self.filters), limit=self.limit,
        )


def option_specs(front: Front = "cli", fields: Iterable[str] | None = None) -> list[OptionSpec]:
    """The ``OptionSpec`` of every option ``front`` offers (of ``fields`` only, in that order, when given)."""
    by_field = {}
    for f in dataclasses.fields(SelectionOptions):
        by_field[f.name] = OptionSpec(field=f.name, **f.metadata["option"])
    names = list(by_field) if fields is None else list(fields)
    return [by_field[n] for n in names if front in by_field[n].fronts]


def as_typed(message: str, argv: Sequence[str], front: Front = "cli") -> str:
    """``message`` (an error led by an option's name, ``--engines: ...``) with that option named as ``argv``
    spelled it: who typed ``--engine`` reads ``--engine: ...``. Checks made after parsing (an engine that
    does not import, ``harness.run.runner.check_selection``) know only the option's name, not the spelling."""
    for spec in option_specs(front):
        if not message.startswith((spec.flag + ":", spec.flag + " ")):
            continue
        spellings = (spec.flag, *spec.aliases_for(front))
        typed = [word.partition("=")[0] for word in argv if word.partition("=")[0] in spellings]
        return (typed[-1] if typed else spec.flag) + message[len(spec.flag):]
    return message
