"""The report's main HTML page: banner, attribution, the comparison grid with filters, failing cases.

Self-contained (inline CSS, a small inline script for the filters, images next to the page). The grid
(``reports.grid``) puts every engine under the same columns; a cell opens the cases that did not pass,
each linking to its page (``reports.case_page``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import pandas as pd

from reports import resume_matrix
from reports.attribution import Attribution
from reports.case_page import case_href
from reports.grid import Grid, GridCell, GridRow, GridSection
from reports.matrix import (
    COUNT_LEGEND, UNEXPECTED_PASS_NOTE, CellStats, ParityMatrix, Summary, expected_failures, fmt_ratio, is_expected_row, shown_verdict,
    sort_failing, unexpected_passes,
)
from reports.page import banner_html, esc, page
from reports.render import (
    EXPECTED_NOTE, REASON_CHARS, STATUS_COLOURS, _text_colour, cell_colour, clip, headline, run_lines,
    verdict_line,
)

#: failing cases listed per cell and in the failing-cases table; the rest are counted.
MAX_LISTED = 50
MAX_FAILING_TABLE = 300

#: Looks of the cell states a ratio cannot express (see ``reports.grid``).
STATE_STYLES = {
    "absent": "background:repeating-linear-gradient(45deg,#fff 0 5px,#e8e8e8 5px 10px);color:#777",
    "not_run": "background:#dbe9f6;color:#1f4e79;border:2px dashed #1f4e79",
    "unsupported": f"background:{STATUS_COLOURS['unsupported']};color:#000",
}
STATE_LABELS = {"absent": "not in matrix", "not_run": "not run", "unsupported": "unsup."}

GRID_CSS = """
.gridwrap { overflow: auto; max-height: 80vh; max-width: 100%; border: 1px solid #bbb; }
table.grid { margin: 0; font-size: 11px; border-collapse: separate; border-spacing: 0; }
table.grid th, table.grid td { border: 0; border-right: 1px solid #bbb; border-bottom: 1px solid #bbb; padding: 2px 3px; }
table.grid thead th { position: sticky; z-index: 2; background: #eee; }
table.grid thead tr:first-child th { top: 0; height: 16px; }
table.grid thead tr:nth-child(2) th { top: 21px; }
table.grid .sticky1 { position: sticky; left: 0; z-index: 1; background: #f7f7f7; text-align: left; min-width: 7.5em; }
table.grid .sticky2 { position: sticky; left: 7.9em; z-index: 1; background: #f7f7f7; text-align: left; min-width: 6.5em; }
table.grid thead .sticky1, table.grid thead .sticky2 { z-index: 3; }
table.grid tr.section th { text-align: left; background: #dde; font-size: 12px; position: sticky; left: 0; }
table.grid td.cell { min-width: 3.6em; line-height: 1.25; }
table.grid tr.first td, table.grid tr.first th { border-top: 2px solid #555; }
.filters { margin: 0.4em 0; font-size: 13px; } .filters select { margin-right: 1em; }
table.grid summary { list-style: none; text-decoration: underline dotted; }
table.grid summary::-webkit-details-marker { display: none; }
table.grid details[open] summary { outline: 2px solid #000; outline-offset: 1px; }
/* A strategy's label is on every row, so an engine filter never hides it; repeats are grey. */
table.grid tr.g:not(.first) th.sticky1 { color: #999; font-weight: normal; }
/* An opened cell's list floats over the grid: the column keeps its width, the others stay in view. */
table.grid td.cell { position: relative; }
table.grid details[open] > ul { position: absolute; z-index: 4; left: 0; top: 100%; width: max-content;
  max-width: 36em; margin: 0; padding: 0.4em 0.6em 0.4em 1.6em; text-align: left; white-space: normal;
  border: 1px solid #555; box-shadow: 0 2px 8px rgba(0, 0, 0, 0.3); font-size: 12px; }
"""

FILTER_JS = """
function applyFilters() {
  var e = document.getElementById('f-engine').value, m = document.getElementById('f-model').value,
      v = document.getElementById('f-verdict').value, shown = 0;
  document.querySelectorAll('table.grid tbody').forEach(function (body) {
    var any = false;
    body.querySelectorAll('tr.g').forEach(function (tr) {
      var ok = (!e || tr.dataset.engine === e) && (!m || tr.dataset.model === m) &&
               (!v || (' ' + tr.dataset.states + ' ').indexOf(' ' + v + ' ') >= 0);
      tr.style.display = ok ? '' : 'none';
      if (ok) { any = true; shown++; }
    });
    body.style.display = any ? '' : 'none';
  });
  document.getElementById('f-count').textContent = shown + ' row(s)';
}
// A section of the grid lives inside the grid's own scroll box (which keeps the header sticky): bring
// the box into view, then scroll the box itself so the section sits under the header.
function showSection(id) {
  var row = document.getElementById(id), box = document.querySelector('.gridwrap');
  if (!row || !box) return false;
  box.scrollIntoView();
  box.scrollTop = row.offsetTop - box.querySelector('thead').offsetHeight;
  return true;
}
// An opened cell's list floats (it keeps the column widths); it opens leftwards where it would leave the
// grid's box on the right.
function placeList(details) {
  var ul = details.querySelector('ul'), box = document.querySelector('.gridwrap');
  if (!details.open || !ul || !box) return;
  ul.style.left = '0'; ul.style.right = 'auto';
  if (ul.getBoundingClientRect().right > box.getBoundingClientRect().right) { ul.style.left = 'auto'; ul.style.right = '0'; }
}
document.addEventListener('DOMContentLoaded', function () {
  document.querySelectorAll('table.grid td.cell details').forEach(function (d) {
    d.addEventListener('toggle', function () { placeList(d); });
  });
  ['f-engine', 'f-model', 'f-verdict'].forEach(function (id) {
    document.getElementById(id).addEventListener('change', applyFilters);
  });
  applyFilters();
  document.querySelectorAll('a[href^="#grid-"]').forEach(function (a) {
    a.addEventListener('click', function (e) { if (showSection(a.getAttribute('href').slice(1))) e.preventDefault(); });
  });
});
window.addEventListener('load', function () {
  if (location.hash.indexOf('#grid-') === 0) showSection(location.hash.slice(1));
});
"""


def _cell_style(cell: GridCell) -> str:
    if cell.state in STATE_STYLES:
        return STATE_STYLES[cell.state]
    colour = cell_colour(cell.stats)
    return f"background:{colour};color:{_text_colour(colour)}"


def _reason_html(row: pd.Series, where: str) -> str:
    """A case's reason, clipped for ``where`` (``REASON_CHARS``) with a link to the whole one on its page;
    an expected failure's expectation after it."""
    text, cut = clip(str(row["reason"]), REASON_CHARS[where])
    more = f' <a class="whole-reason" href="{esc(case_href(row["full_id"]))}">(whole reason)</a>' if cut else ""
    if is_expected_row(row):
        more += f'<br><i>expected:</i> {esc(clip(str(row["expected_failure"]), REASON_CHARS[where])[0])}'
    return esc(text) + more


def _case_list(bad: pd.DataFrame) -> str:
    items = []
    for _, r in bad.head(MAX_LISTED).iterrows():
        ratio = f" {esc(fmt_ratio(r['worst_ratio']))}" if not math.isnan(r["worst_ratio"]) else ""
        items.append(f'<li><a href="{esc(case_href(r["full_id"]))}"><b>{esc(shown_verdict(r))}</b>{ratio} '
                     f'<code>{esc(r["case_id"])}</code></a>'
                     + (f": {_reason_html(r, 'popup')}" if r["reason"] or is_expected_row(r) else "") + "</li>")
    if len(bad) > MAX_LISTED:
        items.append(f"<li>… and {len(bad) - MAX_LISTED} more</li>")
    return f'<ul style="color:#222;background:#fff">{"".join(items)}</ul>'


def _grid_cell(section: GridSection, row: GridRow, precision: str, prefetch: str) -> str:
    cell = row.cells[(precision, prefetch)]
    style = _cell_style(cell)
    state = cell.state
    if state in STATE_LABELS:
        n = cell.not_run if state == "not_run" else cell.stats.unsupported
        label = STATE_LABELS[state] + (f" ({n})" if n else "")
        # An empty hatched cell reads faster than the same words in every cell; the tooltip and legend name it.
        text = "" if state == "absent" else esc(STATE_LABELS[state]) + (f"<br>{n}" if n else "")
        return f'<td class="cell {state}" style="{style}" title="{esc(label)}">{text}</td>'
    s = cell.stats
    extra = (f"<br>+{s.unsupported}u" if s.unsupported else "") + (f"<br>+{cell.not_run} not run" if cell.not_run else "")
    if state == "expected":
        label = f"expected<br>{s.expected}x{extra}"
    else:
        detail = s.worst_verdict if s.status in ("error", "flaky") else fmt_ratio(s.worst_ratio)
        label = f"{s.passed}/{s.total}<br>{esc(detail)}{f'<br>+{s.expected}x' if s.expected else ''}{extra}"
    bad = sort_failing(section.cell_cases(row, precision, prefetch))
    if bad.empty:
        return f'<td class="cell {state}" style="{style}">{label}</td>'
    return f'<td class="cell {state}" style="{style}"><details><summary>{label}</summary>{_case_list(bad)}</details></td>'


def grid_html(grid: Grid) -> str:
    """The grid: one tbody per (reference, model), one row per strategy and engine, shared columns."""
    if not grid.sections:
        return "<p>No cases.</p>"
    cols = grid.columns
    head = ['<thead><tr><th class="sticky1" rowspan=2>strategy</th><th class="sticky2" rowspan=2>engine</th>']
    head += [f'<th colspan="{len(grid.prefetches)}">{esc(p)}</th>' for p in grid.precisions]
    head.append("</tr><tr>")
    head += [f"<th>bwd {esc(b)}</th>" for _, b in cols]
    head.append("</tr></thead>")
    bodies = []
    for section in grid.sections:
        rows = [f'<tr class="section" id="{esc(section.anchor)}"><th colspan="{len(cols) + 2}">{esc(section.title)}</th></tr>']
        previous = None
        for row in section.rows:
            first = row.strategy != previous
            previous = row.strategy
            states = " ".join(sorted(row.states()))
            cells = "".join(_grid_cell(section, row, p, b) for p, b in cols)
            rows.append(
                f'<tr class="g{" first" if first else ""}" data-engine="{esc(row.engine)}" data-model="{esc(row.model)}" '
                f'data-states="{esc(states)}"><th class="sticky1">{esc(row.strategy)}</th>'
                f'<th class="sticky2">{esc(row.engine)}</th>{cells}</tr>'
            )
        bodies.append(f'<tbody data-model="{esc(section.model)}">{"".join(rows)}</tbody>')
    return f'<div class="gridwrap"><table class="grid">{"".join(head)}{"".join(bodies)}</table></div>'


def _filters(grid: Grid) -> str:
    def select(ident: str, label: str, options: Sequence[tuple[str, str]]) -> str:
        opts = "".join(f'<option value="{esc(v)}">{esc(t)}</option>' for v, t in options)
        return f'<label>{esc(label)} <select id="{ident}"><option value="">all</option>{opts}</select></label>'

    verdicts = [("fail", "with a failure"), ("error", "with an error/timeout/crash"), ("pass", "with a pass"),
                ("expected", "with only expected failures"), ("unsupported", "with unsupported"),
                ("not_run", "with not run"), ("absent", "with not in matrix")]
    return ('<div class="filters">' + select("f-engine", "engine", [(e, e) for e in grid.engines])
            + select("f-model", "model", [(m, m) for m in grid.models])
            + select("f-verdict", "rows", verdicts) + ' <span id="f-count"></span></div>')


def legend_html() -> str:
    samples = [
        ("within tolerance (ratio 0.01)", f"background:{cell_colour(CellStats(passed=1, worst_ratio=0.01))}"),
        ("at tolerance (ratio 1)", f"background:{cell_colour(CellStats(passed=1, worst_ratio=1.0))}"),
        ("beyond (ratio 100)", f"background:{cell_colour(CellStats(failed=1, worst_ratio=100.0))};color:#fff"),
        ("failed, no numeric error", f"background:{STATUS_COLOURS['fail_no_ratio']};color:#fff"),
        ("error / timeout / crash", f"background:{STATUS_COLOURS['error']};color:#fff"),
        ("flaky: runs disagree", f"background:{STATUS_COLOURS['flaky']};color:#000"),
        ("expected: every case that ran failed as expected (known engine bug)", f"background:{STATUS_COLOURS['expected']};color:#000"),
        ("unsupported: the engine refused every case", STATE_STYLES["unsupported"]),
        ("not run: selected, left out (budget)", STATE_STYLES["not_run"]),
        ("not in the matrix: no such case generated", STATE_STYLES["absent"]),
    ]
    return '<p class="legend">' + "".join(f'<span style="{s}">{esc(n)}</span>' for n, s in samples) + "</p>"


def _code(markdown: str) -> str:
    """Markdown's `code` spans as HTML."""
    return "".join(f"<code>{esc(part)}</code>" if i % 2 else esc(part) for i, part in enumerate(markdown.split("`")))


def attribution_html(attributions: Sequence[Attribution]) -> str:
    if not attributions:
        return "<p>No cases.</p>"
    items = []
    for a in attributions:
        head = f"<b>{esc(a.engine)} vs {esc(a.reference)}</b>: "
        if not a.failing:
            items.append(f"<li>{head}no failing case ({esc(a.counts())})</li>")
            continue
        terms = "".join(f"<li><b>{esc(line)}</b></li>" for line in a.evidence())
        terms += "".join(f"<li><code>{esc(t.text)}</code>: {t.covered}/{a.failing} failing, no passing case</li>" for t in a.terms)
        if a.unexplained:
            shown = ", ".join(f'<a href="{esc(case_href(i))}"><code>{esc(i.split(":", 2)[-1])}</code></a>' for i in a.unexplained[:8])
            more = f" … and {len(a.unexplained) - 8} more" if len(a.unexplained) > 8 else ""
            terms += (f"<li>{len(a.unexplained)}/{a.failing} failing not separated from passing cases by "
                      f"≤ {a.max_literals} axis values shared by 2+ failing cases: {shown}{more}</li>")
            if a.shared is not None:
                terms += f"<li>{a.shared.line(lambda text: f'<code>{esc(text)}</code>')}</li>"
        items.append(f"<li>{head}{a.failing} failing, {esc(a.counts('passing'))}<ul>{terms}</ul></li>")
    return f"<ul>{''.join(items)}</ul>"


def failing_table_html(frame: pd.DataFrame) -> str:
    failing = sort_failing(frame[frame["verdict"] != "unsupported"]) if not frame.empty else frame
    if failing.empty:
        return "<p>Every case that ran passed.</p>"
    note = f"<p>{esc(EXPECTED_NOTE).replace('*', '')}</p>" if expected_failures(failing).any() else ""
    rows = "".join(
        f'<tr><td>{esc(shown_verdict(r))}</td><td class="left"><a href="{esc(case_href(r["full_id"]))}"><code>{esc(r["full_id"])}</code></a></td>'
        f'<td>{esc(fmt_ratio(r["worst_ratio"]))}</td><td class="left">{esc(r["worst_quantity"])}</td>'
        f'<td class="left">{_reason_html(r, "table")}</td></tr>'
        for _, r in failing.head(MAX_FAILING_TABLE).iterrows()
    )
    more = f"<p>… and {len(failing) - MAX_FAILING_TABLE} more in results.csv.</p>" if len(failing) > MAX_FAILING_TABLE else ""
    return (f"{note}<table><tr><th>verdict</th><th>case</th><th>ratio</th><th>quantity</th><th>reason</th></tr>"
            f"{rows}</table>{more}")


def expected_passes_html(frame: pd.DataFrame) -> str:
    """The cases that passed although their suite expected them to fail ("" for none)."""
    passed = unexpected_passes(frame)
    if passed.empty:
        return ""
    rows = "".join(
        f'<tr><td class="left"><a href="{esc(case_href(r["full_id"]))}"><code>{esc(r["full_id"])}</code></a></td>'
        f'<td class="left">{esc(clip(str(r["expected_failure"]), REASON_CHARS["table"])[0])}</td></tr>'
        for _, r in passed.head(MAX_FAILING_TABLE).iterrows()
    )
    return (f'<h2 id="expected-passed">Expected to fail, passed ({len(passed)})</h2><p>Each of these cases {esc(UNEXPECTED_PASS_NOTE)}</p>'
            f"<table><tr><th>case</th><th>expected to fail because</th></tr>{rows}</table>")


def html_page(
    summary: Summary, matrices: Sequence[ParityMatrix], marginal_tables: Mapping[str, pd.DataFrame], *,
    frame: pd.DataFrame | None = None, grid: Grid | None = None, attributions: Sequence[Attribution] = (),
    banner: str = "", links: Mapping[str, str] | None = None,
) -> str:
    """The whole main page. ``links``: label -> relative path of related files (diff, Markdown ...)."""
    frame = frame if frame is not None else pd.DataFrame()
    toc = [("attribution", "Failure attribution"), ("grid", "Comparison grid")]
    if grid is not None:
        toc += [(s.anchor, "grid " + s.title) for s in grid.sections]
    toc += [("failing", "Cases that did not pass")]
    if summary.unexpected_passes:
        toc.append(("expected-passed", "Expected to fail, passed"))
    toc += [("unsupported", "Unsupported"), ("axes", "Per axis"), ("heatmaps", "Heatmaps")]
    parts = [
        banner_html(banner),
        f"<h1>{esc(headline(summary))}</h1>",
        "<p>" + esc(verdict_line(summary)) + "</p>",
        "<ul>" + "".join(f"<li>{_code(line[2:])}</li>" for line in run_lines(summary)) + "</ul>",
    ]
    if links:
        parts.append("<p>" + " · ".join(f'<a href="{esc(href)}">{esc(label)}</a>' for label, href in links.items()) + "</p>")
    if summary.superseded:
        parts.append(f"<p>{summary.superseded} older record(s) replaced by a newer record of the same case.</p>")
    if summary.bad_lines:
        rows = "".join(
            f"<tr><td>{esc(b.path)}</td><td>{b.line}</td><td>{esc(b.reason)}</td><td><code>{esc(b.head)}</code></td></tr>"
            for b in summary.bad_lines
        )
        parts.append(
            f'<div class="warn"><h2>⚠️ {len(summary.bad_lines)} unreadable result line(s)</h2>'
            "<p>Records cut by a killed run or corrupt; their cases are missing from the tables.</p>"
            f"<table><tr><th>file</th><th>line</th><th>reason</th><th>start of line</th></tr>{rows}</table></div>"
        )
    parts.append('<nav class="toc"><b>Contents</b><ul>'
                 + "".join(f'<li><a href="#{esc(a)}">{esc(t)}</a></li>' for a, t in toc) + "</ul></nav>")
    parts.append('<h2 id="attribution">Failure attribution</h2><p>Per engine and reference: the fewest '
                 "conjunctions of axis values that match the failing cases and no passing case.</p>"
                 + attribution_html(attributions))
    parts.append('<h2 id="grid">Comparison grid</h2><p>Cells: passed/total, then the worst error relative to '
                 f"tolerance (≤ 1 is within tolerance) or the worst verdict; {_code(COUNT_LEGEND)}. "
                 "Every engine has its own row under the same columns. Click a cell to list the cases that did "
                 "not pass; each links to its page.</p>")
    parts.append(legend_html())
    if grid is not None:
        parts.append(_filters(grid) + grid_html(grid))
    parts.append(resume_matrix.html_section(frame))
    parts.append(f'<h2 id="failing">Cases that did not pass</h2>{failing_table_html(frame)}')
    parts.append(expected_passes_html(frame))
    unsupported = frame[frame["verdict"] == "unsupported"] if not frame.empty else frame
    parts.append(f'<h2 id="unsupported">Unsupported ({len(unsupported)})</h2>')
    if len(unsupported):
        by_reason = unsupported.groupby(["engine", "reason"], sort=True).size().reset_index(name="cases")
        parts.append(by_reason.to_html(index=False, escape=True, border=0))
    parts.append('<h2 id="axes">Per axis</h2><p>passed/total per engine, for each value of each axis.</p>')
    for table in marginal_tables.values():
        parts.append(table.to_html(escape=True, border=0))
    parts.append('<h2 id="heatmaps">Heatmaps</h2><ul>' + "".join(
        f'<li><a href="{esc(ms.heatmap)}">{esc(ms.engine)} vs {esc(ms.reference)} · {esc(ms.model)}</a>: '
        f"{ms.passed}/{ms.total} pass{f', {ms.expected} expected failure(s)' if ms.expected else ''}</li>"
        for ms in summary.matrices) + "</ul>")
    return page("Parity report", "\n".join(p for p in parts if p), script=FILTER_JS, css=GRID_CSS)
