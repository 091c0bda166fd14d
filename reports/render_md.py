"""The report as GitHub-flavoured Markdown (matrix.md, small enough for a CI job summary).

Top to bottom: the partial-run banner, the verdict counts, links (HTML page, diff), the failure
attribution, the checkpoint tables, the cases that did not pass (each linking to its page; the expected
failures last, marked ``(expected)`` with their expectation), the cases expected to fail that passed, one
table per engine x reference x model, the unsupported cases by reason, and the per-axis tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pandas as pd
from tabulate import tabulate

from reports import resume_matrix
from reports.attribution import Attribution
from reports.case_page import case_href
from reports.matrix import (
    COUNT_LEGEND, UNEXPECTED_PASS_NOTE, ParityMatrix, Summary, cell_label, expected_failures, fmt_ratio, is_expected_row, shown_verdict,
    sort_failing, unexpected_passes,
)
from reports.render import (
    EXPECTED_NOTE, MAX_LISTED, REASON_CHARS, STATUS_ICONS, clip, headline, run_lines, verdict_line,
)


def _bad_lines(summary: Summary) -> list[str]:
    if not summary.bad_lines:
        return []
    lines = ["", f"## ⚠️ {len(summary.bad_lines)} unreadable result line(s)", "",
             "Records cut by a killed run or corrupt; their cases are missing from the tables.", ""]
    rows = [[b.path, b.line, b.reason, b.head[:80]] for b in summary.bad_lines]
    lines.append(tabulate(rows, headers=["file", "line", "reason", "start of line"], tablefmt="github", disable_numparse=True))
    return lines


def attribution_lines(attributions: Sequence[Attribution]) -> list[str]:
    """The attribution as Markdown bullets (also the summary of a CI job)."""
    lines: list[str] = []
    for a in attributions:
        if not a.failing:
            lines.append(f"- **{a.engine} vs {a.reference}**: no failing case ({a.counts()})")
            continue
        lines.append(f"- **{a.engine} vs {a.reference}**: {a.failing} failing, {a.counts('passing')}")
        lines += [f"  - {line}" for line in a.lines()]
    return lines


def expected_passes_lines(frame: pd.DataFrame) -> list[str]:
    """The cases that passed although their suite expected them to fail, with the expectation ([] for none)."""
    passed = unexpected_passes(frame)
    if passed.empty:
        return []
    rows = [[f"[{r['full_id']}]({case_href(r['full_id'])})", clip(str(r["expected_failure"]), REASON_CHARS["markdown"])[0]]
            for _, r in passed.head(MAX_LISTED).iterrows()]
    return ["", f"## Expected to fail, passed ({len(passed)})", "", f"Each of these cases {UNEXPECTED_PASS_NOTE}", "",
            tabulate(rows, headers=["case", "expected to fail because"], tablefmt="github", disable_numparse=True)]


def markdown(
    summary: Summary, matrices: Sequence[ParityMatrix], marginal_tables: Mapping[str, pd.DataFrame], frame: pd.DataFrame,
    *, attributions: Sequence[Attribution] = (), banner: str = "", links: Mapping[str, str] | None = None,
    pages: set[str] | None = None,
) -> str:
    """The whole report. ``pages``: full ids that have a case page (linked); None links every failing case."""
    head = "✅" if summary.ok else "❌"
    lines = [f"> ⚠️ **{banner}**", ""] if banner else []
    lines += [
        f"# {head} {headline(summary)}",
        "",
        verdict_line(summary),
        "",
        *run_lines(summary),
    ]
    if summary.superseded:
        lines.append(f"- {summary.superseded} older record(s) replaced by a newer record of the same case")
    if links:
        lines += ["", " · ".join(f"[{label}]({href})" for label, href in links.items())]
    lines += _bad_lines(summary)
    if attributions:
        lines += ["", "## Failure attribution", "",
                  "The fewest conjunctions of axis values that match the failing cases and no passing case.", ""]
        lines += attribution_lines(attributions)
    lines += resume_matrix.markdown_lines(frame)
    failing = sort_failing(frame[frame["verdict"] != "unsupported"]) if not frame.empty else frame
    if len(failing):
        n_expected = int(expected_failures(failing).sum())
        lines += ["", f"## Cases that did not pass ({len(failing)}{f', {n_expected} expected' if n_expected else ''})", ""]
        if n_expected:
            lines += [f"{EXPECTED_NOTE}", ""]
        rows = []
        for _, r in failing.head(MAX_LISTED).iterrows():
            paged = pages is None or r["full_id"] in pages
            case = f"[{r['full_id']}]({case_href(r['full_id'])})" if paged else r["full_id"]
            reason, cut = clip(str(r["reason"]), REASON_CHARS["markdown"])
            if cut:
                reason += f" ([whole reason]({case_href(r['full_id'])}))" if paged else " (whole reason in results.csv)"
            if is_expected_row(r):
                reason += " · **expected:** " + clip(str(r["expected_failure"]), REASON_CHARS["markdown"])[0]
            rows.append([shown_verdict(r), case, fmt_ratio(r["worst_ratio"]), r["worst_quantity"], reason])
        lines.append(tabulate(rows, headers=["verdict", "case", "ratio", "quantity", "reason"], tablefmt="github", disable_numparse=True))
        if len(failing) > MAX_LISTED:
            lines.append(f"\n… and {len(failing) - MAX_LISTED} more (see matrix.html or results.csv)")
    lines += expected_passes_lines(frame)
    lines += ["", "Cells: passed/total · worst error relative to tolerance (≤ 1 is within tolerance); "
              f"{COUNT_LEGEND}. Columns: precision, then backward prefetch."]
    for m in matrices:
        t = m.totals
        lines += ["", f"## {m.title}: {t.pass_text}, worst ratio {fmt_ratio(t.worst_ratio)}", ""]
        headers = ["strategy"] + [f"{p}<br>{b}" for p, b in m.columns]
        rows = []
        for s in m.rows:
            row = [s]
            for p, b in m.columns:
                stats = m.cell(s, p, b)
                row.append(f"{STATUS_ICONS[stats.status]} {cell_label(stats)}".strip())
            rows.append(row)
        lines.append(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    unsupported = frame[frame["verdict"] == "unsupported"] if not frame.empty else frame
    if len(unsupported):
        by_reason = unsupported.groupby(["engine", "reason"], sort=True).size().reset_index(name="cases")
        lines += ["", f"## Unsupported ({len(unsupported)})", "",
                  tabulate(by_reason.values.tolist(), headers=["engine", "reason", "cases"], tablefmt="github", disable_numparse=True)]
    if marginal_tables:
        lines += ["", "## Per axis", "", "passed/total per engine, for each value of each axis.", ""]
        for table in marginal_tables.values():
            lines += [tabulate(table.reset_index(), headers="keys", tablefmt="github", showindex=False, disable_numparse=True), ""]
    return "\n".join(lines).rstrip() + "\n"
