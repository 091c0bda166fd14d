"""``python -m harness certify --engine SPEC``: a conformance certificate for one engine.

Runs every behaviour family against the engine and writes ``certificate.md``, ``certificate.html`` and
``certificate.json`` (``reports.certificate``) with the per-family counts, the failing cases and their
worst quantities, the engine's version and the environment. Exit status 0 when no family fails, 1 when
one does, 2 when the engine spec is bad (one line naming it) or the ranks cannot start.

The families (``FAMILIES``; adding one is one line there):

- ``seeds``: the ported suites (``harness.conformance.seeds``, ``.mixed_precision``, ``.wrap``) through
  pytest in a child process with ``--engine SPEC`` (engines with torch FSDP1's API), one count per test;
- ``parity-ddp`` / ``parity-local``: the generated cases (pairwise matrix; ``--quick``: the smoke cases of
  one small model) through ``harness.run.runner``, judged on their numbers against each reference;
- ``knobs``: the same cases' knob checks (no setting silently ignored);
- ``checkpoints``: the cases of the matrix's ``checkpoint`` axis, once the matrix has one;
- ``flat-param``: the engine's ``FlatParamHandle`` metadata against torch FSDP1's layout, where it has one;
- ``torch-common-fsdp``: torch's own FSDP parity machinery (``torch.testing._internal.common_fsdp``) over
  the engine, on CUDA ranks (one GPU shared by them will do) where torch's testing extras import.

On CPU the ranks run on gloo, on GPUs as ``harness.ranks.placement.place`` puts them (``--world-size`` defaults to
every local GPU where there are 2 or more, else 2).
Engines are resolved by ``harness.engines.registry``; a plug-in's spec must be resolvable in a fresh process
(a spec or an entry point), since the families of test modules run pytest in one.

Where the families' tests live: ``parity-*``, ``knobs`` and ``checkpoints`` are library calls, and
``seeds``, ``flat-param`` and ``torch-common-fsdp`` run test modules shipped in the package (``pytest
--pyargs harness.conformance.seeds.fsdp_core ...``, ``...engine_layout``, ``...torch_common_fsdp``), which
the suites collect by import (see that package's docstring): every family runs from an installed package
as from a checkout, and none reads the repository's ``suites/``. The selected families of test modules share
one pytest child (``CertifyRun.tests``, one ``tests.xml``), so that Python, torch and the child's ranks start
once a certificate, not once a family.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.cases.case import CaseConfig
from harness.cases.records import ERRORED, CaseRecord
from harness.cli.options import add_case_timeout, add_placement, non_empty_path
from harness.ranks.placement import Lane
from reports.api import staged
from reports.certificate import Certificate, FamilyResult, Failure, markdown, render_html, to_json

__all__ = ["FAMILIES", "Family", "add_arguments", "main"]

#: the directory this package runs from (a checkout's root, or site-packages): the pytest child imports it
#: from there, and from a checkout's root it runs under the checkout's pytest configuration.
REPO = Path(__file__).resolve().parents[2]
#: the ported suites' test modules, shipped in the package (``harness.conformance``), in the order
#: ``suites/seeds``, ``suites/mixed_precision`` and ``suites/wrap`` collect them (by import, under the
#: names ``test_<module>.py``).
PORTED_MODULES = (
    "harness.conformance.seeds.foreach",
    "harness.conformance.seeds.fsdp_checkpoint",
    "harness.conformance.seeds.fsdp_clip_grad_norm",
    "harness.conformance.seeds.fsdp_core",
    "harness.conformance.seeds.fsdp_differences",
    "harness.conformance.seeds.fsdp_flatten_params",
    "harness.conformance.seeds.fsdp_use_orig_params",
    "harness.conformance.seeds.fsdp_wrap",
    "harness.conformance.seeds.seed_parity",
    "harness.conformance.torch_common_fsdp",
    "harness.conformance.mixed_precision.gpu",
    "harness.conformance.mixed_precision.grad_scaler",
    "harness.conformance.mixed_precision.mixed_precision",
    "harness.conformance.mixed_precision.parity",
    "harness.conformance.mixed_precision.precision_logic",
    "harness.conformance.wrap.wrap_engine",
    "harness.conformance.wrap.wrap_oracle",
    "harness.conformance.wrap.wrap_policies",
)


@dataclass(frozen=True)
class PytestSelection:
    """Test modules a family runs in certify's pytest child, and, where it keeps only some of their tests,
    which (``keyword``: a ``-k`` expression)."""

    modules: tuple[str, ...]
    keyword: str | None = None
    #: the longest the family's tests may take (the child's limit is the sum over its families).
    timeout_s: float = 900

    def owns(self, classname: str) -> bool:
        """Whether a JUnit test case of this class (``module`` or ``module.Class``) is one of these tests."""
        return any(classname == m or classname.startswith(m + ".") for m in self.modules)

    def narrowing(self) -> str | None:
        """The ``-k`` term that keeps this selection's tests and leaves every other module's alone: ``-k``
        matches a test by its module file's name too (``seed_parity.py``)."""
        if not self.keyword:
            return None
        files = " or ".join(f"{m.rpartition('.')[2]}.py" for m in self.modules)
        return f"(not ({files}) or ({self.keyword}))"


