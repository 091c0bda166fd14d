"""Building the parity tables from records: pure functions over pandas frames, no files.

The pipeline is ``records_frame`` (one row per record) -> ``latest`` (one row per case) ->
``parity_matrices`` / ``marginals`` / ``summarize``. A report directory's ``results.csv`` is the
output of ``latest`` written out, so ``frame_from_csv`` brings it back to the same shape.

[Note: what a cell counts]
A cell aggregates every case with the cell's engine, reference, model, strategy, precision and
backward prefetch (forward prefetch, offload, use_orig_params, init mode, world size and steps vary
within it). It shows ``passed/total`` where ``total`` counts cases that ran (pass, fail, error,
timeout, crash) and leaves out ``unsupported`` ones, which are counted apart: an engine refusing a
configuration is not a parity failure. Expected failures (``is_expected_failure``: a case that did not
pass and whose record carries ``CaseRecord.expected_failure``, a known engine bug the suite holds as a
strict xfail) are counted apart too, ``+Nx``: they are known, not new breakage, so they neither count
against ``passed/total`` nor colour the cell; they are still listed with the cases that did not pass.
A cell whose cases that ran are all expected failures has its own status, ``expected``. Its worst
ratio is the largest ``CaseRecord.worst_ratio`` among them: the worst error relative to its tolerance,
``<= 1`` being within tolerance (of the expected failures only where nothing else ran).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import pandas as pd

from harness.cases.case import DEFAULT_ENGINES, FIELD_VALUES, LOOP_SEGMENTS, CaseConfig, engine_name
from harness.cases.records import ERRORED, FAILING, SEVERITY, VERDICTS, CaseRecord
from harness.collect.collector import BadLine, record_full_id

#: The case fields reports group by, in display order.
AXIS_COLUMNS: tuple[str, ...] = (
    "engine", "reference", "model", "sharding_strategy", "precision", "backward_prefetch",
    "forward_prefetch", "cpu_offload", "use_orig_params", "init_mode", "world_size", "steps",
    "optimizer", "checkpoint", "resume_engine", *LOOP_SEGMENTS,
)
#: Axes that results written before them lack (read as their defaults).
_LATER_AXES = ("optimizer", "checkpoint", "resume_engine", *LOOP_SEGMENTS)
#: Axes ``marginals`` tabulates: cross-engine resume has its own matrix (``reports.resume_matrix``).
MARGINAL_AXES: tuple[str, ...] = tuple(a for a in AXIS_COLUMNS if a != "resume_engine")
RUN_COLUMNS: tuple[str, ...] = ("run_id", "host", "torch_version", "backend", "device", "ranks_per_gpu", "gpu",
                                 "nccl_version", "git_rev")
OUTCOME_COLUMNS: tuple[str, ...] = (
    "verdict", "worst_ratio", "worst_quantity", "reason", "deterministic", "wall_s", "peak_mem_bytes",
    "bytes_all_gathered", "bytes_reduce_scattered", "time",
    # The knob checks that failed (``precision,sharding_strategy``): the trace's evidence of a cause.
    "ignored_knobs",
    # ``CaseRecord.expected_failure``: why the suite expected the case to fail; "" where a pass was expected.
    "expected_failure",
)
COLUMNS: tuple[str, ...] = ("full_id", "case_id", *AXIS_COLUMNS, *OUTCOME_COLUMNS, *RUN_COLUMNS, "source")

#: Display order of the values of literal axes; other values sort after them, alphabetically.
VALUE_ORDER: dict[str, list[Any]] = {
    "engine": list(DEFAULT_ENGINES),
    **{axis: list(values) for axis, values in FIELD_VALUES.items()},
    "forward_prefetch": [False, True],
    "cpu_offload": [False, True],
    "use_orig_params": [False, True],
}

CellStatus = Literal["pass", "fail", "flaky", "error", "expected", "unsupported", "empty"]
#: what ``+Nx`` and ``+Nu`` after a cell's counts mean (the legends of the Markdown and HTML pages).
COUNT_LEGEND = ("`+Nx`: N expected failures (known engine bugs, strict: listed below); `+Nu`: N unsupported")

_DEFAULTS = CaseConfig().to_dict()


def ordered(axis: str, values: Iterable[Any]) -> list[Any]:
    """``values`` (deduplicated) in the display order of ``axis``."""
    known = VALUE_ORDER.get(axis, [])
    unique = list(dict.fromkeys(values))
    return sorted(unique, key=lambda v: (known.index(v) if v in known else len(known), str(v)))


def _carries_expectation(expected_failure: Any) -> bool:
    """Whether a record's ``CaseRecord.expected_failure`` says a failure was expected ("" or NaN in a frame
    where it did not)."""
    return isinstance(expected_failure, str) and expected_failure != ""


def is_expected_failure(verdict: str, expected_failure: Any) -> bool:
    """Whether a case is an expected failure: it ran and did not pass, and its record says the suite
    expected that (``CaseRecord.expected_failure``)."""
    return verdict in FAILING and _carries_expectation(expected_failure)


def is_expected_row(row: Mapping[str, Any]) -> bool:
    """``is_expected_failure`` of one row of a results frame."""
    return is_expected_failure(row["verdict"], row.get("expected_failure"))


def expected_failures(cases: pd.DataFrame) -> pd.Series:
    """``is_expected_failure`` of every row of ``cases``, as a boolean mask."""
    if "expected_failure" not in cases.columns:
        return pd.Series(False, index=cases.index)
    return pd.Series([is_expected_failure(v, e) for v, e in zip(cases["verdict"], cases["expected_failure"])],
                     index=cases.index, dtype=bool)


#: what the pages say of a case expected to fail that passed (``unexpected_passes``).
UNEXPECTED_PASS_NOTE = (
    "passed although its suite expects a failure: the bug may be fixed, or a race spared this run (a check of several "
    "cases, such as a ported check's subtests, is expected to fail as a whole). A strict expectation fails the pytest "
    "run when its test passes, until it is removed from the suite."
)


def unexpected_passes(cases: pd.DataFrame) -> pd.DataFrame:
    """The cases that passed although their suite expected them to fail: a known bug gone (the strict
    expectation fails the run until it is removed)."""
    if cases.empty or "expected_failure" not in cases.columns:
        return cases.iloc[0:0]
    return cases[(cases["verdict"] == "pass") & cases["expected_failure"].map(_carries_expectation)]


def _worst_error(record: CaseRecord) -> tuple[float, str]:
    if not record.errors:
        return math.nan, ""
    worst = max(record.errors, key=lambda e: (e.ratio if not math.isnan(e.ratio) else math.inf))
    return worst.ratio, worst.name


def case_axes(case: Mapping[str, Any]) -> dict[str, Any]:
    """The ``AXIS_COLUMNS`` of a case from its config (``CaseConfig.to_dict()``); axes an older writer did not
    know read as their defaults."""
    case = {**_DEFAULTS, **case}
    return {
        **{axis: case.get(axis) for axis in AXIS_COLUMNS},
        # A plugged engine's spec (``mine=fsdp1:pkg``) is shown by its name, as case ids show it.
        "engine": engine_name(str(case.get("engine"))),
        # "" when the saving engine resumed (or nothing was saved): a plain value pandas can group.
        "resume_engine": case.get("resume_engine") or "",
    }


def records_frame(records: Sequence[CaseRecord], sources: Sequence[str] | None = None) -> pd.DataFrame:
    """One row per record with every column of ``COLUMNS``; ``sources`` says where each came from."""
    rows = []
    for i, record in enumerate(records):
        ratio, quantity = _worst_error(record)
        run = asdict(record.run) if record.run is not None else {}
        rows.append({
            "full_id": record_full_id(record),
            "case_id": record.case_id,
            **case_axes(record.case),
            "verdict": record.verdict,
            "worst_ratio": ratio,
            "worst_quantity": quantity,
            "reason": record.reason,
            "deterministic": record.deterministic,
            "wall_s": record.wall_s,
            "peak_mem_bytes": record.peak_mem_bytes,
            "bytes_all_gathered": record.bytes_all_gathered,
            "bytes_reduce_scattered": record.bytes_reduce_scattered,
            "time": record.time,
            "ignored_knobs": ",".join(k.get("knob", "?") for k in record.detail.get("knobs") or []
                                      if isinstance(k, dict) and k.get("status") == "ignored"),
            "expected_failure": record.expected_failure or "",
            **{col: run.get(col) for col in RUN_COLUMNS},
            "source": sources[i] if sources is not None else "",
        })
    return pd.DataFrame(rows, columns=list(COLUMNS))


def frame_from_csv(frame: pd.DataFrame) -> pd.DataFrame:
    """A ``results.csv`` read back with ``pd.read_csv``, normalised to ``records_frame``'s shape."""
    missing = [c for c in ("full_id", *AXIS_COLUMNS, "verdict") if c not in frame.columns and c not in _LATER_AXES]
    if missing:
        raise ValueError(f"results.csv lacks columns {missing}; is it a report's results.csv?")
    frame = frame.reindex(columns=list(COLUMNS)).copy()
    for col in ("reason", "worst_quantity", "source", "case_id", "ignored_knobs", "expected_failure"):
        frame[col] = frame[col].astype(object).fillna("").astype(str)  # an all-empty column reads as float
    for col in ("forward_prefetch", "cpu_offload", "use_orig_params"):
        frame[col] = frame[col].map(lambda v: v if isinstance(v, bool) else str(v) == "True")
    for col in ("world_size", "steps"):
        frame[col] = frame[col].astype(int)
    # Results from before the optimizer, checkpoint and training-loop axes hold their defaults.
    for col, default in ((a, "" if a == "resume_engine" else _DEFAULTS[a]) for a in _LATER_AXES):
        frame[col] = frame[col].astype(object).where(frame[col].notna(), default).astype(str)
    frame["worst_ratio"] = frame["worst_ratio"].astype(float)
    frame["time"] = frame["time"].fillna(0.0).astype(float)
    return frame


