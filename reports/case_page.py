"""Case drill-down pages: one HTML page (and one PNG) per case, linked from the grid and the Markdown.

A page says everything the record knows about one case: its settings, verdict and reason; what its suite
expected where it expected a failure (``CaseRecord.expected_failure``: a known engine bug); how the
engine's loss and the reference's moved step by step and how far apart they were against the
tolerance (``CaseRecord.curves`` where recorded; the per-step ``loss@N``/``grad_norm@N`` errors
otherwise); the worst parameters and gradients; the knob checks; the tolerance and where it came
from; for a timeout, crash or error the stacks, tracebacks and stderr; and the command that reruns it.
"""

from __future__ import annotations

import math
import re
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, get_args

import numpy as np
from matplotlib.figure import Figure

from harness.cases.case import ReferenceName
from harness.cases.records import CaseRecord, QuantityError
from harness.selection.matrix import RULES, invalid_reason, invalid_reasons
from reports.matrix import UNEXPECTED_PASS_NOTE, fmt_ratio, is_expected_failure
from reports.page import banner_html, esc, page

CASES_DIR = "cases"
#: parameters and gradients listed per page, worst first.
MAX_QUANTITIES = 15
_STEP = re.compile(r"^(?P<what>loss|grad_norm)@(?P<step>\d+)$")

#: what each ``detail["budget_source"]`` means, for the tolerance section.
BUDGET_SOURCES = {
    "none": "torch.testing.assert_close's defaults for the case's dtype (full precision up to 2 ranks: "
            "averaging two gradients rounds the same in any order).",
    "ablation": "mixed precision up to 2 ranks: compared with the local reference that emulates the engine's "
                "casts, under torch's defaults for the full dtype widened per quantity by 0.5x the distance from "
                "the emulation to the nearest run of an engine that drops a cast (float64, or one MixedPrecision "
                "field ignored), so a dropped cast fails on values alone.",
    "emulation": "mixed precision: torch's defaults widened per quantity by 4x the distance between the local "
                 "reference that emulates the engine's casts and the same run in float64; rtol of the "
                 "lowest-precision dtype the case computes or reduces in.",
    "reference": "full precision past 2 ranks: torch's defaults widened per quantity by 4x the distance between "
                 "the reference itself and the same run in float64 (reduction order changes rounding).",
}


def case_slug(full_id: str) -> str:
    """A file-name-safe name of a case: ``torch-fsdp__ddp__no_shard-fp32-bwd_none-offload-orig-nested``."""
    return "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in full_id.replace(":", "__"))


def case_href(full_id: str) -> str:
    """The page of a case, relative to the report directory."""
    return f"{CASES_DIR}/{case_slug(full_id)}.html"


def rerun_command(case: Mapping[str, Any], full_id: str, backend: str | None = None) -> str:
    """``python3 -m harness run ...`` selecting exactly this case (the full generator, its engine,
    reference, model, world size and steps pinned, its full id as the filter)."""
    parts = [
        "python3", "-m", "harness", "run", "--matrix", "full",
        "--engines", str(case.get("engine")), "--references", str(case.get("reference")),
        "--models", str(case.get("model")), "--world-size", str(case.get("world_size", 2)),
        "--steps", str(case.get("steps", 5)), "--filter", full_id,
    ]
    if case.get("check_determinism"):
        parts.append("--check-determinism")
    if backend in ("gloo", "nccl"):
        parts += ["--backend", backend]
    parts += ["--out", f"rerun-{case_slug(full_id)}.jsonl"]
    return " ".join(shlex.quote(p) for p in parts)


def rerun_caveats(case: Mapping[str, Any]) -> list[str]:
    """Settings of the case the command line cannot set (the rerun would differ there)."""
    out = []
    for key, default in (("seed", 0), ("lr", 0.01), ("momentum", 0.9)):
        if key in case and case[key] != default:
            out.append(f"{key}={case[key]} (the CLI runs {default})")
    if case.get("extras"):
        out.append(f"extras={case['extras']} (a test-only setting such as an injected fault)")
    values = {k: v for k, v in case.items() if k != "extras"}
    try:
        invalid = invalid_reason(values)
    except ValueError:  # EngineSpecError: a plug-in engine not importable here; the matrix's own rules still hold
        invalid = "; ".join(invalid_reasons(values, RULES)) or None
    except (KeyError, TypeError):
        invalid = None
    if invalid:
        out.append(f"the case breaks a rule of the matrix, so the generators never make it and the command selects "
                   f"nothing ({invalid}); it came from a test that builds its cases itself")
    return out


