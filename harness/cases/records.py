"""The result record: what one case produced, as the collector writes it and reports read it.

One record is one JSON object on one line of a results file (JSON Lines). The schema is plain
data so the report builder never needs torch or the harness's runtime.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, get_args

if TYPE_CHECKING:
    from harness.cases.case import CaseConfig

#: ``flaky``: the runs of a repeated case disagreed (``CaseRecord.outcomes`` counts each); never a pass.
Verdict = Literal["pass", "fail", "unsupported", "error", "timeout", "crash", "flaky"]
VERDICTS: tuple[str, ...] = get_args(Verdict)
#: The verdicts of a case that ran but did not finish cleanly.
ERRORED: tuple[str, ...] = ("error", "timeout", "crash")
#: The verdicts of a case that never finished (it hung or its ranks died): ``reports diff`` calls a new one
#: a regression on sight.
ABORTED: tuple[str, ...] = ("timeout", "crash")
#: The failing verdicts (``unsupported`` is neither failing nor passing): any of them makes ``harness run``
#: and ``nightly`` exit 1, ``--rerun-failed`` reruns them, reports count them as failing. A flaky case
#: failed at least once (``harness.run.repeats``).
FAILING: tuple[str, ...] = ("fail", *ERRORED, "flaky")
#: How bad a verdict is, worst first: orders failing cases, picks a cell's status, keeps the worst of a
#: test's phases. A flaky case failed in some of its runs: as bad as a failure.
SEVERITY: dict[str, int] = {"crash": 0, "timeout": 1, "error": 2, "fail": 3, "flaky": 3, "unsupported": 4, "pass": 5}

#: bump when a field changes meaning; readers refuse newer majors.
SCHEMA_VERSION = 1

#: How a record writes a float JSON has no number for (strict JSON: ``json.dumps(allow_nan=False)``),
#: and reads it back; records written before it hold bare ``NaN``/``Infinity``, which ``json.loads`` reads.
NON_FINITE: dict[str, float] = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def json_safe(value: Any) -> Any:
    """``value`` (plain data) with every non-finite float as its ``NON_FINITE`` name: strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def as_float(value: Any) -> Any:
    """A number field read back: a ``NON_FINITE`` name as its float, a list of them element by element."""
    if isinstance(value, str):
        return NON_FINITE.get(value, value)
    if isinstance(value, list):
        return [as_float(v) for v in value]
    return value


@dataclass
class QuantityError:
    """The worst disagreement of one compared quantity (e.g. ``loss``, ``grad:0.weight``, ``param:*``)."""

    name: str
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    passed: bool
    #: worst element of ``|actual - expected| / (atol + rtol * |expected|)``: the error relative to
    #: what ``torch.testing.assert_close`` allows; ``<= 1`` passes. Reports colour by it.
    ratio: float = 0.0


@dataclass
class RunInfo:
    """Facts about the run a record came from, the same for every case of one run."""

    run_id: str
    host: str
    torch_version: str
    #: the process-group backend(s) of the run's pools (``gloo``, ``nccl``, ``gloo,nccl``).
    backend: str
    gpu: str | None = None
    nccl_version: str | None = None
    git_rev: str | None = None
    #: where the ranks' tensors live (``cpu``, ``cuda``, ``cpu,cuda``): not the backend, gloo runs on both.
    #: Records written before it existed read as ``cpu`` where the backend is gloo.
    device: str | None = None
    #: most ranks of one pool on one GPU (1: one GPU per rank; 2+: gloo ranks sharing GPUs); None on CPU.
    ranks_per_gpu: int | None = None

    def placement_text(self) -> str:
        """``gloo on cuda, 2 ranks per GPU``: the run's placement in one phrase for headers."""
        return placement_text(self.backend, self.device, self.ranks_per_gpu)


def placement_text(backend: str | None, device: str | None, ranks_per_gpu: int | None) -> str:
    """``gloo on cuda, 2 ranks per GPU``, ``nccl on cuda, one GPU per rank``, ``gloo on cpu``: where a run's
    ranks ran, from a record's run facts (records written before ``device`` existed: gloo read as CPU)."""
    backend = backend or "?"
    # Read back from a table, a missing value may come as NaN rather than None.
    device = device if isinstance(device, str) and device else ("cuda" if "nccl" in backend else "cpu")
    ranks_per_gpu = int(ranks_per_gpu) if isinstance(ranks_per_gpu, (int, float)) and ranks_per_gpu == ranks_per_gpu else None
    text = f"{backend} on {device}"
    if ranks_per_gpu:
        text += ", one GPU per rank" if ranks_per_gpu == 1 else f", {ranks_per_gpu} ranks per GPU"
    return text


