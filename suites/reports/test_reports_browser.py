"""The report's HTML pages in a real headless browser: they render, raise no error, load every image,
the filters work as a person sees them (every row left keeps its strategy label; an opened cell keeps
the column widths), and every link points at a file (and anchor) that exists."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
from report_files import write_results
from history_nights import write_nights
from synthetic_records import mixed_records
from test_reports_case_pages import CASE, diverging, hung

import reports
from harness.cases.case import CaseConfig
from harness.pytest_plugin.xdist_groups import one_worker
from reports.case_page import case_href
from reports.history import history

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
needs_browser = pytest.mark.skipif(BROWSER is None, reason="chromium not installed")

# Collects page errors, failed resource loads and console.error calls before the page's own scripts
# run; after load it checks every image decoded, tries the first engine filter, and writes the result
# into the DOM, which --dump-dom prints.
PROBE = """<script>
window.__errors = [];
window.addEventListener('error', function (e) {
  __errors.push(e.message ? 'error: ' + e.message : 'failed to load ' + (e.target && (e.target.src || e.target.href)));
}, true);
var __ce = console.error; console.error = function () { __errors.push('console.error: ' + [].join.call(arguments, ' ')); __ce.apply(console, arguments); };
window.addEventListener('load', function () {
  document.querySelectorAll('img').forEach(function (i) { if (!i.complete || i.naturalWidth === 0) __errors.push('image not loaded: ' + i.getAttribute('src')); });
  var f = document.getElementById('f-engine'), filtered = -1, unlabelled = -1, geometry = null;
  if (f && f.options.length > 1) {
    // Filter on the last engine: its rows are never the first of their strategy.
    f.value = f.options[f.options.length - 1].value; f.dispatchEvent(new Event('change'));
    var rows = Array.prototype.filter.call(document.querySelectorAll('tr.g'), function (tr) { return tr.style.display !== 'none'; });
    filtered = rows.length;
    if (!rows.length || rows.some(function (tr) { return tr.dataset.engine !== f.value; })) __errors.push('engine filter failed');
    // As a person sees it: every row left shows its strategy's label.
    unlabelled = rows.filter(function (tr) {
      var th = tr.querySelector('th.sticky1'), r = th.getBoundingClientRect();
      return !th.textContent.trim() || r.width === 0 || r.height === 0 || getComputedStyle(th).visibility === 'hidden';
    }).length;
    f.value = ''; f.dispatchEvent(new Event('change'));
  }
  // Open each failing cell (up to 12) as a person would, once its toggle has run: the column widths and the
  // grid's width stay, and the list shows inside the grid's box.
  var cells = Array.prototype.slice.call(document.querySelectorAll('table.grid td.cell details'), 0, 12);
  var box = document.querySelector('.gridwrap'), table = document.querySelector('table.grid');
  var widths = function () {
    return Array.prototype.map.call(document.querySelectorAll('table.grid thead tr:nth-child(2) th'),
                                    function (th) { return Math.round(th.getBoundingClientRect().width); }).join(',');
  };
  var before = cells.length ? widths() : '', tableBefore = cells.length ? table.getBoundingClientRect().width : 0;
  geometry = {cells: cells.length, widths_changed: 0, table_changed: 0, outside_box: 0, empty: 0};
  var next = function (i) {
    if (i > 0) {
      var d = cells[i - 1], r = d.querySelector('ul').getBoundingClientRect(), b = box.getBoundingClientRect();
      if (widths() !== before) geometry.widths_changed++;
      if (table.getBoundingClientRect().width !== tableBefore) geometry.table_changed++;
      if (r.width === 0 || r.height === 0) geometry.empty++;
      if (r.left < b.left - 1 || r.right > b.right + 1) geometry.outside_box++;
      d.open = false;
    }
    if (i === cells.length) { report(); return; }
    var td = cells[i].parentElement;
    box.scrollLeft = td.offsetLeft - box.clientWidth / 2;
    cells[i].open = true;
    setTimeout(function () { next(i + 1); }, 20);
  };
  var report = function () {
  var m = document.createElement('pre'); m.id = '__probe';
  m.textContent = '@@' + 'PROBE' + JSON.stringify({errors: __errors, filtered: filtered, unlabelled: unlabelled, geometry: geometry}) + 'PROBE' + '@@';
  document.body.appendChild(m);
  };
  next(0);
});
</script>"""


# Opens the first failing cell of the grid and brings it into view, for the screenshot.
OPEN_CELL = """<script>
window.addEventListener('load', function () {
  var cells = document.querySelectorAll('table.grid td.cell details'), d = cells[cells.length - 1];
  var box = document.querySelector('.gridwrap');
  if (d && box) {
    box.scrollIntoView();
    box.scrollTop = d.parentElement.offsetTop - box.querySelector('thead').offsetHeight - 40;
    box.scrollLeft = d.parentElement.offsetLeft - box.clientWidth / 2;
    d.open = true;
  }
});
</script>"""


def _chromium(*args: str, profile: Path) -> subprocess.CompletedProcess[str]:
    assert BROWSER is not None
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={profile}", "--window-size=1400,1000", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _probe(page: Path, profile: Path) -> dict:
    probed = page.with_name(page.stem + ".probe.html")
    probed.write_text(page.read_text(encoding="utf-8").replace("<head>", "<head>" + PROBE, 1), encoding="utf-8")
    try:
        proc = _chromium("--virtual-time-budget=3000", "--dump-dom", probed.as_uri(), profile=profile)
    finally:
        probed.unlink()
    found = re.search(r"@@PROBE(.*?)PROBE@@", proc.stdout)
    assert found, f"no probe result from {page.name}; chromium said: {proc.stderr[-2000:]}"
    return json.loads(found.group(1).replace("&quot;", '"').replace("&amp;", "&").replace("&lt;", "<").replace("&gt;", ">"))


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        d = dict(attrs)
        if d.get("id"):
            self.ids.add(str(d["id"]))
        for key in ("href", "src"):
            if d.get(key):
                self.refs.append(str(d[key]))


def _parse(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A report with every kind of page (grid, failing and timeout case pages) and a history beside it."""
    tmp = tmp_path_factory.mktemp("site")
    records = [r for r in mixed_records() if r.case["engine"] == "builtin"]
    records += [diverging(), hung(CaseConfig(engine="torch-fsdp", precision="bf16", cpu_offload=True))]
    reports.build(write_results(tmp / "results.jsonl", records), tmp / "report")
    nights = write_nights(tmp / "nights")
    reports.build(nights[-1] / "results.jsonl", nights[-1])  # the history links to the newest night's case pages
    history(nights, tmp / "history")
    return tmp