#: what ``--quick`` keeps of the ported suites: the core parity checks (CI can afford them twice).
QUICK_PORTED = PytestSelection(("harness.conformance.seeds.seed_parity",),
                               keyword="check_parity_nested_wrapped_model or check_parity_transformer")
FULL_PORTED = PytestSelection(PORTED_MODULES, timeout_s=5400)
FLAT_PARAM_TESTS = PytestSelection(("harness.conformance.engine_layout",))
TORCH_COMMON_TESTS = PytestSelection(("harness.conformance.torch_common_fsdp",), timeout_s=3600)
QUICK_TORCH_COMMON_TESTS = PytestSelection(TORCH_COMMON_TESTS.modules)


def pytest_selection(selections: Sequence[PytestSelection]) -> tuple[list[str], float]:
    """The arguments that run every selection's tests in one pytest (``--pyargs`` modules, one ``-k``), and
    its time limit."""
    modules = list(dict.fromkeys(m for sel in selections for m in sel.modules))
    narrowed = [term for sel in selections if (term := sel.narrowing())]
    args = ["--pyargs", *modules, *(["-k", " and ".join(narrowed)] if narrowed else [])]
    return args, sum(sel.timeout_s for sel in selections)


#: the report of the certification's cases, beside the certificate: its case pages are linked from it.
REPORT_DIR = "report"


# ---------------------------------------------------------------------------------------------------
# The run the families share


