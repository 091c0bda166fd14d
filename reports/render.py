"""Colours, PNG heatmaps and the diff as Markdown; the report pages are ``reports.render_md`` (Markdown,
the CI job summary) and ``reports.render_html`` (the main HTML page).

Every function takes the pure tables of ``reports.matrix`` and returns text or writes one file; none
reads results. Colours are shared by the HTML and the PNGs: a cell is coloured by its worst error
relative to tolerance on a log scale (green well within, yellow at the tolerance, red beyond), unless
its status says more (errors, refusals, failures without a numeric error).
"""

from __future__ import annotations

import math

import matplotlib.colors as mcolors
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from tabulate import tabulate

from harness.cases.records import placement_text
from reports.diff import DiffResult
from reports.matrix import CellStats, ParityMatrix, Summary, fmt_ratio

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
    "flaky": "#f781bf",  # runs disagreed: failed in some, never a pass
    # every case that ran failed as its suite expected (a known engine bug): not new breakage, not a pass
    "expected": "#b2abd2",
    "empty": "#ffffff",
}
STATUS_ICONS = {"pass": "✅", "fail": "❌", "flaky": "🎲", "error": "💥", "expected": "🐛", "unsupported": "➖", "empty": ""}
#: what the pages say of expected failures.
EXPECTED_NOTE = ("A verdict marked *(expected)* is an expected failure: a known engine bug its suite holds as a strict "
                 "expectation (the reason after *expected*); listed after the others, not counted against the cells.")
#: failing cases listed per cell in HTML and in total in Markdown; the rest are counted.
MAX_LISTED = 50
#: what a reason may take in a table cell, a cell's pop-up and the Markdown table; more is clipped
#: (``clip``) and links to the case page, which holds the whole reason.
REASON_CHARS = {"table": 200, "popup": 160, "markdown": 120}


