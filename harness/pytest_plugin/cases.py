"""The pure logic behind the generated pytest suites: which cases a suite runs, where its ranks
run, and what a case's record means to pytest.

``harness.pytest_plugin`` holds the options, hooks and fixtures; everything here is plain functions
over plain data, testable without processes (``suites/parity/test_parity_plugin_logic.py``).

[Note: suite slices and generators]
A generated suite runs a *slice* of the case matrix (``SuiteMatrix``): the axes it varies, with the
values it gives them; every other axis stays at its engine's baseline (the first value of the axis
the engine can run: FSDP2 has no ``use_orig_params=False`` and no ``backward_prefetch='none'``).
The *generator* (``--matrix``) decides how the slice is walked, per engine so that every engine sees every
pair: ``full`` is the product, ``pairwise`` a covering array (``harness.selection.matrix``), and ``smoke`` the
matrix's smoke variants (``harness.selection.matrix.SMOKE_VARIANTS``) seen through the slice: each variant keeps
only the values of the axes the suite varies, and is made valid for the engine by dropping as few of
them as needed. Smoke pins the axes of ``smoke_each`` to each of their values in turn (a wrap suite
shows every model), references and world sizes are pinned in turn by every generator (as ``harness run``
does).
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from harness.cases.case import CaseConfig, ReferenceName
from harness.cases.records import SEVERITY, CaseRecord
from harness.collect.expectations import ExpectedFailure, expected_failure
from harness.engines.registry import DEFAULT_ENGINES, fsdp1_engines
from harness.ranks.placement import DeviceChoice, Lane, PlacementError, place
from harness.run.options import SelectionOptions
from harness.selection.matrix import AXES, LOOP_AXES, SMOKE_VARIANTS, GeneratorName, generate

__all__ = [
    "Agreement",
    "BackendOption",
    "ParityOptions",
    "PoolPlan",
    "SuiteMatrix",
    "TestOutcome",
    "describe_failure",
    "engine_baseline",
    "outcome_of",
    "plan_pool",
    "verdict_table",
]

BackendOption = Literal["auto", "gloo", "nccl"]

#: Axes the run options own (``--engine``, ``--reference``, ``--world-size``), never a suite.
_OPTION_AXES = ("engine", "reference", "world_size")


# ---------------------------------------------------------------------------------------------------
# Options


@dataclass(frozen=True)
class ParityOptions:
    """What the command line asks of the generated suites (see ``harness.pytest_plugin``)."""

    #: engines under test (``--engine``): names or specs of ``harness.engines.registry``.
    engines: tuple[str, ...] = DEFAULT_ENGINES
    #: references each case is compared against, pinned in turn (``--reference``).
    references: tuple[str, ...] = get_args(ReferenceName)
    #: the lane: which generator walks each suite's slice (``--matrix``).
    matrix: GeneratorName = "smoke"
    #: ranks per case, one pool each (``--world-size``).
    world_sizes: tuple[int, ...] = (2,)
    #: ``auto``: as ``harness.ranks.placement.place`` decides (``--backend``).
    backend: BackendOption = "auto"
    #: ``auto``, ``cpu`` (gloo ranks on the CPU of a GPU host) or ``cuda`` (``--device``).
    device: DeviceChoice = "auto"
    #: seconds before a case is a timeout (``--case-timeout``).
    case_timeout_s: float = 300.0
    #: results file every generated case appends its record to; None records nothing (``--results``).
    results: str | None = None
    #: run only the generated suites that vary the training-loop axes (``--loop-axes``).
    loop_axes: bool = False

    @classmethod
    def parse(
        cls,
        engine: str | None,
        reference: str | None,
        matrix: str,
        world_size: str | None,
        backend: str,
        case_timeout: float | str | None,
        results: str | None,
        device: str = "auto",
        loop_axes: bool = False,
    ) -> "ParityOptions":
        """From the option strings (None: not given); ValueError names the bad option."""
        texts = {"engines": engine, "references": reference, "matrix": matrix, "world_sizes": world_size,
                 "backend": backend, "case_timeout_s": case_timeout, "device": device, "loop_axes": loop_axes}
        return cls.from_options(SelectionOptions.parse(texts), results)

    @classmethod
    def from_options(cls, options: SelectionOptions, results: str | None = None) -> "ParityOptions":
        """The suites' options from the options model every front end shares, checked as the command line
        checks them (``harness.run.runner.check_selection``: an unknown engine or reference names its option);
        what was not given is every engine, both references and two ranks."""
        from harness.run.runner import check_selection

        check_selection(options.selection(), options.world_sizes or ())
        return cls(
            engines=options.engines or DEFAULT_ENGINES,
            references=options.references or get_args(ReferenceName),
            matrix=options.matrix,  # type: ignore[arg-type]
            world_sizes=options.world_sizes or (2,),
            backend=options.backend,  # type: ignore[arg-type]
            device=options.device,  # type: ignore[arg-type]
            case_timeout_s=options.case_timeout_s,
            results=results,
            loop_axes=options.loop_axes,
        )

    @property
    def fsdp1_engines(self) -> tuple[str, ...]:
        """The requested engines that speak the FSDP1 API (the ported suites' ``fsdp_api``), as specs."""
        return fsdp1_engines(self.engines)


# ---------------------------------------------------------------------------------------------------
# Suite slices


def engine_baseline(engine: str) -> dict[str, Any]:
    """The baseline value of every axis for ``engine``: the first value of each axis, moved only where
    the engine cannot run it (FSDP2: original parameters, BACKWARD_PRE)."""
    return dict(_engine_baseline(engine))


@functools.lru_cache(maxsize=None)
def _engine_baseline(engine: str) -> tuple[tuple[str, Any], ...]:
    cases = generate("smoke", axes={"engine": [engine]})
    if not cases:
        raise ValueError(f"engine={engine!r}: no valid case at all; check harness.selection.matrix.RULES and its capability_rules")
    return tuple((axis, getattr(cases[0], axis)) for axis in AXES)


@dataclass(frozen=True)
class SuiteMatrix:
    """The slice of the case matrix one generated parity suite runs (see [Note: suite slices and generators])."""

    #: short name, for messages.
    name: str
    #: the axes this suite varies and their values (keys of ``harness.selection.matrix.AXES``, not engine,
    #: reference or world size, which the options own).
    axes: Mapping[str, Sequence[Any]]
    #: ``CaseConfig`` fields every case of the suite pins (e.g. ``steps``, ``extras``).
    fixed: Mapping[str, Any] = field(default_factory=dict)
    #: axes the smoke tier pins to each of their values in turn, so each value is seen (e.g. model).
    smoke_each: tuple[str, ...] = ()
    #: the smoke tier's variants before projection on ``axes``.
    smoke_variants: tuple[Mapping[str, Any], ...] = SMOKE_VARIANTS
    #: the widest generator the suite walks: ``pairwise`` for a slice whose full product would not fit the
    #: full tier (the full tier then walks it pairwise).
    widest: str = "full"
    #: the engines the suite runs whatever ``--engine`` names (the engine suites test the builtin engine
    #: only); empty: the ``--engine`` ones.
    engines: tuple[str, ...] = ()
    #: what engines are known to get wrong in this slice.
    expected_failures: tuple[ExpectedFailure, ...] = ()

    def expected_failure(self, case: CaseConfig, device_type: str) -> ExpectedFailure | None:
        """The first expected failure covering ``case`` on ranks of ``device_type``, if any."""
        return expected_failure(self.expected_failures, device_type, case=case)

    def __post_init__(self) -> None:
        owned = [a for a in [*self.axes, *self.fixed] if a in _OPTION_AXES]
        if owned:
            raise ValueError(
                f"SuiteMatrix {self.name!r}: {owned} are chosen by --engine/--reference/--world-size, not by a suite"
            )
        unknown = [a for a in self.axes if a not in AXES]
        if unknown:
            raise ValueError(f"SuiteMatrix {self.name!r}: unknown axes {unknown}; axes are {list(AXES)}")
        both = [a for a in self.fixed if a in self.axes]
        if both:
            raise ValueError(f"SuiteMatrix {self.name!r}: {both} both varied and fixed; give each once")
        stray = [a for a in self.smoke_each if a not in self.axes]
        if stray:
            raise ValueError(f"SuiteMatrix {self.name!r}: smoke_each {stray} must be axes the suite varies")

    @property
    def varies_loop_axes(self) -> bool:
        """Whether the suite varies a training-loop axis (``harness.selection.matrix.LOOP_AXES``): the suites
        ``--loop-axes`` keeps."""
        return any(a in self.axes for a in LOOP_AXES)

    def _pins(self, engine: str) -> dict[str, Any]:
        base = engine_baseline(engine)
        pins = {a: base[a] for a in AXES if a not in self.axes and a not in _OPTION_AXES}
        return {**pins, **self.fixed}

    def cases(self, options: ParityOptions) -> list[CaseConfig]:
        """The suite's cases for the options' lane, engines, references and world sizes, in a stable
        order (engine, then lane order), without duplicates."""
        from harness.run.runner import generate_cases

        found: dict[str, CaseConfig] = {}
        for engine in self.engines or options.engines:
            pins = self._pins(engine)
            if options.matrix == "smoke":
                cases = self._smoke(engine, pins, options)
            else:
                axes = {**{a: list(v) for a, v in self.axes.items()}, "engine": [engine]}
                matrix = "pairwise" if options.matrix == "full" and self.widest == "pairwise" else options.matrix
                cases = generate_cases(matrix, options.world_sizes, options.references, axes=axes, **pins)
            for case in cases:
                found.setdefault(case.full_id, case)
        return list(found.values())

    def _smoke(self, engine: str, pins: dict[str, Any], options: ParityOptions) -> list[CaseConfig]:
        out: list[CaseConfig] = []
        each = [[(a, v) for v in self.axes[a]] for a in self.smoke_each]
        for ws in options.world_sizes:
            for reference in options.references:
                for chosen in itertools.product(*each):
                    axes = {a: list(v) for a, v in self.axes.items()}
                    axes.update({a: [v] for a, v in chosen})
                    for variant in self.smoke_variants:
                        wanted = {k: v for k, v in variant.items() if k in axes and v in axes[k] and k not in dict(chosen)}
                        case = _closest_valid(axes, wanted, engine=engine, world_size=ws, reference=reference, **pins)
                        if case is not None:
                            out.append(case)
        return out


def _closest_valid(axes: dict[str, list[Any]], wanted: dict[str, Any], **pinned: Any) -> CaseConfig | None:
    """The first valid case (in product order) holding ``wanted``, dropping as few of its values as
    validity needs; None when not even the axes' own values can make a valid case."""
    keys = list(wanted)
    for n_dropped in range(len(keys) + 1):
        for dropped in itertools.combinations(keys, n_dropped):
            narrowed = {**axes, **{k: [v] for k, v in wanted.items() if k not in dropped}}
            cases = generate("full", axes=narrowed, **pinned)
            if cases:
                return cases[0]
    return None


# ---------------------------------------------------------------------------------------------------
# Where the ranks run


@dataclass(frozen=True)
class PoolPlan:
    """How one pool of a pytest worker runs (``harness.ranks.placement.place``'s lane), or why it cannot run here."""

    world_size: int
    #: where the pool runs; None when it cannot run here.
    lane: Lane | None
    #: set when no pool can run here: the skip reason of every case of this world size.
    skip_reason: str | None = None

    @property
    def backend(self) -> str | None:
        return self.lane.backend if self.lane is not None else None

    @property
    def devices(self) -> tuple[int, ...] | None:
        return self.lane.devices if self.lane is not None else None


def plan_pool(world_size: int, backend: BackendOption, n_gpus: int, worker: int = 0, n_workers: int = 1,
              device: DeviceChoice = "auto") -> PoolPlan:
    """The pool of ``world_size`` ranks for pytest-xdist worker ``worker`` of ``n_workers`` on a host with
    ``n_gpus`` visible GPUs: ``harness.ranks.placement.place``'s rule (NCCL with one GPU per rank, gloo with
    ranks sharing the GPUs, gloo on CPU). A placement that cannot run here (``--backend nccl`` on too few
    GPUs) skips every case of this world size with the reason, never moves it elsewhere.
    """
    if world_size < 1:
        raise ValueError(f"plan_pool: world_size={world_size} must be at least 1")
    if n_workers < 1 or not 0 <= worker < n_workers:
        raise ValueError(f"plan_pool: worker={worker} must be in [0, n_workers={n_workers})")
    try:
        return PoolPlan(world_size, place(world_size, n_gpus, backend, device, worker, n_workers))
    except PlacementError as exc:
        return PoolPlan(world_size, None, str(exc))


# ---------------------------------------------------------------------------------------------------
# Records to pytest outcomes


@dataclass(frozen=True)
class TestOutcome:
    """What pytest makes of one case's record."""

    __test__ = False  # not a test class, whatever pytest's collection thinks of the name

    action: Literal["pass", "skip", "fail"]
    message: str = ""


#: characters of a traceback, stack or stderr tail a failure message keeps.
DETAIL_CHARS = 3000
#: failing quantities a failure message lists.
WORST_SHOWN = 8


def _tail(text: str, limit: int = DETAIL_CHARS) -> str:
    text = text.rstrip()
    return text if len(text) <= limit else "...\n" + text[-limit:]


def describe_failure(record: CaseRecord) -> str:
    """A failing record as the lines a developer needs: verdict and reason, then the worst quantities
    and ignored knobs (fail), the first raising rank's traceback (error), the stuck ranks' stacks
    (timeout), or exit codes and stderr tails (crash)."""
    lines = [f"{record.verdict}: {record.reason}" if record.reason else record.verdict]
    detail = record.detail or {}
    if record.verdict == "fail":
        failing = sorted((e for e in record.errors if not e.passed), key=lambda e: -e.ratio)
        where = detail.get("worst_at", {})
        for e in failing[:WORST_SHOWN]:
            at = where.get(e.name, {})
            place = ", ".join(f"{k} {at[k]}" for k in ("step", "rank") if at.get(k) is not None)
            ratio = "inf" if math.isinf(e.ratio) else f"{e.ratio:.3g}"
            lines.append(
                f"  {e.name}: max_abs {e.max_abs:.3g} max_rel {e.max_rel:.3g} (atol {e.atol:.3g}, rtol {e.rtol:.3g}, "
                f"ratio {ratio}){' at ' + place if place else ''}"
            )
        if len(failing) > WORST_SHOWN:
            lines.append(f"  ... {len(failing) - WORST_SHOWN} more failing quantities")
        for knob in detail.get("knobs", []):
            if knob.get("status") == "ignored":
                lines.append(f"  knob {knob.get('knob')} ignored: {knob.get('reason', '')}")
    elif record.verdict == "error":
        tracebacks = detail.get("tracebacks", {})
        if tracebacks:
            rank = min(tracebacks, key=int)
            lines.append(f"--- rank {rank} traceback ---\n{_tail(tracebacks[rank])}")
        for rank, stack in sorted(detail.get("stacks", {}).items()):
            lines.append(f"--- rank {rank} stack (stuck) ---\n{_tail(stack)}")
    elif record.verdict == "timeout":
        for rank, stack in sorted(detail.get("stacks", {}).items()):
            lines.append(f"--- rank {rank} stack ---\n{_tail(stack)}")
    elif record.verdict == "crash":
        for rank, code in sorted(detail.get("exit_codes", {}).items()):
            lines.append(f"  rank {rank} exit code {code}")
        for rank, tail in sorted(detail.get("stderr_tails", {}).items()):
            lines.append(f"--- rank {rank} stderr ---\n{_tail(tail)}")
    return "\n".join(lines)


def outcome_of(record: CaseRecord) -> TestOutcome:
    """pass -> pass; unsupported -> skip with the engine's reason; fail, error, timeout, crash -> fail."""
    if record.verdict == "pass":
        return TestOutcome("pass")
    if record.verdict == "unsupported":
        return TestOutcome("skip", f"unsupported: {record.reason}" if record.reason else "unsupported")
    return TestOutcome("fail", describe_failure(record))


#: pytest's outcome of a test as the verdict it stands for, so both rank on one scale (``SEVERITY``).
_VERDICT_OF_OUTCOME = {"passed": "pass", "skipped": "unsupported", "failed": "fail"}
#: outcomes that mean "did not run here": a difference in them is a capability, not a disagreement.
NOT_RUN = ("skipped", "unsupported")


def _severity(outcome: str) -> int:
    """``SEVERITY`` (worst first) of a verdict or a pytest outcome; anything else counts as an error."""
    return SEVERITY.get(_VERDICT_OF_OUTCOME.get(outcome, outcome), SEVERITY["error"])


@dataclass
class Agreement:
    """The outcome of the same check (or case) on each engine, and where the engines part ways.

    A *disagreement* is a check that ran on two engines with different outcomes (one passes, the
    other fails); a check that ran on one engine only (skipped or unsupported on another) is listed
    apart, as a difference in capability.
    """

    #: check key (its test id without the engine) -> engine -> worst outcome of its phases.
    outcomes: dict[str, dict[str, str]] = field(default_factory=dict)

    def add(self, key: str, engine: str, outcome: str) -> None:
        seen = self.outcomes.setdefault(key, {})
        if engine not in seen or _severity(outcome) < _severity(seen[engine]):
            seen[engine] = outcome

    def engines(self) -> list[str]:
        return sorted({e for per in self.outcomes.values() for e in per})

    def compared(self) -> dict[str, dict[str, str]]:
        """The checks seen on more than one engine."""
        return {k: v for k, v in self.outcomes.items() if len(v) > 1}

    def disagreements(self) -> dict[str, dict[str, str]]:
        return {k: v for k, v in self.compared().items() if len({o for o in v.values() if o not in NOT_RUN}) > 1}

    def one_engine_only(self) -> dict[str, dict[str, str]]:
        return {
            k: v for k, v in self.compared().items()
            if k not in self.disagreements() and len(set(v.values())) > 1 and any(o in NOT_RUN for o in v.values())
        }

    def render(self, what: str, shown: int = 20) -> str:
        """A few lines for the terminal: how many checks agree, then every disagreement and the first
        ``shown`` checks that ran on one engine only."""
        from tabulate import tabulate

        compared, differ, one = self.compared(), self.disagreements(), self.one_engine_only()
        engines = self.engines()
        lines = [
            f"{what} on {', '.join(engines)}: {len(compared)} compared, {len(compared) - len(differ) - len(one)} agree, "
            f"{len(differ)} disagree, {len(one)} ran on one engine only"
        ]
        for title, rows in (("disagree", differ), ("ran on one engine only", one)):
            if not rows:
                continue
            keys = sorted(rows)
            table = [[k, *(rows[k].get(e, "-") for e in engines)] for k in keys[:shown]]
            lines.append(f"{title}:")
            lines.append(tabulate(table, headers=[what, *engines]))
            if len(keys) > shown:
                lines.append(f"... and {len(keys) - shown} more")
        return "\n".join(lines)


def verdict_table(counts: Mapping[str, int], wall_s: float, matrix: str) -> str:
    """The terminal summary of the generated cases: counts per verdict and their summed wall time."""
    from tabulate import tabulate

    rows = [(verdict, n) for verdict, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    total = sum(counts.values())
    return (
        f"{tabulate(rows, headers=('verdict', 'cases'))}\n"
        f"{total} generated parity cases (--matrix {matrix}), {wall_s:.1f} s of case wall time"
    )