@dataclass
class CertifyRun:
    """One certification: the engine, where its ranks run, and the generated cases' records (run once,
    on first use, and shared by the families that judge them)."""

    spec: str
    name: str
    quick: bool
    #: where the ranks run (``harness.ranks.placement.place``): world size, backend, the GPU of each rank.
    lane: Lane
    out: Path
    case_timeout_s: float
    progress: bool
    #: the families this run judges (``--families``): those of test modules share one pytest child.
    families: Sequence[Family] = ()
    _records: list[CaseRecord] | None = field(default=None, repr=False)
    _selections: dict[str, PytestSelection | str] | None = field(default=None, repr=False)
    _tests: tuple[list[tuple[str, str, str]], str] | None = field(default=None, repr=False)

    @property
    def world_size(self) -> int:
        return self.lane.world_size

    def cases(self) -> list[CaseConfig]:
        from harness.run.runner import generate_cases

        if self.quick:
            return generate_cases("smoke", [self.world_size], ["ddp", "local"],
                                  axes={"engine": [self.spec], "model": ["nested"]}, steps=2)
        return generate_cases("pairwise", [self.world_size], ["ddp", "local"], axes={"engine": [self.spec]})

    def records(self) -> list[CaseRecord]:
        if self._records is None:
            self._records = self._run_cases()
        return self._records

    def _run_cases(self) -> list[CaseRecord]:
        """The cases on one pool of the certificate's lane, through the run session every front end uses."""
        from harness.collect.collector import ResultWriter, run_info
        from harness.ranks.pool import PoolStartError
        from harness.run.session import RunSession

        cases = self.cases()
        writer = ResultWriter(self.out / "results.jsonl", run_info([self.lane]))
        with RunSession(writer, {self.world_size: [self.lane]}, case_timeout_s=self.case_timeout_s,
                        show_progress=self.progress) as session:
            session.run(cases)
        if session.not_run:
            # Cases that did not run would read as a certificate with fewer cases: the ranks failed.
            assert session.runner is not None
            raise PoolStartError(f"{len(session.not_run)} of {len(cases)} cases not run: "
                                 + "; ".join(session.runner.lane_errors))
        return session.records

    def selections(self) -> dict[str, PytestSelection | str]:
        """Per selected family of test modules, the tests it runs here or why it runs none (its note),
        decided once: the child's arguments and each family's share of its results read the same."""
        if self._selections is None:
            self._selections = {f.name: f.tests(self) for f in self.families if f.tests}
        return self._selections

    def tests(self, family: str) -> tuple[list[tuple[str, str, str]], str]:
        """Family ``family``'s ``(node, outcome, message)`` per test, and the output's tail, of the one pytest
        child that runs the tests of every selected family (run on first use: one start-up, not one a family)."""
        chosen = self.selections()
        if self._tests is None:
            run = [s for s in chosen.values() if isinstance(s, PytestSelection)]
            self._tests = self.pytest(*pytest_selection(run))
        found, tail = self._tests
        selection = chosen[family]
        assert isinstance(selection, PytestSelection), selection
        return [t for t in found if selection.owns(t[0].split("::")[0])], tail

    def pytest(self, args: Sequence[str], timeout_s: float) -> tuple[list[tuple[str, str, str]], str]:
        """Run pytest on ``args`` with ``--engine SPEC`` in a subprocess; ``(node, outcome, message)`` per
        test (outcome ``passed``, ``failed`` or ``skipped``) and the output's tail."""
        xml = self.out / "tests.xml"
        env = dict(os.environ)
        # The child resolves the spec again: it needs this process's import path (a plug-in's included).
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *[p for p in sys.path if p]])
        # The plug-in brings ``--engine`` where no conftest of a checkout does (an installed package), the
        # profiles the Hypothesis tests run under in CI likewise (``ci`` unless FUZZ_PROFILE says otherwise).
        # A module that fails to collect fails its own family, not every family of the child.
        cmd = [sys.executable, "-m", "pytest", *args, "-p", "harness.pytest_plugin", "-p", "harness.conformance.profiles",
               "--engine", self.spec, "--continue-on-collection-errors",
               "-p", "no:cacheprovider", "-q", f"--junitxml={xml}", "-o", "junit_family=xunit2"]
        # The suites place their pools by the same rule; the certificate's placement is passed down.
        cmd += ["--backend", self.lane.backend, "--device", self.lane.device]
        # Node ids relative to the directory holding the package, from site-packages as from a checkout:
        # ``harness/conformance/seeds/fsdp_core.py::test_check[...]``, not a bare file name.
        cmd += ["--rootdir", str(REPO)]
        try:
            # From a checkout's root, under its pytest configuration (the root conftest, pyproject's markers)
            # as in CI; else from the certificate's directory (never site-packages: Hypothesis keeps its
            # example database in the working directory).
            cwd = REPO if (REPO / "conftest.py").is_file() else self.out
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout_s)
            tail = (proc.stdout + proc.stderr)[-2000:]
        except subprocess.TimeoutExpired as exc:
            tail = f"pytest ran past {timeout_s:.0f} s: {str(exc.stdout or '')[-1000:]}"
        return (parse_junit(xml) if xml.exists() else []), tail


def parse_junit(path: Path) -> list[tuple[str, str, str]]:
    """``(node, outcome, message)`` of every test case of a JUnit XML file."""
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        node = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or child.text or "").strip()
                break
            if child.tag == "skipped":
                outcome, message = "skipped", (child.get("message") or "").strip()
        out.append((node, outcome, " ".join(message.split())[:300]))
    return out