def clip(text: str, limit: int) -> tuple[str, bool]:
    """``text`` cut before ``limit`` characters, at a word boundary where there is one, ending in an
    ellipsis, and whether it was cut: a reason is never cut mid-way without saying so."""
    text = str(text)
    if len(text) <= limit:
        return text, False
    head = text[: limit - 1]
    if " " in head[limit // 2:]:
        head = head[: head.rindex(" ")]
    return head.rstrip() + "…", True


def cell_colour(stats: CellStats) -> str:
    """The hex colour of a cell; expected failures beside passes leave it coloured by the passes' ratio."""
    status = stats.status
    if status in ("error", "flaky", "expected", "unsupported", "empty"):
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
# Shared by the Markdown and HTML writers


def headline(summary: Summary) -> str:
    """``Parity report: 415/415 cases pass, 8 expected failures``: the title of both pages."""
    text = f"Parity report: {summary.verdicts.get('pass', 0)}/{summary.ran} cases pass"
    if summary.expected_failures:
        text += f", {summary.expected_failures} expected failure(s)"
    if summary.unexpected_passes:
        text += f", {summary.unexpected_passes} expected to fail passed"
    return text


def verdict_line(summary: Summary) -> str:
    """``pass: 415, error: 8, unsupported: 48; 8 of those that did not pass expected (known engine bugs,
    strict)``: the cases per verdict."""
    text = ", ".join(f"{name}: {count}" for name, count in summary.verdicts.items() if count) or "no cases"
    if summary.expected_failures:
        text += f"; {summary.expected_failures} of those that did not pass expected (known engine bugs, strict)"
    return text


def run_lines(summary: Summary) -> list[str]:
    """One Markdown bullet per run the report's records came from."""
    lines = []
    for run in summary.runs:
        where = placement_text(run.get("backend"), run.get("device"), run.get("ranks_per_gpu"))
        facts = [f"torch {run.get('torch_version')}", where, f"host {run.get('host')}"]
        if run.get("gpu"):
            facts.append(f"{run['gpu']}, NCCL {run.get('nccl_version')}")
        if run.get("git_rev"):
            facts.append(f"rev {str(run['git_rev'])[:12]}")
        lines.append(f"- run `{run.get('run_id')}`: " + ", ".join(facts))
    return lines


# ---------------------------------------------------------------------------------------------------
# PNG


def heatmap(m: ParityMatrix, path: str) -> None:
    """A PNG of one matrix: cells coloured as in the HTML, labelled ``passed/total`` and worst ratio."""
    heatmap_figure(m).savefig(path)


def _spread(fig: Figure, labels: list, rotation: float, ha: str) -> None:
    """Tilt ``labels`` (tick labels of one row) where any two overlap as drawn, so each stays readable."""
    renderer = fig.canvas.get_renderer()
    boxes = sorted((t.get_window_extent(renderer) for t in labels if t.get_text()), key=lambda b: b.x0)
    if any(a.x1 > b.x0 for a, b in zip(boxes, boxes[1:])):
        for t in labels:
            t.set_rotation(rotation)
            t.set_horizontalalignment(ha)
            t.set_rotation_mode("anchor")


def heatmap_figure(m: ParityMatrix) -> Figure:
    """The figure ``heatmap`` writes (column labels tilted where they would overlap)."""
    n_rows, n_cols = len(m.rows), len(m.columns)
    cell_w, cell_h = 0.78, 0.62
    fig_w = max(6.0, 2.4 + n_cols * cell_w + 1.6)
    fig_h = max(3.2, 1.9 + n_rows * cell_h + 0.9)
    # A bare Figure (no pyplot): no global figure registry to leak into, and PNGs render with Agg
    # whatever backend the calling process chose.
    fig = Figure(figsize=(fig_w, fig_h), dpi=110)
    FigureCanvasAgg(fig)  # a renderer to measure labels with (``_spread``)
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
            elif stats.status == "expected":
                text = f"xfail\n{stats.expected}"
            else:
                detail = stats.worst_verdict if stats.status in ("error", "flaky") else fmt_ratio(stats.worst_ratio)
                text = f"{stats.passed}/{stats.total}\n{detail}" + (f"\n+{stats.expected}x" if stats.expected else "")
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
    ax.set_title(f"{m.title}: {t.pass_text}, worst ratio {fmt_ratio(t.worst_ratio)}",
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
        Patch(facecolor=STATUS_COLOURS["flaky"], edgecolor="black", label="flaky (runs disagree)"),
        Patch(facecolor=STATUS_COLOURS["expected"], edgecolor="black", label="expected failures (+Nx)"),
        Patch(facecolor=STATUS_COLOURS["unsupported"], edgecolor="black", label="unsupported"),
        Patch(facecolor=STATUS_COLOURS["empty"], edgecolor="black", label="no cases"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    _spread(fig, ax.get_xticklabels(), 30, "right")
    _spread(fig, top.get_xticklabels(), 30, "left")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    return fig


# ---------------------------------------------------------------------------------------------------
# Diff


def diff_markdown(result: DiffResult, old: str, new: str) -> str:
    """A diff as Markdown: regressions first, then fixes, new cells and cases, removed, other changes."""
    counts = {k: len(result.of_kind(k)) for k in ("regression", "fix", "new", "not_run", "removed", "changed")}
    new_failing = len(result.new_failing)
    # New failing cases do not block (reports.diff), but a headline over them is never green; nor one
    # over unreadable lines: a regressed case cut there would read as removed.
    bad = len(result.bad_lines)
    head = "❌" if result.exit_code else "⚠️" if new_failing or bad else "✅"
    lines = [
        f"# {head} Parity diff: {counts['regression']} regression(s), {new_failing} new failing case(s), "
        f"{counts['fix']} fix(es)" + (f", {bad} unreadable line(s) not compared" if bad else ""),
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
                 fmt_ratio(c.new_ratio) if c.new_ratio is not None else "-", clip(c.reason, REASON_CHARS["markdown"])[0]]
                for c in changes]
        lines.extend(["", f"## {title} ({len(changes)})", "",
                      tabulate(rows, headers=["change", "case", "old ratio", "new ratio", "reason"], tablefmt="github", disable_numparse=True)])

    section("Regressions", result.of_kind("regression"))
    section("Fixes", result.of_kind("fix"))
    if result.new_cells:
        lines += ["", f"## New cells ({len(result.new_cells)})", ""] + [f"- {c}" for c in result.new_cells]
    section("New cases", result.of_kind("new"))
    section("Not run (selected, not run by the new run)", result.of_kind("not_run"))
    section("Removed cases", result.of_kind("removed"))
    section("Other changes", result.of_kind("changed"))
    if not result.changes:
        lines += ["", "No changes."]
    return "\n".join(lines) + "\n"