def test_every_link_and_image_of_every_page_resolves(site: Path) -> None:
    pages = [site / "report" / "matrix.html", *sorted((site / "report" / "cases").glob("*.html")),
             site / "history" / "history.html", *(site / "nights").glob("*/matrix.html"),
             *(site / "nights").glob("*/cases/*.html")]
    assert len(pages) >= 8
    checked = 0
    for page in pages:
        links = _parse(page)
        for ref in links.refs:
            parts = urlsplit(ref)
            assert not parts.scheme and not parts.netloc, f"{page.name} refers outside the report: {ref}"
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            assert target.exists(), f"{page.name}: {ref} does not exist"
            if parts.fragment:
                assert parts.fragment in _parse(target).ids, f"{page.name}: no #{parts.fragment} in {target.name}"
            checked += 1
    assert checked > 50


@needs_browser
def test_pages_render_in_a_browser_without_errors(site: Path, tmp_path: Path) -> None:
    main = site / "report" / "matrix.html"
    case = site / "report" / case_href(CASE.full_id)
    hist = site / "history" / "history.html"
    for page in (main, case, hist):
        result = _probe(page, tmp_path / "profile")
        assert result["errors"] == [], f"{page.name}: {result['errors']}"
        if page == main:
            assert result["filtered"] > 0, "the engine filter left no row"
            assert result["unlabelled"] == 0, "a row the engine filter left shows no strategy"
            geometry = result["geometry"]
            assert geometry["cells"] >= 3, "too few failing cells to open"
            assert geometry == {**geometry, "widths_changed": 0, "table_changed": 0, "empty": 0, "outside_box": 0}, geometry
    shot = tmp_path / "main.png"
    proc = _chromium(f"--screenshot={shot}", main.as_uri(), profile=tmp_path / "profile")
    assert shot.exists() and shot.stat().st_size > 10_000, proc.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The grid with a failing cell opened, as a person sees it (SCREENSHOT_DIR keeps it to look at).
    opened = main.with_name("opened.html")
    opened.write_text(main.read_text(encoding="utf-8").replace("</body>", OPEN_CELL + "</body>", 1), encoding="utf-8")
    shot = Path(os.environ.get("SCREENSHOT_DIR", tmp_path)) / "grid-opened-cell.png"
    proc = _chromium("--virtual-time-budget=3000", f"--screenshot={shot}", opened.as_uri(), profile=tmp_path / "profile")
    opened.unlink()
    assert shot.exists() and shot.stat().st_size > 10_000, proc.stderr[-2000:]


@needs_browser
def test_the_probe_sees_a_broken_page(tmp_path: Path) -> None:
    """The check above can fail: a script error and a missing image are reported."""
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><head></head><body><img src='missing.png'>"
                    "<script>undefinedFunction();</script></body></html>")
    errors = _probe(page, tmp_path / "profile")["errors"]
    assert any("undefinedFunction" in e for e in errors) and any("missing.png" in e for e in errors), errors
    assert diverging().case_id  # the shared records import cleanly


@pytest.fixture(scope="module")
@one_worker
def quick_start(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """README's main job as a newcomer runs it (``harness run --matrix smoke``), and its report."""
    import sys

    tmp = tmp_path_factory.mktemp("quick-start")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "harness", "run", "--matrix", "smoke", "--out", str(tmp / "smoke.jsonl"),
                           "--no-progress"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reports.build(tmp / "smoke.jsonl", tmp / "report")
    return tmp / "report"


def test_the_quick_start_judges_every_case(quick_start: Path) -> None:
    counts = json.loads((quick_start / "summary.json").read_text())
    verdicts = counts.get("verdicts", counts)
    assert verdicts.get("unsupported", 0) == 0 and verdicts.get("pass", 0) > 0, verdicts


@needs_browser
def test_the_quick_start_report_renders_in_a_browser(quick_start: Path, tmp_path: Path) -> None:
    result = _probe(quick_start / "matrix.html", tmp_path / "profile")
    assert result["errors"] == [], result["errors"]
    assert result["filtered"] > 0 and result["unlabelled"] == 0, result