# ---------------------------------------------------------------------------------------------------
# Families


@dataclass(frozen=True)
class Family:
    """One behaviour family: its name, what it checks, and how it is judged for a run."""

    name: str
    description: str
    judge: Callable[[CertifyRun, FamilyResult], None]
    #: a family of test modules: its tests for a run, or why it runs none there (the family's note).
    tests: Callable[[CertifyRun], PytestSelection | str] | None = None


def _from_tests(result: FamilyResult, tests: list[tuple[str, str, str]], tail: str) -> None:
    for node, outcome, message in tests:
        if outcome == "passed":
            result.passed += 1
        elif outcome == "skipped":
            result.unsupported += 1
        else:
            result.failed += 1
            result.failures.append(Failure(node, message))
    if not tests:
        # pytest did not get to run a test (usage error, collection error, time limit): that is a failure.
        result.failed += 1
        result.failures.append(Failure("pytest", " ".join(tail.split())[-300:]))


def _fsdp1_missing(run: CertifyRun) -> str | None:
    from harness.engines.registry import resolve

    if resolve(run.spec).fsdp1_module is None:
        return f"{run.name} has no torch FSDP1 API (its adapter has no fsdp1_module): these checks speak it"
    return None


def seeds_tests(run: CertifyRun) -> PytestSelection | str:
    return _fsdp1_missing(run) or (QUICK_PORTED if run.quick else FULL_PORTED)


def flat_param_tests(run: CertifyRun) -> PytestSelection | str:
    return _fsdp1_missing(run) or FLAT_PARAM_TESTS


def torch_common_tests(run: CertifyRun) -> PytestSelection | str:
    if run.lane.device != "cuda":
        return ("needs CUDA ranks: torch's FSDPTest builds its models on the current CUDA device "
                "(ranks may share one GPU); this certification runs on the CPU")
    return (_torch_testing_missing() or _fsdp1_missing(run)
            or (QUICK_TORCH_COMMON_TESTS if run.quick else TORCH_COMMON_TESTS))


def judge_tests(run: CertifyRun, result: FamilyResult) -> None:
    selection = run.selections()[result.name]
    if isinstance(selection, str):
        result.note = selection
    else:
        _from_tests(result, *run.tests(result.name))


def judge_parity(reference: str) -> Callable[[CertifyRun, FamilyResult], None]:
    def judge(run: CertifyRun, result: FamilyResult) -> None:
        _judge_numbers(result, [r for r in run.records() if r.case.get("reference") == reference])

    return judge


def _judge_numbers(result: FamilyResult, records: list[CaseRecord]) -> None:
    from harness.collect.collector import record_full_id

    for record in records:
        if record.verdict == "unsupported":
            result.unsupported += 1
        elif record.verdict in ERRORED:
            result.failed += 1
            result.failures.append(Failure(record_full_id(record), f"{record.verdict}: {record.reason}"))
        else:
            failing = sorted((e for e in record.errors if not e.passed), key=lambda e: -e.ratio)
            if failing:
                worst = failing[0]
                result.failed += 1
                result.failures.append(Failure(
                    record_full_id(record), f"max_abs {worst.max_abs:.3g} beyond atol {worst.atol:.3g} + rtol {worst.rtol:.3g}",
                    worst.name, worst.ratio))
            elif not record.errors:
                result.failed += 1
                result.failures.append(Failure(record_full_id(record), "nothing was compared"))
            else:
                result.passed += 1


def judge_knobs(run: CertifyRun, result: FamilyResult) -> None:
    from harness.collect.collector import record_full_id

    for record in run.records():
        if record.verdict == "unsupported":
            result.unsupported += 1
            continue
        if record.verdict in ERRORED:
            result.failed += 1
            result.failures.append(Failure(record_full_id(record), f"{record.verdict}: {record.reason}"))
            continue
        knobs = record.detail.get("knobs", [])
        ignored = [k for k in knobs if k["status"] == "ignored"]
        if ignored:
            result.failed += 1
            result.failures.append(Failure(record_full_id(record), f"ignored: {ignored[0]['reason']}",
                                           ", ".join(k["knob"] for k in ignored)))
        elif any(k["status"] == "ok" for k in knobs):
            result.passed += 1
        else:
            result.unsupported += 1  # every knob n/a: nothing in this case to see


