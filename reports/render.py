"""Writers: the parity tables as Markdown (CI job summary), HTML (one self-contained page), PNG heatmaps.

Every function takes the pure tables of ``reports.matrix`` and returns text or writes one file; none
reads results. Colours are shared by the HTML and the PNGs: a cell is coloured by its worst error
relative to tolerance on a log scale (green well within, yellow at the tolerance, red beyond), unless
its status says more (errors, refusals, failures without a numeric error).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import matplotlib.colors as mcolors
import numpy as np
import pandas as pd
from matplotlib.cm import ScalarMappable
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from tabulate import tabulate

from reports import resume_matrix
from reports.diff import DiffResult
from reports.matrix import (
    CellStats,
    ParityMatrix,
    Summary,
    cell_label,
    fmt_ratio,
    sort_failing,
)

#: log10 of the worst ratio spans this range on the colour scale; beyond it colours saturate.
LOG_RATIO_RANGE = 3.0


def _ratio_cmap() -> mcolors.ListedColormap:
    # Green to yellow up to the tolerance (the lower half), then a jump to red (the upper half): a
    # failing cell must never look nearly fine, however little it exceeds the tolerance.
    below = mcolors.LinearSegmentedColormap.from_list("below", ["#006837", "#66bd63", "#d9ef8b", "#fee08b"])
    above = mcolors.LinearSegmentedColormap.from_list("above", ["#f46d43", "#d73027", "#a50026"])
    half = np.linspace(0.0, 1.0, 128)
    return mcolors.ListedColormap(np.vstack([below(half), above(half)]), name="parity_ratio")


RATIO_CMAP = _ratio_cmap()
RATIO_NORM = mcolors.TwoSlopeNorm(vmin=-LOG_RATIO_RANGE, vcenter=0.0, vmax=LOG_RATIO_RANGE)
#: colours of statuses a ratio cannot express.
STATUS_COLOURS = {
    "error": "#5b2a86",  # error, timeout or crash: the case did not finish
    "fail_no_ratio": "#d73027",  # failed on something other than a numeric error (e.g. a dtype check)
    "unsupported": "#bdbdbd",
    "empty": "#ffffff",
}
STATUS_ICONS = {"pass": "✅", "fail": "❌", "error": "💥", "unsupported": "➖", "empty": ""}
#: failing cases listed per cell in HTML and in total in Markdown; the rest are counted.
MAX_LISTED = 50


def cell_colour(stats: CellStats) -> str:
    """The hex colour of a cell."""
    status = stats.status
    if status in ("error", "unsupported", "empty"):
        return STATUS_COLOURS[status]
    ratio = stats.worst_ratio
    if math.isnan(ratio):
        return STATUS_COLOURS["fail_no_ratio"] if status == "fail" else mcolors.to_hex(RATIO_CMAP(RATIO_NORM(-LOG_RATIO_RANGE)))
    if status == "fail" and ratio <= 1:
        return STATUS_COLOURS["fail_no_ratio"]  # numbers within tolerance, yet failed: do not paint it green
    log_ratio = -LOG_RATIO_RANGE if ratio <= 0 else max(-LOG_RATIO_RANGE, min(LOG_RATIO_RANGE, math.log10(ratio)))
    if status == "pass":
        log_ratio = min(log_ratio, -1e-6)  # exactly at the tolerance still passes: keep it on the pass side
    return mcolors.to_hex(RATIO_CMAP(RATIO_NORM(log_ratio)))


def _text_colour(background: str) -> str:
    r, g, b = mcolors.to_rgb(background)
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 0.5 else "#ffffff"


# ---------------------------------------------------------------------------------------------------
# Markdown


def _md_run_lines(summary: Summary) -> list[str]:
    lines = []
    for run in summary.runs:
        facts = [f"torch {run.get('torch_version')}", f"backend {run.get('backend')}", f"host {run.get('host')}"]
        if run.get("gpu"):
            facts.append(f"{run['gpu']}, NCCL {run.get('nccl_version')}")
        if run.get("git_rev"):
            facts.append(f"rev {str(run['git_rev'])[:12]}")
        lines.append(f"- run `{run.get('run_id')}`: " + ", ".join(facts))
    return lines


def _md_bad_lines(summary: Summary) -> list[str]:
    if not summary.bad_lines:
        return []
    lines = ["", f"## ⚠️ {len(summary.bad_lines)} unreadable result line(s)", "",
             "Records cut by a killed run or corrupt; their cases are missing from the tables.", ""]
    rows = [[b.path, b.line, b.reason, b.head[:80]] for b in summary.bad_lines]
    lines.append(tabulate(rows, headers=["file", "line", "reason", "start of line"], tablefmt="github", disable_numparse=True))
    return lines


def markdown(summary: Summary, matrices: Sequence[ParityMatrix], marginal_tables: dict[str, pd.DataFrame], frame: pd.DataFrame) -> str:
    """The whole report as GitHub-flavoured Markdown, small enough for a CI job summary."""
    v = summary.verdicts
    ran = sum(v.values()) - v.get("unsupported", 0)
    head = "✅" if summary.ok else "❌"
    lines = [
        f"# {head} Parity report: {v.get('pass', 0)}/{ran} cases pass",
        "",
        ", ".join(f"{name}: {count}" for name, count in v.items() if count) or "no cases",
        "",
        *_md_run_lines(summary),
    ]
    if summary.superseded:
        lines.append(f"- {summary.superseded} older record(s) replaced by a newer record of the same case")
    lines += _md_bad_lines(summary)
    lines += ["", "Cells: passed/total · worst error relative to tolerance (≤ 1 is within tolerance); "
              "`+Nu`: N unsupported. Columns: precision, then backward prefetch."]
    for m in matrices:
        t = m.totals
        lines += ["", f"## {m.title}: {t.passed}/{t.total} pass, worst ratio {fmt_ratio(t.worst_ratio)}", ""]
        headers = ["strategy"] + [f"{p}<br>{b}" for p, b in m.columns]
        rows = []
        for s in m.rows:
            row = [s]
            for p, b in m.columns:
                stats = m.cell(s, p, b)
                label = cell_label(stats)
                row.append(f"{STATUS_ICONS[stats.status]} {label}".strip())
            rows.append(row)
        lines.append(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
    lines += resume_matrix.markdown_lines(frame)
    failing = sort_failing(frame[frame["verdict"] != "unsupported"])
    if len(failing):
        lines += ["", f"## Cases that did not pass ({len(failing)})", ""]
        rows = [
            [r["verdict"], r["full_id"], fmt_ratio(r["worst_ratio"]), r["worst_quantity"], str(r["reason"])[:120]]
            for _, r in failing.head(MAX_LISTED).iterrows()
        ]
        lines.append(tabulate(rows, headers=["verdict", "case", "ratio", "quantity", "reason"], tablefmt="github", disable_numparse=True))
        if len(failing) > MAX_LISTED:
            lines.append(f"\n… and {len(failing) - MAX_LISTED} more (see matrix.html or results.csv)")
    unsupported = frame[frame["verdict"] == "unsupported"]
    if len(unsupported):
        by_reason = unsupported.groupby(["engine", "reason"], sort=True).size().reset_index(name="cases")
        lines += ["", f"## Unsupported ({len(unsupported)})", "",
                  tabulate(by_reason.values.tolist(), headers=["engine", "reason", "cases"], tablefmt="github", disable_numparse=True)]
    if marginal_tables:
        lines += ["", "## Per axis", "", "passed/total per engine, for each value of each axis.", ""]
        for axis, table in marginal_tables.items():
            lines += [tabulate(table.reset_index(), headers="keys", tablefmt="github", showindex=False, disable_numparse=True), ""]
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------------------------------------------
# HTML

_CSS = """
body { font-family: system-ui, sans-serif; margin: 1.5em; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }
th, td { border: 1px solid #999; padding: 3px 6px; text-align: center; vertical-align: top; }
th { background: #f0f0f0; }
td.row { text-align: left; font-weight: bold; background: #f7f7f7; }
td.cell { min-width: 5.5em; }
details summary { cursor: pointer; }
details ul { text-align: left; margin: 4px 0; padding-left: 1.2em; font-size: 11px; max-width: 40em; }
.warn { background: #fff3cd; border: 1px solid #e0b000; padding: 0.5em 1em; }
.legend span { display: inline-block; padding: 2px 8px; margin-right: 6px; border: 1px solid #999; }
code { font-size: 12px; }
"""


def _html_cell(m: ParityMatrix, strategy: str, precision: str, prefetch: str) -> str:
    stats = m.cell(strategy, precision, prefetch)
    colour = cell_colour(stats)
    style = f"background:{colour};color:{_text_colour(colour)}"
    label = html.escape(cell_label(stats))
    bad = sort_failing(m.cell_cases(strategy, precision, prefetch))
    if bad.empty:
        return f'<td class="cell" style="{style}">{label}</td>'
    items = []
    for _, r in bad.head(MAX_LISTED).iterrows():
        items.append(
            f"<li><b>{html.escape(r['verdict'])}</b> <code>{html.escape(r['case_id'])}</code>"
            + (f" ratio {html.escape(fmt_ratio(r['worst_ratio']))}" if not math.isnan(r["worst_ratio"]) else "")
            + (f" ({html.escape(r['worst_quantity'])})" if r["worst_quantity"] else "")
            + (f": {html.escape(str(r['reason']))}" if r["reason"] else "")
            + "</li>"
        )
    if len(bad) > MAX_LISTED:
        items.append(f"<li>… and {len(bad) - MAX_LISTED} more</li>")
    return (
        f'<td class="cell" style="{style}"><details><summary>{label}</summary>'
        f'<ul style="color:#222;background:#fff">{"".join(items)}</ul></details></td>'
    )


def _html_matrix(m: ParityMatrix) -> str:
    t = m.totals
    parts = [f"<h2>{html.escape(m.title)}: {t.passed}/{t.total} pass, worst ratio {fmt_ratio(t.worst_ratio)}</h2>",
             "<table><tr><th rowspan=2>strategy</th>"]
    parts += [f'<th colspan="{len(m.prefetches)}">{html.escape(p)}</th>' for p in m.precisions]
    parts.append("</tr><tr>")
    parts += [f"<th>bwd {html.escape(b)}</th>" for _, b in m.columns]
    parts.append("</tr>")
    for s in m.rows:
        parts.append(f'<tr><td class="row">{html.escape(s)}</td>')
        parts += [_html_cell(m, s, p, b) for p, b in m.columns]
        parts.append("</tr>")
    parts.append("</table>")
    return "".join(parts)


def _html_legend() -> str:
    samples = [
        ("within tolerance (ratio 0.01)", cell_colour(CellStats(passed=1, worst_ratio=0.01))),
        ("at tolerance (ratio 1)", cell_colour(CellStats(passed=1, worst_ratio=1.0))),
        ("beyond (ratio 100)", cell_colour(CellStats(failed=1, worst_ratio=100.0))),
        ("failed, no numeric error", STATUS_COLOURS["fail_no_ratio"]),
        ("error / timeout / crash", STATUS_COLOURS["error"]),
        ("unsupported", STATUS_COLOURS["unsupported"]),
    ]
    spans = "".join(
        f'<span style="background:{c};color:{_text_colour(c)}">{html.escape(name)}</span>' for name, c in samples
    )
    return f'<p class="legend">{spans}</p>'


def html_page(
    summary: Summary, matrices: Sequence[ParityMatrix], marginal_tables: dict[str, pd.DataFrame],
    frame: pd.DataFrame | None = None,
) -> str:
    """One self-contained page (inline CSS, no scripts): a failing cell opens its failing cases."""
    v = summary.verdicts
    ran = sum(v.values()) - v.get("unsupported", 0)
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>Parity report</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>Parity report: {v.get('pass', 0)}/{ran} cases pass</h1>",
        "<p>" + html.escape(", ".join(f"{k}: {n}" for k, n in v.items() if n) or "no cases") + "</p>",
        "<ul>" + "".join(f"<li>{html.escape(line[2:])}</li>" for line in _md_run_lines(summary)) + "</ul>",
    ]
    if summary.superseded:
        parts.append(f"<p>{summary.superseded} older record(s) replaced by a newer record of the same case.</p>")
    if summary.bad_lines:
        rows = "".join(
            f"<tr><td>{html.escape(b.path)}</td><td>{b.line}</td><td>{html.escape(b.reason)}</td>"
            f"<td><code>{html.escape(b.head)}</code></td></tr>"
            for b in summary.bad_lines
        )
        parts.append(
            f'<div class="warn"><h2>⚠️ {len(summary.bad_lines)} unreadable result line(s)</h2>'
            "<p>Records cut by a killed run or corrupt; their cases are missing from the tables.</p>"
            f"<table><tr><th>file</th><th>line</th><th>reason</th><th>start of line</th></tr>{rows}</table></div>"
        )
    parts.append(
        "<p>Cells: passed/total · worst error relative to tolerance (≤ 1 is within tolerance); "
        "<code>+Nu</code>: N unsupported. Click a cell to list the cases that did not pass.</p>"
    )
    parts.append(_html_legend())
    parts += [_html_matrix(m) for m in matrices]
    if frame is not None:
        parts.append(resume_matrix.html_section(frame))
    if marginal_tables:
        parts.append("<h2>Per axis</h2><p>passed/total per engine, for each value of each axis.</p>")
        for axis, table in marginal_tables.items():
            parts.append(table.to_html(escape=True, border=0))
    parts.append("</body></html>")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------
# PNG


def heatmap(m: ParityMatrix, path: str) -> None:
    """A PNG of one matrix: cells coloured as in the HTML, labelled ``passed/total`` and worst ratio."""
    n_rows, n_cols = len(m.rows), len(m.columns)
    cell_w, cell_h = 0.78, 0.62
    fig_w = max(6.0, 2.4 + n_cols * cell_w + 1.6)
    fig_h = max(3.2, 1.9 + n_rows * cell_h + 0.9)
    # A bare Figure (no pyplot): no global figure registry to leak into, and PNGs render with Agg
    # whatever backend the calling process chose.
    fig = Figure(figsize=(fig_w, fig_h), dpi=110)
    ax = fig.subplots()
    image = [[mcolors.to_rgb(cell_colour(m.cell(s, p, b))) for p, b in m.columns] for s in m.rows]
    ax.imshow(image, aspect="auto", interpolation="nearest")
    for i, s in enumerate(m.rows):
        for j, (p, b) in enumerate(m.columns):
            stats = m.cell(s, p, b)
            if stats.status == "empty":
                continue
            if stats.status == "unsupported":
                text = "unsup"
            else:
                detail = stats.worst_verdict if stats.status == "error" else fmt_ratio(stats.worst_ratio)
                text = f"{stats.passed}/{stats.total}\n{detail}"
            ax.text(j, i, text, ha="center", va="center", fontsize=7.5,
                    color=_text_colour(cell_colour(stats)), linespacing=1.15)
    ax.set_yticks(range(n_rows), labels=m.rows, fontsize=9)
    ax.set_xticks(range(n_cols), labels=[b for _, b in m.columns], fontsize=7.5, rotation=0)
    ax.set_xlabel("backward prefetch, grouped by precision config", fontsize=9)
    ax.tick_params(length=0)
    # Cell grid, with heavier lines between precision groups.
    group = len(m.prefetches)
    for j in range(1, n_cols):
        ax.axvline(j - 0.5, color="black" if j % group == 0 else "#888888", lw=1.4 if j % group == 0 else 0.4)
    for i in range(1, n_rows):
        ax.axhline(i - 0.5, color="#888888", lw=0.4)
    top = ax.secondary_xaxis("top")
    centres = [k * group + (group - 1) / 2 for k in range(len(m.precisions))]
    top.set_xticks(centres, labels=m.precisions, fontsize=8.5)
    top.tick_params(length=0)
    t = m.totals
    ax.set_title(f"{m.title}: {t.passed}/{t.total} pass, worst ratio {fmt_ratio(t.worst_ratio)}",
                 fontsize=11, pad=22)

    mappable = ScalarMappable(norm=RATIO_NORM, cmap=RATIO_CMAP)
    bar = fig.colorbar(mappable, ax=ax, fraction=0.035, pad=0.015)
    ticks = list(range(-int(LOG_RATIO_RANGE), int(LOG_RATIO_RANGE) + 1))
    labels = [f"{10.0 ** k:g}" for k in ticks]
    labels[0], labels[-1] = "≤" + labels[0], "≥" + labels[-1]  # the scale saturates at both ends
    bar.set_ticks(ticks, labels=labels)
    bar.ax.tick_params(labelsize=7.5)
    bar.set_label("worst error / tolerance (log)", fontsize=8.5)
    legend = [
        Patch(facecolor=STATUS_COLOURS["fail_no_ratio"], edgecolor="black", label="failed (no numeric error)"),
        Patch(facecolor=STATUS_COLOURS["error"], edgecolor="black", label="error / timeout / crash"),
        Patch(facecolor=STATUS_COLOURS["unsupported"], edgecolor="black", label="unsupported"),
        Patch(facecolor=STATUS_COLOURS["empty"], edgecolor="black", label="no cases"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path)


# ---------------------------------------------------------------------------------------------------
# Diff


def diff_markdown(result: DiffResult, old: str, new: str) -> str:
    """A diff as Markdown: regressions first, then fixes, new cells and cases, removed, other changes."""
    counts = {k: len(result.of_kind(k)) for k in ("regression", "fix", "new", "removed", "changed")}
    head = "❌" if result.exit_code else "✅"
    lines = [
        f"# {head} Parity diff: {counts['regression']} regression(s), {counts['fix']} fix(es)",
        "",
        f"old: `{old}` ({result.old_cases} cases) → new: `{new}` ({result.new_cases} cases)",
    ]
    if result.bad_lines:
        lines += ["", f"⚠️ {len(result.bad_lines)} unreadable result line(s); their cases are missing from the diff:"]
        lines += [f"- {b}" for b in result.bad_lines[:MAX_LISTED]]

    def section(title: str, changes: list) -> None:
        if not changes:
            return
        rows = [[c.what, c.full_id, fmt_ratio(c.old_ratio) if c.old_ratio is not None else "-",
                 fmt_ratio(c.new_ratio) if c.new_ratio is not None else "-", c.reason[:100]] for c in changes]
        lines.extend(["", f"## {title} ({len(changes)})", "",
                      tabulate(rows, headers=["change", "case", "old ratio", "new ratio", "reason"], tablefmt="github", disable_numparse=True)])

    section("Regressions", result.of_kind("regression"))
    section("Fixes", result.of_kind("fix"))
    if result.new_cells:
        lines += ["", f"## New cells ({len(result.new_cells)})", ""] + [f"- {c}" for c in result.new_cells]
    section("New cases", result.of_kind("new"))
    section("Removed cases", result.of_kind("removed"))
    section("Other changes", result.of_kind("changed"))
    if not result.changes:
        lines += ["", "No changes."]
    return "\n".join(lines) + "\n"