def latest(frame: pd.DataFrame) -> tuple[pd.DataFrame, int]:
    """One row per case, the most recent record winning (a resumed or repeated case); and how many
    older records were superseded."""
    if frame.empty:
        return frame, 0
    # Stable sort: equal times keep input order, so the later file/line wins a tie.
    ordered_frame = frame.reset_index(drop=True).sort_values("time", kind="stable")
    kept = ordered_frame.drop_duplicates("full_id", keep="last").sort_index()
    return kept.reset_index(drop=True), len(frame) - len(kept)


# ---------------------------------------------------------------------------------------------------
# Cells


@dataclass(frozen=True)
class CellStats:
    """The aggregate of one group of cases (a matrix cell, or one value of one axis)."""

    passed: int = 0
    failed: int = 0
    #: error, timeout or crash.
    errored: int = 0
    unsupported: int = 0
    #: runs of a repeated case disagreed (``harness.run.repeats``).
    flaky: int = 0
    #: expected failures (``is_expected_failure``), in none of the counts above.
    expected: int = 0
    #: largest worst ratio among the cases, NaN when none compared numbers.
    worst_ratio: float = math.nan
    #: the most severe verdict among the cases ("" for none): names what went wrong in an error cell.
    worst_verdict: str = ""

    @property
    def total(self) -> int:
        """Cases that ran; unsupported ones are not counted (see [Note: what a cell counts])."""
        return self.passed + self.failed + self.errored + self.flaky

    @property
    def status(self) -> CellStatus:
        if self.errored:
            return "error"
        if self.failed:
            return "fail"
        if self.flaky:
            return "flaky"
        if self.passed:
            return "pass"
        if self.expected:
            return "expected"
        if self.unsupported:
            return "unsupported"
        return "empty"

    @classmethod
    def of(cls, cases: pd.DataFrame) -> "CellStats":
        expected = expected_failures(cases)
        # The worst ratio and verdict are of the other cases, of the expected failures where nothing else ran.
        others_ran = (~expected & (cases["verdict"] != "unsupported")).any()
        shown = cases[expected] if expected.any() and not others_ran else cases[~expected]
        verdicts = cases[~expected]["verdict"].value_counts()
        ratios = shown["worst_ratio"].astype(float)
        return cls(
            passed=int(verdicts.get("pass", 0)),
            failed=int(verdicts.get("fail", 0)),
            errored=int(sum(verdicts.get(v, 0) for v in ERRORED)),
            unsupported=int(verdicts.get("unsupported", 0)),
            flaky=int(verdicts.get("flaky", 0)),
            expected=int(expected.sum()),
            worst_ratio=float(ratios.max()) if ratios.notna().any() else math.nan,
            worst_verdict=min(shown["verdict"].unique(), key=SEVERITY.__getitem__, default=""),
        )

    @property
    def pass_text(self) -> str:
        """``20/20 pass, 4 expected failure(s)``: a matrix's totals in its heading."""
        return f"{self.passed}/{self.total} pass" + (f", {self.expected} expected failure(s)" if self.expected else "")

    @property
    def count_suffix(self) -> str:
        """`` +8x +2u``: the expected failures and unsupported cases counted apart ("" for none)."""
        return (f" +{self.expected}x" if self.expected else "") + (f" +{self.unsupported}u" if self.unsupported else "")