def judge_checkpoints(run: CertifyRun, result: FamilyResult) -> None:
    from harness.selection.matrix import AXES

    if "checkpoint" not in AXES:
        result.note = "not yet available: the case matrix has no checkpoint axis"
        return
    _judge_numbers(result, [r for r in run.records() if r.case.get("checkpoint") not in (None, "none", False)])
    if not (result.passed or result.failed or result.unsupported):
        result.note = "no case of this run exercises a checkpoint"


def judge_flat_param(run: CertifyRun, result: FamilyResult) -> None:
    judge_tests(run, result)
    if result.unsupported and not (result.passed or result.failed):
        result.note = result.note or "the engine exposes no FlatParamHandle"


def _torch_testing_missing() -> str | None:
    try:
        importlib.import_module("torch.testing._internal.common_fsdp")
    except ImportError as exc:
        return f"torch's testing extras do not import (torch.testing._internal.common_fsdp: {exc}); install what it names"
    return None


#: Every family, in certificate order.
FAMILIES: tuple[Family, ...] = (
    Family("seeds", "ported tests' behaviours: the ported suites (pytest --engine SPEC)", judge_tests, seeds_tests),
    Family("parity-ddp", "generated parity against DDP", judge_parity("ddp")),
    Family("parity-local", "generated parity against the unsharded local reference", judge_parity("local")),
    Family("knobs", "knob propagation: every setting shows its effect", judge_knobs),
    Family("checkpoints", "checkpoints: save, load and resume", judge_checkpoints),
    Family("flat-param", "flat-parameter metadata against torch FSDP1's layout", judge_flat_param, flat_param_tests),
    Family("torch-common-fsdp", "torch's own FSDP parity machinery (common_fsdp) over the engine", judge_tests,
           torch_common_tests),
)


# ---------------------------------------------------------------------------------------------------
# The command