@dataclass
class CaseRecord:
    """Everything known about one case after it ran (or failed to)."""

    #: ``CaseConfig.to_dict()`` of the case; every axis is a key.
    case: dict[str, Any]
    case_id: str
    verdict: Verdict
    #: one line: why it failed, why it is unsupported, or where it hung/crashed. Empty on pass.
    reason: str = ""
    run: RunInfo | None = None
    #: seconds since the epoch when the case finished.
    time: float = 0.0
    errors: list[QuantityError] = field(default_factory=list)
    #: None when not checked.
    deterministic: bool | None = None
    wall_s: float = 0.0
    peak_mem_bytes: int = 0
    bytes_all_gathered: int = 0
    bytes_reduce_scattered: int = 0
    #: per-rank details kept for debugging (stacks of a timeout, stderr tail of a crash ...).
    detail: dict[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION
    #: runs per verdict of a repeated case (``{"pass": 3, "fail": 2}``); None when it ran once.
    #: Optional: records written before it existed read as None.
    outcomes: dict[str, int] | None = None
    #: per-step values of both sides, per rank: ``{"loss": {"engine": [[step0, step1, ...] of rank 0,
    #: ...], "reference": [...]}, "grad_norm": {...}}``, so a report can draw how a divergence grew.
    #: None where not recorded (cases that did not finish, records written before it existed).
    curves: dict[str, dict[str, list[list[float]]]] | None = None
    #: why the harness expected this case to fail (a known engine bug, a strict expectation: a pass fails
    #: the run); None where a pass was expected. A record that did not pass and carries it is an expected
    #: failure, which reports count apart; one that passed and carries it shows a bug that went away.
    #: Optional: records written before it existed read as None.
    expected_failure: str | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"CaseRecord.verdict={self.verdict!r} is not one of {list(VERDICTS)}")

    @property
    def worst_ratio(self) -> float | None:
        """The worst error relative to its tolerance over all quantities, or None if none compared."""
        return max((e.ratio for e in self.errors), default=None)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self, default: Any = None) -> str:
        """The record as one line of strict JSON (``json_safe``; ``default`` as ``json.dumps``'s)."""
        return json.dumps(json_safe(self.to_dict()), default=default, ensure_ascii=False, allow_nan=False)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CaseRecord":
        if d.get("schema", SCHEMA_VERSION) > SCHEMA_VERSION:
            raise ValueError(
                f"record schema {d['schema']} is newer than this reader's {SCHEMA_VERSION}: upgrade the project"
            )
        d = _known_fields(cls, d)
        d["errors"] = [QuantityError(**{k: as_float(v) for k, v in _known_fields(QuantityError, e).items()})
                       for e in d.get("errors", [])]
        if d.get("curves") is not None:
            d["curves"] = {q: {side: as_float(v) for side, v in sides.items()} for q, sides in d["curves"].items()}
        if d.get("run") is not None:
            d["run"] = RunInfo(**_known_fields(RunInfo, d["run"]))
        return cls(**d)


def _known_fields(cls: type, d: dict[str, Any]) -> dict[str, Any]:
    """``d`` without the keys ``cls`` has no field for: a field a newer writer added within the same
    schema major is ignored, so the record (and a resume over it) stays readable."""
    names = {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in d.items() if k in names}


class NotRun(NamedTuple):
    """A selected case a run did not run (a time budget spent, a pool that did not start): one line of
    ``not_run.txt``, ``<full id>\\t<why>\\t<CaseConfig.to_dict() as JSON>``."""

    full_id: str
    why: str
    #: ``CaseConfig.to_dict()`` of the case, which reports read its axes from; None where the list did
    #: not record it (lists written before it did, a full id given on the command line).
    case: dict[str, Any] | None = None


def not_run_text(not_run: Iterable[tuple["CaseConfig", str]]) -> str:
    """``not_run.txt``'s text for ``(case, why)`` pairs (``NotRun``'s line format)."""
    return "".join(f"{case.full_id}\t{why}\t{json.dumps(case.to_dict())}\n" for case, why in not_run)


def parse_not_run(text: str) -> list[NotRun]:
    """``not_run.txt``'s lines; a line without a reason gets ``not run``, one without a config (written
    before lines carried it) ``case=None``."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        full_id, _, rest = line.partition("\t")
        why, _, case = rest.partition("\t")
        out.append(NotRun(full_id.strip(), why.strip() or "not run", json.loads(case) if case.strip() else None))
    return out