def fmt_ratio(ratio: float) -> str:
    """Two significant digits: ``0.31``, ``37``, ``1.2e3``, ``5e-5``; ``-`` when nothing was compared."""
    if ratio is None or (isinstance(ratio, float) and math.isnan(ratio)):
        return "-"
    if math.isinf(ratio):
        return "inf"
    if ratio == 0:
        return "0"
    return f"{ratio:.2g}".replace("e+0", "e").replace("e-0", "e-").replace("e+", "e")


def cell_label(stats: CellStats) -> str:
    """``3/4 · 0.31``: pass count over total · worst ratio (the worst verdict instead when a case
    errored, timed out or crashed); ``+8x`` for expected failures and ``+2u`` for unsupported cases
    alongside (``COUNT_LEGEND``)."""
    if stats.status == "empty":
        return ""
    if stats.status == "unsupported":
        return f"unsupported ({stats.unsupported})"
    if stats.status == "expected":
        return f"expected failure ({stats.expected})" + (f" +{stats.unsupported}u" if stats.unsupported else "")
    detail = stats.worst_verdict if stats.status in ("error", "flaky") else fmt_ratio(stats.worst_ratio)
    return f"{stats.passed}/{stats.total} · {detail}{stats.count_suffix}"


def shown_verdict(row: Mapping[str, Any]) -> str:
    """A case's verdict as tables show it: ``error (expected)`` for an expected failure."""
    return f"{row['verdict']} (expected)" if is_expected_row(row) else str(row["verdict"])


