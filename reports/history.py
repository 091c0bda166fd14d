"""History across nights: verdicts and worst ratios per engine per night, when failures began, what
changed, and performance ratios where the nightly measured them.

``history(dirs, out)`` reads several nightly (or run) directories, each holding ``results.jsonl`` or a
report's ``results.csv`` and maybe a ``nightly.json``, and writes ``history.md`` (fit for a CI job
summary), ``history.html``, PNG plots and ``history.json`` into ``out``. Nights are ordered by
directory name (nightlies are named by date). The tables are pure functions over the loaded nights.

[Note: what a change is]
A case's verdict on a night is compared with its verdict on the last earlier night that ran it (a
night that did not run it changes nothing). ``regressed``: pass -> fail, error, timeout or crash;
``fixed``: one of those -> pass; anything else that differs is ``changed``. A currently failing case
has failed *since* the first night of its current run of failures, and *first failed* on the first
night it ever failed. An expected failure (``reports.matrix.is_expected_failure``: a known engine bug
its suite holds as a strict xfail) reads as its own verdict, ``expected``: it is neither failing now nor a
regression when it begins, and a case expected to fail that passes shows as ``changed``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
from matplotlib.figure import Figure
from tabulate import tabulate

from harness.cases.records import FAILING, VERDICTS
from reports.api import CSV_NAME, NIGHTLY_NAME, load, read_scope, staged
from reports.case_page import case_href
from reports.matrix import expected_failures, fmt_ratio, ordered
from reports.page import banner_html, esc, page
from reports.scope import RunScope

RESULTS_NAME = "results.jsonl"
#: the record verdicts and ``expected`` (see [Note: what a change is]).
NIGHT_VERDICTS: tuple[str, ...] = (*VERDICTS, "expected")
VERDICT_COLOURS = {"pass": "#1a9850", "fail": "#d73027", "error": "#5b2a86", "timeout": "#8073ac",
                   "crash": "#2d004b", "unsupported": "#bdbdbd", "flaky": "#f781bf", "expected": "#b2abd2"}


@dataclass
class Night:
    """One nightly's results."""

    name: str
    frame: pd.DataFrame = field(repr=False)
    #: ``nightly.json``'s ``perf`` section flattened to ``{"a.b": number}``; empty when absent.
    perf: dict[str, float] = field(default_factory=dict)
    scope: RunScope | None = None
    #: where the report of the night is, relative to the history's directory (None: no report there).
    report: str | None = None
    #: lines of its results that are no readable record (cut by a kill, a newer schema).
    bad_lines: int = 0

    def unreadable(self) -> str | None:
        """What the night's unreadable lines hide, or None when it has none."""
        if not self.bad_lines:
            return None
        if self.frame.empty:
            return (f"{self.name} is unreadable: its {self.bad_lines} line(s) hold no readable record (cut, or a "
                    "newer schema); its cases are unknown, not passing")
        return f"{self.name}: {self.bad_lines} unreadable line(s); their cases are missing from that night"