def _case_pages(out: Path, results: Sequence[FamilyResult]) -> dict[str, str]:
    """The report of the certification's cases (``report/``, with a page per case that did not pass), and
    the page of every failing case, relative to ``out``, for the certificate to link to."""
    import reports
    from reports.case_page import case_href

    if not (out / "results.jsonl").exists():
        return {}
    reports.build([out / "results.jsonl"], out / REPORT_DIR)
    failing = {f.case for r in results for f in r.failures}
    return {c: f"{REPORT_DIR}/{case_href(c)}" for c in sorted(failing) if (out / REPORT_DIR / case_href(c)).exists()}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", required=True,
                   help="the engine: a registered name or a spec NAME=fsdp1:MODULE, NAME=fsdp2:MODULE, NAME=MODULE:OBJECT")
    p.add_argument("--quick", action="store_true",
                   help="what CI can afford: the core ported checks and the smoke cases of one small model (2 steps)")
    p.add_argument("--families", default=",".join(f.name for f in FAMILIES),
                   help=f"comma list of families (default all: {','.join(f.name for f in FAMILIES)})")
    p.add_argument("--out", type=non_empty_path, default=None, help="directory for the certificate (default certificates/NAME-TIME)")
    p.add_argument("--world-size", type=int, default=None, help="ranks per case (default: every local GPU where there are 2 or more, else 2)")
    add_placement(p)
    add_case_timeout(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    from harness.engines.registry import EngineSpecError, check_engines, resolve
    from harness.ranks.placement import PlacementError, n_gpus as visible_gpus, place
    from harness.ranks.pool import PoolStartError

    try:
        (spec,) = check_engines([args.engine], "--engine")
    except EngineSpecError as exc:
        print(f"harness certify: {exc}", file=sys.stderr)
        return 2
    names = [n.strip() for n in args.families.split(",") if n.strip()]
    unknown = [n for n in names if n not in {f.name for f in FAMILIES}]
    if unknown or not names:
        print(f"harness certify: --families {unknown or args.families!r}: choose from {[f.name for f in FAMILIES]}", file=sys.stderr)
        return 2
    adapter = resolve(spec)
    n_gpus = visible_gpus()
    world_size = args.world_size or (n_gpus if n_gpus >= 2 else 2)
    try:
        lane = place(world_size, n_gpus, args.backend, args.device)
    except PlacementError as exc:
        print(f"harness certify: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path("certificates") / f"{adapter.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # read-only, or a file in the way
        print(f"harness certify: --out {out}: {exc.strerror or exc}; choose another directory", file=sys.stderr)
        return 2
    if (out / "results.jsonl").exists():
        print(f"harness certify: --out {out} already holds a certification; choose a new directory", file=sys.stderr)
        return 2
    run = CertifyRun(
        spec=spec, name=adapter.name, quick=args.quick, lane=lane, out=out,
        case_timeout_s=args.case_timeout_s, progress=not args.no_progress,
        families=[f for f in FAMILIES if f.name in names],
    )
    results = []
    for family in FAMILIES:
        result = FamilyResult(family.name, family.description)
        if family.name not in names:
            result.note = "not selected (--families)"
        else:
            print(f"certify {adapter.name}: {family.name} ...", file=sys.stderr)
            try:
                family.judge(run, result)
            except PoolStartError as exc:
                print(f"harness certify: the ranks of {lane} did not run the cases: {exc}", file=sys.stderr)
                return 2
        results.append(result)
    cert = Certificate(adapter.name, spec, adapter.version(), _environment(run, n_gpus), results,
                       _case_pages(out, results), _coverage(run, results))
    try:
        with staged(out) as stage:  # the three files whole, or none of them
            for name, text in (("certificate.md", markdown(cert)), ("certificate.html", render_html(cert)),
                               ("certificate.json", to_json(cert))):
                (stage / name).write_text(text, encoding="utf-8")
    except OSError as exc:  # a full or read-only disk: one line, not a traceback
        print(f"harness certify: cannot write the certificate into {out}: {exc.strerror or exc}: {exc.filename}",
              file=sys.stderr)
        return 2
    print(markdown(cert))
    print(f"certificate: {out / 'certificate.md'} (.html, .json)")
    return 0 if cert.ok else 1


#: the families judged on the generated cases, and which of the run's records each judges.
CASE_FAMILIES: dict[str, Callable[[dict[str, Any]], bool]] = {
    "parity-ddp": lambda case: case.get("reference") == "ddp",
    "parity-local": lambda case: case.get("reference") == "local",
    "knobs": lambda case: True,
    "checkpoints": lambda case: case.get("checkpoint") not in (None, "none"),
}


def _coverage(run: CertifyRun, results: Sequence[FamilyResult]) -> dict[str, dict[str, list[Any]]]:
    """Per case family that ran something, the declared strategies and precisions none of its cases ran
    (``harness.collect.coverage``): what makes a certificate PARTIAL rather than CONFORMS."""
    from harness.collect.coverage import declared_values, family_coverage

    ran = [f.name for f in results if f.name in CASE_FAMILIES and (f.passed or f.failed)]
    if not ran:
        return {}
    declared = declared_values(run.spec, run.world_size)
    cases = [r.case for r in run.records() if r.verdict != "unsupported"]
    return {name: family_coverage(name, [c for c in cases if CASE_FAMILIES[name](c)], declared) for name in ran}


def _environment(run: CertifyRun, n_gpus: int) -> dict[str, Any]:
    import platform

    from harness.collect.collector import run_info

    info = run_info([run.lane])
    devices = "CPU" if run.lane.devices is None else f"GPUs {list(run.lane.devices)} of {n_gpus} ({info.gpu})"
    return {
        "mode": "quick" if run.quick else "pairwise matrix, full ported suites",
        "torch": info.torch_version,
        "python": platform.python_version(),
        "backend": run.lane.backend,
        "device": run.lane.device,
        "ranks_per_gpu": run.lane.ranks_per_gpu,
        "world_size": run.world_size,
        "devices": devices,
        "nccl": info.nccl_version,
        "git_rev": info.git_rev,
        "host": info.host,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