def sort_failing(cases: pd.DataFrame) -> pd.DataFrame:
    """Cases that did not pass, worst first: crashes, timeouts, errors, then failures by ratio; the
    expected failures after all the others, in the same order."""
    bad = cases[cases["verdict"] != "pass"]
    return bad.assign(
        _exp=expected_failures(bad), _sev=bad["verdict"].map(SEVERITY), _ratio=-bad["worst_ratio"].astype(float).fillna(-math.inf)
    ).sort_values(["_exp", "_sev", "_ratio", "full_id"], kind="stable").drop(columns=["_exp", "_sev", "_ratio"])


@dataclass
class ParityMatrix:
    """One engine against one reference on one model: strategies x precision x backward prefetch."""

    engine: str
    reference: str
    model: str
    #: sharding strategies, in display order.
    rows: list[str]
    #: precision configs, in display order; each has one sub-column per ``prefetches`` value.
    precisions: list[str]
    prefetches: list[str]
    #: ``(strategy, precision, prefetch) -> CellStats`` for every non-empty cell.
    cells: dict[tuple[str, str, str], CellStats]
    #: the cases of this matrix (rows of the ``latest`` frame).
    cases: pd.DataFrame = field(repr=False)

    @property
    def title(self) -> str:
        return f"{self.engine} vs {self.reference} · {self.model}"

    @property
    def slug(self) -> str:
        """A file-name-safe name: ``torch-fsdp_vs_ddp_nested``."""
        raw = f"{self.engine}_vs_{self.reference}_{self.model}"
        return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in raw)

    @property
    def columns(self) -> list[tuple[str, str]]:
        return [(p, b) for p in self.precisions for b in self.prefetches]

    def cell(self, strategy: str, precision: str, prefetch: str) -> CellStats:
        return self.cells.get((strategy, precision, prefetch), CellStats())

    def cell_cases(self, strategy: str, precision: str, prefetch: str) -> pd.DataFrame:
        c = self.cases
        return c[(c["sharding_strategy"] == strategy) & (c["precision"] == precision) & (c["backward_prefetch"] == prefetch)]

    @property
    def totals(self) -> CellStats:
        return CellStats.of(self.cases)

    def table(self) -> pd.DataFrame:
        """Cell labels: strategies as rows, (precision, prefetch) as two-level columns."""
        data = [[cell_label(self.cell(s, p, b)) for p, b in self.columns] for s in self.rows]
        columns = pd.MultiIndex.from_tuples(self.columns, names=["precision", "backward_prefetch"])
        return pd.DataFrame(data, index=pd.Index(self.rows, name="sharding_strategy"), columns=columns)