def flatten_numbers(data: Any, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of nested dicts/lists as ``{"a.b.0": value}`` (booleans are not numbers)."""
    out: dict[str, float] = {}
    if isinstance(data, Mapping):
        for k, v in data.items():
            out.update(flatten_numbers(v, f"{prefix}{k}."))
    elif isinstance(data, (list, tuple)):
        for i, v in enumerate(data):
            out.update(flatten_numbers(v, f"{prefix}{i}."))
    elif isinstance(data, (int, float)) and not isinstance(data, bool) and math.isfinite(data):
        out[prefix.rstrip(".")] = float(data)
    return out


def load_night(directory: Path, out: Path | None = None) -> Night:
    """A nightly directory: its ``results.jsonl`` (or ``results.csv``) and ``nightly.json``."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"history: {directory} is not a directory; give nightly (or run) directories")
    source = directory / RESULTS_NAME if (directory / RESULTS_NAME).exists() else directory
    if source == directory and not (directory / CSV_NAME).exists():
        raise FileNotFoundError(f"history: {directory} holds neither {RESULTS_NAME} nor {CSV_NAME}")
    loaded = load(source)
    frame = loaded.frame
    frame = frame.assign(verdict=frame["verdict"].where(~expected_failures(frame), "expected"))
    perf: dict[str, float] = {}
    nightly = directory / NIGHTLY_NAME
    if nightly.exists():
        try:
            perf = flatten_numbers(json.loads(nightly.read_text(encoding="utf-8")).get("perf") or {})
        except (json.JSONDecodeError, AttributeError):
            perf = {}
    report = None
    if (directory / "matrix.html").exists() and out is not None:
        report = _relative(directory / "matrix.html", out)
    return Night(directory.name, frame, perf, read_scope(directory), report, len(loaded.bad_lines))


def sibling_nights(directory: Path | str, limit: int | None = None) -> list[Path]:
    """``directory`` and the nightlies next to it whose names sort before it (date names sort by
    date) that hold results, oldest first; at most the ``limit`` newest. What a nightly passes to
    ``history`` to chart itself against the nights before it."""
    directory = Path(directory)
    parent = directory.parent
    found = [d for d in parent.iterdir() if d.is_dir() and d.name <= directory.name
             and any((d / name).exists() for name in (RESULTS_NAME, CSV_NAME))] if parent.is_dir() else []
    found = sorted(found, key=lambda d: d.name)
    return found[-limit:] if limit else found


def _relative(target: Path, start: Path) -> str:
    return os.path.relpath(target.resolve(), start.resolve()).replace(os.sep, "/")


# ---------------------------------------------------------------------------------------------------
# Tables (pure)


def verdict_counts(nights: Sequence[Night]) -> pd.DataFrame:
    """One row per (night, engine): cases per verdict, and ``ran``/``not_run``."""
    rows = []
    for night in nights:
        f = night.frame
        not_run = len(night.scope.not_run) if night.scope is not None else 0
        for engine in ordered("engine", f["engine"]) if not f.empty else []:
            counts = f[f["engine"] == engine]["verdict"].value_counts()
            row = {"night": night.name, "engine": engine, **{v: int(counts.get(v, 0)) for v in NIGHT_VERDICTS}}
            row["ran"] = sum(row[v] for v in NIGHT_VERDICTS if v != "unsupported")
            row["not_run (all engines)"] = not_run
            rows.append(row)
    return pd.DataFrame(rows, columns=["night", "engine", *NIGHT_VERDICTS, "ran", "not_run (all engines)"])


def worst_ratios(nights: Sequence[Night]) -> pd.DataFrame:
    """Nights as rows, engines as columns: the worst error relative to tolerance (NaN: none compared)."""
    engines = ordered("engine", [e for n in nights for e in n.frame["engine"]])
    data = {}
    for night in nights:
        f = night.frame
        data[night.name] = {e: float(f[f["engine"] == e]["worst_ratio"].astype(float).max()) for e in engines}
    return pd.DataFrame.from_dict(data, orient="index", columns=engines)


def timelines(nights: Sequence[Night]) -> pd.DataFrame:
    """Cases as rows (full id), nights as columns: the verdict, ``""`` where the night did not run it."""
    series = {n.name: n.frame.set_index("full_id")["verdict"] for n in nights}
    return pd.DataFrame(series).fillna("").sort_index()


@dataclass(frozen=True)
class Transition:
    full_id: str
    night: str
    previous_night: str
    old: str
    new: str
    kind: str


def transitions(timeline: pd.DataFrame) -> list[Transition]:
    """Every change of verdict, in night order; see [Note: what a change is]."""
    out = []
    for full_id, row in timeline.iterrows():
        last: tuple[str, str] | None = None
        for night, verdict in row.items():
            if not verdict:
                continue
            if last is not None and verdict != last[1]:
                old = last[1]
                kind = ("regressed" if old == "pass" and verdict in FAILING else
                        "fixed" if old in FAILING and verdict == "pass" else "changed")
                out.append(Transition(str(full_id), str(night), last[0], old, verdict, kind))
            last = (str(night), verdict)
    night_order = {n: i for i, n in enumerate(timeline.columns)}
    return sorted(out, key=lambda t: (night_order[t.night], t.kind, t.full_id))


def failing_now(timeline: pd.DataFrame) -> pd.DataFrame:
    """Cases failing on the newest night: their verdict, the night the current failures began and
    the first night they ever failed."""
    rows = []
    if timeline.empty:
        return pd.DataFrame(columns=["full_id", "verdict", "failing since", "first failed", "nights failing"])
    newest = timeline.columns[-1]
    for full_id, row in timeline.iterrows():
        if row[newest] not in FAILING:
            continue
        ran = [(n, v) for n, v in row.items() if v]
        since = newest
        streak = 0
        for night, verdict in reversed(ran):
            if verdict not in FAILING:
                break
            since, streak = night, streak + 1
        first = next(n for n, v in ran if v in FAILING)
        rows.append({"full_id": full_id, "verdict": row[newest], "failing since": since, "first failed": first,
                     "nights failing": streak})
    return pd.DataFrame(rows, columns=["full_id", "verdict", "failing since", "first failed", "nights failing"])


def perf_table(nights: Sequence[Night]) -> pd.DataFrame:
    """Nights as rows, performance metrics as columns (empty when no night measured any)."""
    data = {n.name: n.perf for n in nights}
    frame = pd.DataFrame.from_dict(data, orient="index")
    return frame.dropna(axis=1, how="all") if not frame.empty else frame


# ---------------------------------------------------------------------------------------------------
# Plots


def plot_verdicts(counts: pd.DataFrame, nights: Sequence[str], path: Path) -> None:
    engines = list(dict.fromkeys(counts["engine"]))
    fig = Figure(figsize=(max(5.0, 1.2 + 0.9 * len(nights)) * max(1, len(engines)) / 1.6, 3.4), dpi=90)
    axes = fig.subplots(1, max(1, len(engines)), sharey=True, squeeze=False)[0]
    for ax, engine in zip(axes, engines):
        sub = counts[counts["engine"] == engine].set_index("night").reindex(nights).fillna(0)
        bottom = [0.0] * len(nights)
        for verdict in NIGHT_VERDICTS:
            values = list(sub[verdict])
            if any(values):
                ax.bar(range(len(nights)), values, bottom=bottom, color=VERDICT_COLOURS[verdict], label=verdict)
                bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_title(engine, fontsize=10)
        ax.set_xticks(range(len(nights)), labels=nights, rotation=30, ha="right", fontsize=8)
    axes[0].set_ylabel("cases")
    handles = {h.get_label(): h for ax in axes for h in ax.get_legend_handles_labels()[0]}
    fig.legend(list(handles.values()), list(handles), loc="upper right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.savefig(path)


def plot_lines(table: pd.DataFrame, path: Path, ylabel: str, *, log: bool, threshold: float | None = None) -> None:
    line_figure(table, ylabel, log=log, threshold=threshold).savefig(path)


def line_figure(table: pd.DataFrame, ylabel: str, *, log: bool, threshold: float | None = None) -> Figure:
    """One line per column over the nights. On a log scale a 0 (an exact match) has no place: it is left
    out of its line and named in a note under the plot, never drawn as some small value."""
    fig = Figure(figsize=(7.5, 3.4), dpi=90)
    ax = fig.subplots()
    xs = range(len(table.index))
    exact: list[str] = []
    for column in table.columns:
        values = [v if v is not None and not (isinstance(v, float) and math.isnan(v)) else float("nan") for v in table[column]]
        if log:
            exact += [f"{column} on {night}" for night, v in zip(table.index, values) if v == 0]
            values = [float("nan") if v == 0 else v for v in values]
        ax.plot(xs, values, "-o", ms=4, label=str(column))
    if threshold is not None:
        ax.axhline(threshold, color="black", ls="--", lw=1, label="tolerance")
    if log:
        ax.set_yscale("log")
    ax.set_xticks(list(xs), labels=[str(i) for i in table.index], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    if exact:
        shown = "; ".join(exact[:4]) + (f"; and {len(exact) - 4} more" if len(exact) > 4 else "")
        fig.text(0.01, 0.01, f"0 (exact match), not drawn on the log scale: {shown}", fontsize=7)
    fig.tight_layout(rect=(0, 0.05 if exact else 0, 1, 1))
    return fig


# ---------------------------------------------------------------------------------------------------
# Pages


@dataclass
class History:
    """What ``history`` found and wrote (also ``history.json``)."""

    out_dir: str
    nights: list[str]
    #: ``Transition`` of every change, as dicts.
    changes: list[dict[str, Any]]
    failing: list[dict[str, Any]]
    files: list[str] = field(default_factory=list)
    #: what the newest night's unreadable lines hide (``Night.unreadable``); None when it has none.
    newest_unreadable: str | None = None
    #: the newest night has unreadable lines and no readable record: nothing is known of its cases.
    newest_unknown: bool = False

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [c for c in self.changes if c["kind"] == kind]

    def to_dict(self) -> dict[str, Any]:
        return {"out_dir": self.out_dir, "nights": self.nights, "changes": self.changes, "failing": self.failing,
                "files": self.files, "newest_unreadable": self.newest_unreadable, "newest_unknown": self.newest_unknown}


def _banners(nights: Sequence[Night]) -> list[str]:
    partial = [f"{n.name}: {n.scope.banner()}" for n in nights if n.scope is not None and n.scope.partial]
    return partial + [text for n in nights if (text := n.unreadable())]


def _green(nights: Sequence[Night], failing: pd.DataFrame) -> bool:
    """Nothing fails on the newest night and all of it could be read."""
    return not len(failing) and bool(nights) and not nights[-1].bad_lines


def _ratio_table(ratios: pd.DataFrame) -> pd.DataFrame:
    return ratios.apply(lambda col: col.map(fmt_ratio)) if not ratios.empty else ratios


def history_markdown(nights: Sequence[Night], counts: pd.DataFrame, ratios: pd.DataFrame,
                     changes: Sequence[Transition], failing: pd.DataFrame, perf: pd.DataFrame) -> str:
    """The history as Markdown, short enough for a CI job summary."""
    newest = nights[-1].name if nights else "-"
    regressed = [c for c in changes if c.kind == "regressed"]
    fixed = [c for c in changes if c.kind == "fixed"]
    head = "❌" if len(failing) else "✅" if _green(nights, failing) else "⚠️"
    lines = [f"# {head} Parity history: {len(nights)} nights, newest {newest}", ""]
    lines += [f"> ⚠️ **{b}**" for b in _banners(nights)] + ([""] if _banners(nights) else [])
    lines += [f"{len(failing)} case(s) failing on {newest}; {len(regressed)} regression(s) and {len(fixed)} fix(es) "
              "across the nights.", "", "## Pass / ran per engine", ""]
    if not counts.empty:
        pivot = counts.assign(cell=counts["pass"].astype(str) + "/" + counts["ran"].astype(str)).pivot(
            index="night", columns="engine", values="cell").reindex([n.name for n in nights]).fillna("")
        lines.append(tabulate(pivot.reset_index(), headers="keys", tablefmt="github", showindex=False, disable_numparse=True))
    lines += ["", "## Worst error / tolerance per engine", "",
              tabulate(_ratio_table(ratios).reset_index(names="night"), headers="keys", tablefmt="github",
                       showindex=False, disable_numparse=True)]
    for title, group in (("Regressions", regressed), ("Fixes", fixed)):
        if group:
            lines += ["", f"## {title} ({len(group)})", "",
                      tabulate([[c.night, c.full_id, f"{c.old} → {c.new}", c.previous_night] for c in group],
                               headers=["night", "case", "change", "previous run"], tablefmt="github", disable_numparse=True)]
    if len(failing):
        lines += ["", f"## Failing on {newest} ({len(failing)})", "",
                  tabulate(failing.values.tolist(), headers=list(failing.columns), tablefmt="github", disable_numparse=True)]
    if not perf.empty:
        lines += ["", "## Performance", "",
                  tabulate(perf.reset_index(names="night"), headers="keys", tablefmt="github", showindex=False, floatfmt=".3g")]
    return "\n".join(lines).rstrip() + "\n"


def _table_html(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, escape=True, border=0, na_rep="-")


def history_html(nights: Sequence[Night], counts: pd.DataFrame, ratios: pd.DataFrame, changes: Sequence[Transition],
                 failing: pd.DataFrame, perf: pd.DataFrame, images: Mapping[str, str],
                 case_links: Mapping[str, str] | None = None) -> str:
    """The history page; ``case_links``: full id -> page of the case in the newest night's report."""
    case_links = case_links or {}
    newest = nights[-1].name if nights else "-"
    parts = [banner_html(" ".join(_banners(nights))), f"<h1>Parity history: {len(nights)} nights, newest {esc(newest)}</h1>"]
    reports = [f'<a href="{esc(n.report)}">{esc(n.name)}</a>' for n in nights if n.report]
    if reports:
        parts.append("<p>Reports: " + " · ".join(reports) + "</p>")
    parts.append('<nav class="toc"><b>Contents</b> <ul><li><a href="#verdicts">verdicts</a></li>'
                 '<li><a href="#ratios">worst ratios</a></li><li><a href="#changes">changes</a></li>'
                 '<li><a href="#failing">failing now</a></li><li><a href="#perf">performance</a></li></ul></nav>')
    parts.append('<h2 id="verdicts">Cases per verdict per engine</h2>')
    if "verdicts" in images:
        parts.append(f'<img src="{esc(images["verdicts"])}" alt="cases per verdict per engine per night">')
    parts.append(_table_html(counts))
    parts.append('<h2 id="ratios">Worst error / tolerance per engine</h2>')
    if "ratios" in images:
        parts.append(f'<img src="{esc(images["ratios"])}" alt="worst ratio per engine per night">')
    parts.append(_table_html(_ratio_table(ratios).reset_index(names="night")))
    parts.append('<h2 id="changes">Changes</h2>')
    if changes:
        rows = "".join(
            f'<tr><td>{esc(c.night)}</td><td><b>{esc(c.kind)}</b></td><td class="left"><code>{esc(c.full_id)}</code></td>'
            f"<td>{esc(c.old)} → {esc(c.new)}</td><td>{esc(c.previous_night)}</td></tr>" for c in changes)
        parts.append("<table><tr><th>night</th><th>kind</th><th>case</th><th>change</th><th>previous run</th></tr>"
                     f"{rows}</table>")
    else:
        parts.append("<p>No case changed its verdict.</p>")
    parts.append(f'<h2 id="failing">Failing on {esc(newest)} ({len(failing)})</h2>')
    if len(failing):
        rows = []
        for r in failing.to_dict("records"):
            name = f"<code>{esc(r['full_id'])}</code>"
            if r["full_id"] in case_links:
                name = f'<a href="{esc(case_links[r["full_id"]])}">{name}</a>'
            rows.append(f'<tr><td class="left">{name}</td><td>{esc(r["verdict"])}</td><td>{esc(r["failing since"])}</td>'
                        f'<td>{esc(r["first failed"])}</td><td>{r["nights failing"]}</td></tr>')
        parts.append("<table><tr><th>case</th><th>verdict</th><th>failing since</th><th>first failed</th>"
                     f"<th>nights failing</th></tr>{''.join(rows)}</table>")
    parts.append('<h2 id="perf">Performance</h2>')
    if perf.empty:
        parts.append("<p>No night's <code>nightly.json</code> has a <code>perf</code> section.</p>")
    else:
        if "perf" in images:
            parts.append(f'<img src="{esc(images["perf"])}" alt="performance per night">')
        parts.append(perf.reset_index(names="night").to_html(index=False, border=0, float_format="{:.3g}".format, na_rep="-"))
    return page("Parity history", "\n".join(p for p in parts if p))


def history(dirs: Iterable[Path | str], out: Path | str) -> History:
    """Read the nightly directories ``dirs`` (ordered by name) and write the history into ``out``:
    history.md, history.html, history_verdicts.png, history_ratios.png, history_perf.png (when a
    night measured performance) and history.json. The entry point of ``python -m reports history``."""
    out = Path(out)
    directories = sorted({Path(d).resolve(): Path(d) for d in dirs}.values(), key=lambda d: d.name)
    if not directories:
        raise ValueError("history: give at least one nightly directory")
    nights = [load_night(d, out) for d in directories]
    with staged(out) as stage:
        result = _write_history(nights, directories, out, stage)
    for stale in ("history_verdicts.png", "history_ratios.png", "history_perf.png"):
        if stale not in result.files:
            (out / stale).unlink(missing_ok=True)
    return result


def _write_history(nights: list[Night], directories: list[Path], out: Path, stage: Path) -> History:
    """``history``'s files, written into ``stage`` for ``out``."""
    counts, ratios, timeline = verdict_counts(nights), worst_ratios(nights), timelines(nights)
    changes, failing, perf = transitions(timeline), failing_now(timeline), perf_table(nights)
    names = [n.name for n in nights]
    images: dict[str, str] = {}
    files = ["history.md", "history.html"]
    if not counts.empty:
        plot_verdicts(counts, names, stage / "history_verdicts.png")
        images["verdicts"] = "history_verdicts.png"
    if not ratios.empty and ratios.notna().any().any():
        plot_lines(ratios, stage / "history_ratios.png", "worst error / tolerance", log=True, threshold=1.0)
        images["ratios"] = "history_ratios.png"
    if not perf.empty:
        plot_lines(perf, stage / "history_perf.png", "value", log=False)
        images["perf"] = "history_perf.png"
    files += list(images.values())
    newest = directories[-1]
    case_links = {
        str(i): _relative(newest / case_href(str(i)), out) for i in failing["full_id"] if (newest / case_href(str(i))).exists()
    }
    (stage / "history.md").write_text(history_markdown(nights, counts, ratios, changes, failing, perf), encoding="utf-8")
    (stage / "history.html").write_text(history_html(nights, counts, ratios, changes, failing, perf, images, case_links), encoding="utf-8")
    result = History(str(out), names, [c.__dict__ for c in changes], failing.to_dict("records"), [*files, "history.json"],
                     nights[-1].unreadable(), bool(nights[-1].bad_lines) and nights[-1].frame.empty)
    (stage / "history.json").write_text(json.dumps(result.to_dict(), indent=2, default=str) + "\n", encoding="utf-8")
    return result