# ---------------------------------------------------------------------------------------------------
# Per-step series (pure)


def step_errors(errors: Sequence[QuantityError]) -> dict[str, dict[int, QuantityError]]:
    """``{"loss": {step: error}, "grad_norm": {...}}`` from the ``loss@N``/``grad_norm@N`` quantities."""
    out: dict[str, dict[int, QuantityError]] = {"loss": {}, "grad_norm": {}}
    for e in errors:
        m = _STEP.match(e.name)
        if m:
            out[m["what"]][int(m["step"])] = e
    return out


def worst_quantities(errors: Sequence[QuantityError], limit: int = MAX_QUANTITIES) -> list[QuantityError]:
    """Parameters and gradients, worst ratio first (NaN counts as worst)."""
    pg = [e for e in errors if e.name.startswith(("param:", "grad:"))]
    return sorted(pg, key=lambda e: (-(math.inf if math.isnan(e.ratio) else e.ratio), e.name))[:limit]


def has_plot(record: CaseRecord | None) -> bool:
    if record is None:
        return False
    return bool(record.curves) or any(step_errors(record.errors).values())


def plot_case(record: CaseRecord, path: Path) -> None:
    """The case's PNG: losses of both sides per rank, their difference against the tolerance, and the
    per-step error relative to tolerance of loss and gradient norm."""
    steps = step_errors(record.errors)
    curves = (record.curves or {}).get("loss")
    panels = (2 if curves else 0) + (1 if any(steps.values()) else 0)
    fig = Figure(figsize=(8.5, 2.6 * panels + 0.4), dpi=90)
    axes = list(np.atleast_1d(fig.subplots(panels, 1, sharex=True)))
    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22"]
    if curves:
        top, mid = axes[0], axes[1]
        for rank, (eng, ref) in enumerate(zip(curves.get("engine", []), curves.get("reference", []))):
            c = colours[rank % len(colours)]
            top.plot(range(len(eng)), eng, "-o", color=c, ms=3, label=f"engine, rank {rank}")
            top.plot(range(len(ref)), ref, "--x", color=c, ms=4, alpha=0.7, label=f"reference, rank {rank}")
            n = min(len(eng), len(ref))
            diff = [abs(a - b) for a, b in zip(eng[:n], ref[:n])]
            mid.plot(range(n), [d if d > 0 else np.nan for d in diff], "-o", color=c, ms=3, label=f"|engine - reference|, rank {rank}")
            tol = [steps["loss"][s].atol + steps["loss"][s].rtol * abs(ref[s]) if s in steps["loss"] else np.nan for s in range(n)]
            mid.plot(range(n), tol, ":", color=c, alpha=0.8, label=f"tolerance, rank {rank}")
        top.set_ylabel("loss")
        top.legend(fontsize=7, ncol=2)
        mid.set_yscale("log")
        mid.set_ylabel("loss difference")
        mid.legend(fontsize=7, ncol=2)
    if any(steps.values()):
        ax = axes[-1]
        for what, marker in (("loss", "-o"), ("grad_norm", "-s")):
            series = steps[what]
            if series:
                xs = sorted(series)
                ax.plot(xs, [max(series[s].ratio, 1e-6) for s in xs], marker, ms=4, label=f"{what} (worst rank)")
        ax.axhline(1.0, color="black", lw=1, ls="--", label="tolerance")
        ax.set_yscale("log")
        ax.set_ylabel("error / tolerance")
        ax.legend(fontsize=7)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.get_major_locator().set_params(integer=True)
    fig.suptitle(f"{record.case.get('engine')} vs {record.case.get('reference')}: {record.case_id}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path)


# ---------------------------------------------------------------------------------------------------
# HTML


def _table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f'<td class="left">{c}</td>' for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _pre_blocks(title: str, per_rank: Mapping[str, Any] | None) -> str:
    if not per_rank:
        return ""
    blocks = "".join(f"<h3>rank {esc(rank)}</h3><pre>{esc(text)}</pre>" for rank, text in sorted(per_rank.items()))
    return f"<h2>{esc(title)}</h2>{blocks}"


def _expectation_html(row: Mapping[str, Any], record: CaseRecord | None) -> str:
    """What the suite expected of the case, where it expected a failure ("" where it expected a pass)."""
    expected = row.get("expected_failure") or (record.expected_failure if record is not None else None)
    if not isinstance(expected, str) or not expected:
        return ""
    if is_expected_failure(str(row["verdict"]), expected):
        return (f'<p class="warn"><b>Expected failure</b> (a known engine bug its suite holds as a strict expectation, '
                f"not new breakage): {esc(expected)}</p>")
    if row["verdict"] == "pass":
        return f'<p class="warn"><b>Expected to fail, passed:</b> {esc(expected)}. This case {esc(UNEXPECTED_PASS_NOTE)}</p>'
    return f"<p><b>Expected to fail:</b> {esc(expected)}</p>"


def other_reference_ids(full_id: str) -> dict[str, str]:
    """The same case against each other reference: reference -> its full id (``engine:reference:case_id``)."""
    engine, reference, case_id = full_id.split(":", 2)
    return {other: f"{engine}:{other}:{case_id}" for other in get_args(ReferenceName) if other != reference}


def _other_references_html(full_id: str, case: Mapping[str, Any], backend: str | None,
                           verdicts: Mapping[str, str], pages: set[str]) -> str:
    """Where the same case against the other reference is: its page, its verdict, or how to run it (an
    unsupported pairing, mixed precision against DDP, is judged there)."""
    items = []
    for reference, other in other_reference_ids(full_id).items():
        if other in pages:
            items.append(f'<li>{esc(reference)}: <a href="{esc(case_slug(other))}.html">{esc(verdicts.get(other, "page"))}: '
                         f"<code>{esc(other)}</code></a></li>")
        elif other in verdicts:
            items.append(f"<li>{esc(reference)}: {esc(verdicts[other])} (<code>{esc(other)}</code>; a passing case has no "
                         "page)</li>")
        else:
            command = rerun_command({**case, "reference": reference}, other, backend)
            items.append(f"<li>{esc(reference)}: not in these results; run it: <pre>{esc(command)}</pre></li>")
    return "<h2>Against the other reference</h2><ul>" + "".join(items) + "</ul>" if items else ""


def case_html(
    row: Mapping[str, Any], record: CaseRecord | None, *, banner: str = "", plot: str | None = None,
    report_href: str = "../matrix.html", plot_skipped: str = "", verdicts: Mapping[str, str] | None = None,
    pages: set[str] | None = None,
) -> str:
    """The page of one case. ``row`` is its row of the ``latest`` frame; ``record`` adds the details
    (a report built from ``results.csv`` has none); ``verdicts`` (full id -> verdict of every case of the
    report) and ``pages`` (the full ids with a page) link the same case against the other reference."""
    full_id = str(row["full_id"])
    case = dict(record.case) if record is not None else {k: row[k] for k in row.keys() if k in (
        "engine", "reference", "model", "sharding_strategy", "precision", "backward_prefetch", "forward_prefetch",
        "cpu_offload", "use_orig_params", "init_mode", "world_size", "steps")}
    verdict = str(row["verdict"])
    parts = [banner_html(banner), f'<p><a href="{esc(report_href)}">← report</a></p>',
             f"<h1>{esc(verdict)}: <code>{esc(full_id)}</code></h1>"]
    if row.get("reason"):
        parts.append(f"<p><b>Reason:</b> {esc(row['reason'])}</p>")
    parts.append(_expectation_html(row, record))
    parts.append(f"<p>worst error / tolerance: <b>{esc(fmt_ratio(row.get('worst_ratio', math.nan)))}</b>"
                 + (f" ({esc(row['worst_quantity'])})" if row.get("worst_quantity") else "") + "</p>")
    backend = str(row.get("backend") or "").split(",")[0] or None
    parts.append("<h2>Rerun</h2><pre>" + esc(rerun_command(case, full_id, backend)) + "</pre>")
    caveats = rerun_caveats(case)
    if caveats:
        parts.append("<p>The command differs from this case: " + esc("; ".join(caveats)) + ".</p>")
    parts.append(_other_references_html(full_id, case, backend, verdicts or {}, pages or set()))
    settings = "<h2>Settings</h2>" + _table(["axis", "value"], [[esc(k), esc(v)] for k, v in case.items()])
    if plot_skipped:
        parts.append(f"<h2>Per step</h2><p>Not plotted: {esc(plot_skipped)}.</p>")
    if plot:
        parts.append(f'<h2>Per step</h2><img src="{esc(plot)}" alt="per-step loss and error of {esc(full_id)}">')
        if record is not None and not record.curves:
            parts.append("<p>This record has no per-step values (recorded before they were kept, or the case did "
                         "not finish); the plot shows the error relative to tolerance per step.</p>")
    if record is None:
        parts.append("<p>Only the summary row of this case is known: build the report from its results file "
                     "(JSON Lines) for the per-step values, quantities, knob checks and stacks.</p>")
        return page(f"{verdict} {full_id}", "\n".join([*parts, settings]))
    worst = worst_quantities(record.errors)
    where = (record.detail or {}).get("worst_at", {})
    if worst:
        rows = []
        for e in worst:
            at = where.get(e.name) or {}
            loc = ", ".join(f"{k} {v}" for k, v in at.items() if v is not None)
            colour = "#a50026" if not e.passed else "#222"
            rows.append([f'<code style="color:{colour}">{esc(e.name)}</code>', f"{e.max_abs:.3g}", f"{e.max_rel:.3g}",
                         f"{e.atol:.3g}", f"{e.rtol:.3g}", f"<b>{esc(fmt_ratio(e.ratio))}</b>",
                         "pass" if e.passed else "<b>FAIL</b>", esc(loc)])
        parts.append(f"<h2>Worst parameters and gradients ({len(worst)} of "
                     f"{sum(e.name.startswith(('param:', 'grad:')) for e in record.errors)})</h2>"
                     + _table(["quantity", "max abs", "max rel", "atol", "rtol", "error / tolerance", "", "where"], rows))
    detail = record.detail or {}
    knobs = detail.get("knobs") or []
    if knobs:
        rows = [[esc(k.get("knob")), f"<b>{esc(k.get('status'))}</b>", esc(k.get("reason", ""))] for k in knobs]
        parts.append("<h2>Knob checks</h2>" + _table(["knob", "status", "what the trace showed"], rows))
    if record.errors:
        source = str(detail.get("budget_source", "none"))
        tols = sorted({(e.atol, e.rtol) for e in record.errors})
        widest = max(tols)
        parts.append(
            "<h2>Tolerance</h2>"
            f"<p>Source: <b>{esc(source)}</b>: {esc(BUDGET_SOURCES.get(source, 'unknown'))}</p>"
            f"<p>{len(tols)} distinct (atol, rtol) pair(s); rtol {esc(f'{tols[0][1]:.3g}')}, atol from "
            f"{esc(f'{tols[0][0]:.3g}')} to {esc(f'{widest[0]:.3g}')}.</p>"
        )
    for key, title in (("tracebacks", "Tracebacks"), ("stacks", "Stacks"), ("stderr_tails", "stderr")):
        parts.append(_pre_blocks(title, detail.get(key)))
    if detail.get("exit_codes"):
        parts.append("<p>Exit codes: " + esc(", ".join(f"rank {r}: {c}" for r, c in sorted(detail["exit_codes"].items()))) + "</p>")
    parts.append(settings)
    extra = {k: v for k, v in detail.items() if k in ("notes", "collectives", "engine_s", "reference_s")}
    if extra:
        parts.append("<h2>Other facts</h2>" + _table(["", ""], [[esc(k), esc(v)] for k, v in extra.items()]))
    return page(f"{verdict} {full_id}", "\n".join(p for p in parts if p))


def write_case_pages(
    rows: Sequence[Mapping[str, Any]], records: Mapping[str, CaseRecord], out: Path, *, banner: str = "",
    max_plots: int = 500, plot_deadline: float | None = None,
) -> list[str]:
    """Write the page (and PNG) of every row into ``out/cases/``; returns the files, relative to ``out``.

    Plots are drawn for the first ``max_plots`` rows (callers pass them worst first): a matplotlib
    figure costs a fraction of a second, and thousands of failing cases share a cause anyway. None is
    drawn after ``plot_deadline`` (``time.monotonic()``; a nightly's time budget): the pages are still
    written, saying why they have no plot.
    """
    folder = out / CASES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    verdicts = {full_id: record.verdict for full_id, record in records.items()}
    verdicts.update({str(row["full_id"]): str(row["verdict"]) for row in rows})
    pages = {str(row["full_id"]) for row in rows}
    for i, row in enumerate(rows):
        full_id = str(row["full_id"])
        slug = case_slug(full_id)
        record = records.get(full_id)
        plot, skipped = None, ""
        if i < max_plots and has_plot(record):
            if plot_deadline is not None and time.monotonic() >= plot_deadline:
                skipped = "the time budget was spent (the worst cases are plotted first)"
            else:
                plot = f"{slug}.png"
                plot_case(record, folder / plot)  # type: ignore[arg-type]
                written.append(f"{CASES_DIR}/{plot}")
        (folder / f"{slug}.html").write_text(case_html(row, record, banner=banner, plot=plot, plot_skipped=skipped,
                                                       verdicts=verdicts, pages=pages), encoding="utf-8")
        written.append(f"{CASES_DIR}/{slug}.html")
    return written