def parity_matrices(frame: pd.DataFrame) -> list[ParityMatrix]:
    """One matrix per (engine, reference, model) in the frame, in display order."""
    out = []
    if frame.empty:
        return out
    for engine in ordered("engine", frame["engine"]):
        for reference in ordered("reference", frame["reference"]):
            for model in ordered("model", frame["model"]):
                cases = frame[(frame["engine"] == engine) & (frame["reference"] == reference) & (frame["model"] == model)]
                if cases.empty:
                    continue
                cells = {
                    key: CellStats.of(group)
                    for key, group in cases.groupby(["sharding_strategy", "precision", "backward_prefetch"], sort=False)
                }
                out.append(ParityMatrix(
                    engine=engine, reference=reference, model=model,
                    rows=ordered("sharding_strategy", cases["sharding_strategy"]),
                    precisions=ordered("precision", cases["precision"]),
                    prefetches=ordered("backward_prefetch", cases["backward_prefetch"]),
                    cells=cells, cases=cases,
                ))
    return out


def marginals(frame: pd.DataFrame, axes: Sequence[str] = MARGINAL_AXES) -> dict[str, pd.DataFrame]:
    """Per axis: one row per value, ``passed/total`` per engine and the worst ratio over all engines.

    Spots a failure shared by one value across everything else (e.g. every ``cpu_offload=True`` case).
    Axes with a single value are left out: they say nothing a total does not.
    """
    tables: dict[str, pd.DataFrame] = {}
    if frame.empty:
        return tables
    engines = ordered("engine", frame["engine"])
    for axis in axes:
        values = ordered(axis, frame[axis])
        if axis == "engine" or len(values) < 2:
            continue
        rows = []
        for value in values:
            cases = frame[frame[axis] == value]
            row: dict[str, Any] = {axis: value}
            for engine in engines:
                stats = CellStats.of(cases[cases["engine"] == engine])
                expected = f" +{stats.expected}x" if stats.expected else ""  # unsupported: their own column
                row[engine] = f"{stats.passed}/{stats.total}{expected}" if stats.total or stats.expected or stats.unsupported else ""
            overall = CellStats.of(cases)
            row["unsupported"] = overall.unsupported
            row["worst ratio"] = fmt_ratio(overall.worst_ratio)
            rows.append(row)
        tables[axis] = pd.DataFrame(rows).set_index(axis)
    return tables


