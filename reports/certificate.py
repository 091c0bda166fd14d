"""The conformance certificate of one engine: per behaviour family, pass / fail / unsupported counts,
the failing cases with their worst quantities, and the engine's version and environment.

Pure data and renderers (Markdown, HTML, JSON); ``harness.cli.certify`` runs the families and fills it.
A family *fails* when any of its cases failed, *passes* when some passed and none failed, and is
*unsupported* when nothing of it could run here (the reason says why: no GPU, an axis not there yet,
an engine without the API the family needs). The certificate fails when any family fails.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from tabulate import tabulate

__all__ = ["Certificate", "FamilyResult", "Failure", "markdown", "render_html", "to_json"]

FamilyStatus = Literal["pass", "fail", "unsupported"]

#: failing cases listed per family; the JSON keeps them all.
MAX_LISTED = 20


@dataclass
class Failure:
    """One failing case of a family."""

    #: the case: a test node id or a case's full id.
    case: str
    #: one line: why it failed.
    reason: str
    #: the quantity that disagreed most (``grad:0.weight``, a knob), when there is one.
    worst_quantity: str = ""
    #: its error relative to the tolerance (> 1 fails), when numeric.
    worst_ratio: float | None = None


@dataclass
class FamilyResult:
    """What one behaviour family found."""

    name: str
    description: str
    passed: int = 0
    failed: int = 0
    unsupported: int = 0
    failures: list[Failure] = field(default_factory=list)
    #: why nothing ran (the whole family unsupported), or a remark on how it ran.
    note: str = ""

    @property
    def status(self) -> FamilyStatus:
        if self.failed:
            return "fail"
        return "pass" if self.passed else "unsupported"


@dataclass
class Certificate:
    """The certificate: the engine, where it ran, and every family's result."""

    engine: str
    spec: str
    version: str
    #: torch version, backend, devices, world size, git revision, host, mode.
    environment: dict[str, Any]
    families: list[FamilyResult]
    #: a failing case's page (full id -> path relative to the certificate), where the report wrote one.
    pages: dict[str, str] = field(default_factory=dict)
    #: per case family that ran, per axis, the declared values it never exercised (``harness.collect.coverage``).
    coverage: dict[str, dict[str, list[Any]]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not any(f.status == "fail" for f in self.families)

    @property
    def verdict(self) -> str:
        """CONFORMS, PARTIAL (some declared strategy or precision never ran) or DOES NOT CONFORM."""
        from harness.collect.coverage import verdict

        return verdict(self.ok, self.coverage)

    def family(self, name: str) -> FamilyResult:
        return next(f for f in self.families if f.name == name)


def to_json(cert: Certificate) -> str:
    data = asdict(cert)
    data["ok"] = cert.ok
    data["verdict"] = cert.verdict
    for fam, result in zip(data["families"], cert.families):
        fam["status"] = result.status
    return json.dumps(data, indent=2, sort_keys=False)


def _ratio(r: float | None) -> str:
    return "" if r is None else f"{r:.3g}"


def markdown(cert: Certificate) -> str:
    from harness.collect.coverage import coverage_lines

    verdict = cert.verdict
    lines = [
        f"# Conformance certificate: {cert.engine}",
        "",
        f"**{verdict}**: {sum(f.status == 'pass' for f in cert.families)} families pass, "
        f"{sum(f.status == 'fail' for f in cert.families)} fail, "
        f"{sum(f.status == 'unsupported' for f in cert.families)} unsupported.",
        "",
        f"- engine spec: `{cert.spec}`, version {cert.version}",
        *[f"- {k.replace('_', ' ')}: {v}" for k, v in cert.environment.items()],
        "",
        "## Families",
        "",
        tabulate(
            [(f.name, f.status, f.passed, f.failed, f.unsupported, f.note or f.description) for f in cert.families],
            headers=("family", "status", "pass", "fail", "unsupported", "what / why"),
            tablefmt="github",
        ),
    ]
    if cert.coverage:
        lines += ["", "## Coverage", "", *[f"- {line}" for line in coverage_lines(cert.coverage)]]
    for fam in cert.families:
        if not fam.failures:
            continue
        lines += ["", f"## {fam.name}: failing cases", ""]
        rows = [(f"[{f.case}]({cert.pages[f.case]})" if f.case in cert.pages else f.case, f.worst_quantity,
                 _ratio(f.worst_ratio), f.reason) for f in fam.failures[:MAX_LISTED]]
        lines.append(tabulate(rows, headers=("case", "worst quantity", "ratio", "reason"), tablefmt="github"))
        if len(fam.failures) > MAX_LISTED:
            lines.append(f"\n… and {len(fam.failures) - MAX_LISTED} more (certificate.json lists all)")
    return "\n".join(lines) + "\n"


_COLOURS = {"pass": "#1a9850", "fail": "#d73027", "unsupported": "#878787"}


def render_html(cert: Certificate) -> str:
    e = html.escape
    verdict = cert.verdict.lower()
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>Conformance certificate: {e(cert.engine)}</title>",
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}.s{color:#fff;font-weight:bold}</style>",
        "</head><body>",
        f"<h1>Conformance certificate: {e(cert.engine)}</h1>",
        f"<p><b>{e(cert.engine)} {e(verdict)}</b> (spec <code>{e(cert.spec)}</code>, version {e(cert.version)})</p>",
        "<ul>", *[f"<li>{e(k.replace('_', ' '))}: {e(str(v))}</li>" for k, v in cert.environment.items()], "</ul>",
        "<table><tr><th>family</th><th>status</th><th>pass</th><th>fail</th><th>unsupported</th><th>what / why</th></tr>",
    ]
    for f in cert.families:
        parts.append(
            f"<tr><td>{e(f.name)}</td><td class='s' style='background:{_COLOURS[f.status]}'>{f.status}</td>"
            f"<td>{f.passed}</td><td>{f.failed}</td><td>{f.unsupported}</td><td>{e(f.note or f.description)}</td></tr>"
        )
    parts.append("</table>")
    for fam in cert.families:
        if not fam.failures:
            continue
        parts.append(f"<h2>{e(fam.name)}: failing cases</h2><table><tr><th>case</th><th>worst quantity</th><th>ratio</th><th>reason</th></tr>")
        for fl in fam.failures[:MAX_LISTED]:
            case = f"<code>{e(fl.case)}</code>"
            if fl.case in cert.pages:
                case = f'<a href="{e(cert.pages[fl.case])}">{case}</a>'
            parts.append(f"<tr><td>{case}</td><td>{e(fl.worst_quantity)}</td>"
                         f"<td>{e(_ratio(fl.worst_ratio))}</td><td>{e(fl.reason)}</td></tr>")
        parts.append("</table>")
        if len(fam.failures) > MAX_LISTED:
            parts.append(f"<p>… and {len(fam.failures) - MAX_LISTED} more (certificate.json lists all)</p>")
    parts.append("</body></html>")
    return "\n".join(parts)