# ---------------------------------------------------------------------------------------------------
# Summary


@dataclass
class MatrixSummary:
    engine: str
    reference: str
    model: str
    passed: int
    total: int
    unsupported: int
    errored: int
    worst_ratio: float | None
    #: file name of its heatmap inside the report directory.
    heatmap: str
    #: expected failures (``is_expected_failure``), in neither ``total`` nor ``errored``.
    expected: int = 0


@dataclass
class Summary:
    """What a report holds, as written to ``summary.json``; ``reports.build`` returns it."""

    out_dir: str
    inputs: list[str]
    #: cases in the report (one per full id).
    cases: int
    #: cases per verdict.
    verdicts: dict[str, int]
    #: older records of a case replaced by a newer one (resumed or repeated runs).
    superseded: int
    #: unreadable lines of the inputs (e.g. a record cut by a killed run).
    bad_lines: list[BadLine]
    runs: list[dict[str, Any]]
    matrices: list[MatrixSummary]
    #: output files, relative to ``out_dir``.
    files: list[str] = field(default_factory=list)
    #: ``reports.attribution.attributions_dict``: per engine and reference, the terms that explain its failures.
    attribution: list[dict[str, Any]] = field(default_factory=list)
    #: ``reports.scope.RunScope.to_dict`` of a run that did not run its whole selection; None when whole or unknown.
    scope: dict[str, Any] | None = None
    #: cases that did not pass, as their suite expected (``is_expected_failure``); also in ``verdicts``.
    expected_failures: int = 0
    #: cases expected to fail that passed (a known bug gone: the strict expectation now fails the run).
    unexpected_passes: int = 0

    @property
    def ran(self) -> int:
        """Cases held to a pass: those that ran, less the expected failures."""
        return sum(self.verdicts.values()) - self.verdicts.get("unsupported", 0) - self.expected_failures

    @property
    def ok(self) -> bool:
        """Every case that ran passed or failed as expected, and every input line was readable."""
        failing = sum(self.verdicts.get(v, 0) for v in FAILING)
        return not self.bad_lines and failing == self.expected_failures

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bad_lines"] = [b.to_dict() for b in self.bad_lines]
        d["ok"] = self.ok
        for m in d["matrices"]:
            if m["worst_ratio"] is not None and not math.isfinite(m["worst_ratio"]):
                m["worst_ratio"] = str(m["worst_ratio"])  # keep summary.json strict JSON
        return d


def summarize(
    frame: pd.DataFrame, matrices: Sequence[ParityMatrix], *, out_dir: str, inputs: Sequence[str],
    superseded: int, bad_lines: Sequence[BadLine],
) -> Summary:
    counts = frame["verdict"].value_counts() if not frame.empty else pd.Series(dtype=int)
    run_frame = frame[list(RUN_COLUMNS)].drop_duplicates() if not frame.empty else frame
    runs = [
        {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in row.items()}
        for row in run_frame.to_dict("records")
    ]
    return Summary(
        out_dir=out_dir,
        inputs=list(inputs),
        cases=len(frame),
        verdicts={v: int(counts.get(v, 0)) for v in VERDICTS},
        superseded=superseded,
        bad_lines=list(bad_lines),
        runs=runs,
        expected_failures=int(expected_failures(frame).sum()) if not frame.empty else 0,
        unexpected_passes=len(unexpected_passes(frame)),
        matrices=[
            MatrixSummary(
                engine=m.engine, reference=m.reference, model=m.model,
                passed=m.totals.passed, total=m.totals.total, unsupported=m.totals.unsupported,
                errored=m.totals.errored,
                worst_ratio=None if math.isnan(m.totals.worst_ratio) else m.totals.worst_ratio,
                heatmap=f"heatmap_{m.slug}.png", expected=m.totals.expected,
            )
            for m in matrices
        ],
    )
