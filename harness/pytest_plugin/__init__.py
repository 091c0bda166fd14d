"""pytest plugin of the project: options, hooks and fixtures of the generated parity suites.

Loaded by the root ``conftest.py``. What it adds:

- options ``--engines`` (also ``--engine``), ``--references`` (also ``--reference``), ``--matrix`` (smoke |
  pairwise | full), ``--world-size``, ``--backend``, ``--device``, ``--case-timeout``, ``--loop-axes`` (the
  command line's, from ``harness.run.options.SelectionOptions``: same names, checks and messages) and
  ``--results`` (see ``pytest --help``, group "parity"); ``--loop-axes`` deselects the generated cases of every suite that varies no training-loop
  axis (``SuiteMatrix.varies_loop_axes``), as ``harness run --loop-axes`` selects that slice;
- ``@pytest.mark.parity_matrix(SuiteMatrix(...))`` on a test that takes ``parity_case``: the test is
  parametrized with the suite's cases for the chosen lane (``harness.pytest_plugin.cases``), each with its
  ``CaseConfig.full_id`` as test id (``-k 'full_shard-bf16'`` selects), marked ``slow`` outside the
  smoke tier and ``gpu`` where its ranks run on GPUs;
- ``@pytest.mark.engine_cases`` on a test (or module) whose parameters are hand-written ``CaseConfig``s: the
  cases on engines or references ``--engine``/``--reference`` leave out are deselected (``outside_options``),
  so a suite's own cases obey the options as the generated ones do, and start no pool;
- ``fsdp_api``: a test or fixture that takes it runs once per requested engine with torch FSDP1's API
  (of ``--engine``: ``builtin``, ``torch-fsdp``, any ``NAME=fsdp1:MODULE``; the ported
  suites); its value is the engine's spec, which the rank processes resolve again, its test id the name;
- fixtures ``parity_options``, ``parity_pools`` (one rank pool per world size, started once per pytest
  process and shared by every generated case) and ``parity_runner`` (runs a case, records it, maps its
  verdict: pass passes, unsupported skips with the engine's reason, fail / error / timeout / crash fail
  with the details; ``run_all`` runs the cases of one check, a ported check's subtests, under one verdict;
  a test's strict xfail, ``expect_failure`` of a ``harness.collect.expectations.ExpectedFailure``, puts its reason on
  its records: ``CaseRecord.expected_failure``);
- a test marked ``gpu`` is skipped with the reason where torch sees no CUDA GPU.

Under pytest-xdist every worker's pools take a disjoint block of the GPUs where there are enough, and
share the GPUs evenly where there are more workers than blocks (``plan_pool``: with ``-n 8`` on two GPUs
every worker's two-rank pool runs on both GPUs); the report header says which. A job's NCCL ranks hold
GPU slots shared by the workers (``harness.ranks.gpu_slots``), so no GPU carries more than
``MAX_NCCL_RANKS_PER_GPU`` computing NCCL ranks at once. Every worker appends its records to its own file (``worker_results_path``) and the controller
merges them into ``--results`` at the end of the pytest run (no ``--results``: nothing is written).
Tests that share an expensive module-scoped set-up (a fixture marked ``xdist_groups.one_worker``) get an
``xdist_group`` per instance of it; the project's ``addopts`` pick ``--dist loadgroup``, so they run on one worker.

The terminal summary counts the generated cases by verdict, and says where the engines agree: every ported
check (``fsdp_api``) and every generated case that ran on two engines, with each disagreement listed.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import secrets
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from harness.cases.case import CaseConfig, engine_name
from harness.cases.records import CaseRecord
from harness.collect.expectations import ExpectedFailure
from harness.pytest_plugin.cases import Agreement, ParityOptions, SuiteMatrix, TestOutcome, outcome_of, plan_pool, verdict_table
from harness.pytest_plugin.pools import PoolRegistry, RankPools, gpus_missing, plan_here, skip_here
from harness.pytest_plugin.xdist_groups import batch_groups
from harness.ranks.mps import MPS_CHOICES, MPS_HELP, MpsDaemon, MpsError
from harness.run.options import SelectionOptions, as_typed, option_specs

if TYPE_CHECKING:
    from harness.collect.collector import ResultWriter
    from harness.ranks.placement import Lane

OPTIONS_KEY = pytest.StashKey[ParityOptions]()
RESULTS_KEY = pytest.StashKey["ParityResults"]()
MPS_KEY = pytest.StashKey[MpsDaemon]()

#: ``user_properties`` a generated case leaves on its report, read by the controller's summary.
VERDICT_PROPERTY = "parity_verdict"
WALL_PROPERTY = "parity_wall_s"
#: ``user_properties`` that say which engine a test ran on and what it checked apart from the engine,
#: for the agreement summary (ported checks under ``fsdp_api``, generated cases).
ENGINE_PROPERTY = "conformance_engine"
KEY_PROPERTY = "conformance_key"
#: ``workerinput`` key that hands the controller's run id to every xdist worker.
RUN_ID_INPUT = "parity_run_id"


# ---------------------------------------------------------------------------------------------------
# Options


def pytest_addoption(parser: pytest.Parser) -> None:
    """The options ``harness.run.options.SelectionOptions`` offers pytest (the command line's names, checks and
    messages; an alias is an option of its own, so an error names it as typed), and ``--results``."""
    group = parser.getgroup("parity", "generated parity cases (harness.pytest_plugin)")
    defaults = {f.name: f.default for f in dataclasses.fields(SelectionOptions)}
    for spec in option_specs("pytest"):
        # The model's default (None: not given, which ``ParityOptions`` fills in), so that a test reading
        # ``getoption("matrix")`` sees ``smoke``; an alias carries it too, as pytest sets every default.
        kw: dict[str, Any] = {"dest": spec.field, "default": defaults[spec.field]}
        kw.update(action="store_true") if spec.kind == "flag" else kw.update(choices=spec.choices, metavar=spec.metavar)
        group.addoption(spec.flag, help=spec.help_for("pytest"), **kw)
        for alias in spec.aliases_for("pytest"):
            group.addoption(alias, help=argparse.SUPPRESS, **kw)
    group.addoption("--gpu-slots", type=_slots_count, default=None, metavar="N",
                    help="under pytest-xdist: NCCL ranks of all workers computing on one GPU at once (default: "
                         "harness.ranks.gpu_slots.MAX_NCCL_RANKS_PER_GPU; 0: no limit)")
    group.addoption("--mps", choices=MPS_CHOICES, default="off",
                    help=MPS_HELP + "; over the xdist workers' pools, for the whole pytest run (default: off: not "
                         "yet measured on the tree; the nightly's front ends default to auto)")
    group.addoption("--results", default=None, metavar="FILE",
                    help="append every generated case's record to this JSON Lines file (default: none); "
                         "xdist workers write FILE's per-worker siblings, merged into FILE at the end")


def _slots_count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number of NCCL ranks per GPU (0: no limit)")
    return int(text)


def pytest_configure(config: pytest.Config) -> None:
    try:
        texts = {spec.field: config.getoption(spec.field) for spec in option_specs("pytest")}
        options = ParityOptions.from_options(SelectionOptions.parse(texts), config.getoption("results"))
    except ValueError as exc:
        raise pytest.UsageError(as_typed(str(exc), config.invocation_params.args, "pytest")) from None
    config.stash[OPTIONS_KEY] = options
    config.addinivalue_line(
        "markers", "parity_matrix(suite): parametrize the test's parity_case with a harness.pytest_plugin.cases.SuiteMatrix"
    )
    config.addinivalue_line(
        "markers", "timeout(seconds): pytest-timeout's limit for the test where it is installed (the rank-check "
        "tests carry their module's whole batch: harness.pytest_plugin.rank_checks.batch_timeout)"
    )
    config.addinivalue_line(
        "markers", "engine_cases: the test's CaseConfig parameters run on the engines and references they name: "
        "--engine and --reference deselect those naming others (as the generated suites leave them out)"
    )
    results = ParityResults(config, options)
    config.stash[RESULTS_KEY] = results
    config.pluginmanager.register(results, "parity-results")
    if not results.is_worker:
        # The controller's environment is the workers' (and their ranks'): the daemon is found there.
        daemon = MpsDaemon(config.getoption("mps"), [_planned_lanes(config, options)])
        try:
            daemon.__enter__()
        except MpsError as exc:
            raise pytest.UsageError(str(exc)) from None
        config.stash[MPS_KEY] = daemon
    if results.is_worker:
        # Workers place their pools independently; the slots keep their NCCL ranks from crowding a GPU
        # ([Note: NCCL under time-slicing]).
        from harness.ranks import gpu_slots

        per_gpu = config.getoption("gpu_slots")
        per_gpu = gpu_slots.MAX_NCCL_RANKS_PER_GPU if per_gpu is None else per_gpu
        if per_gpu:
            gpu_slots.install(gpu_slots.GpuSlots(gpu_slots.run_slots_dir(results.run_id), per_gpu))


def pytest_unconfigure(config: pytest.Config) -> None:
    from harness.ranks import gpu_slots

    results = config.stash.get(RESULTS_KEY, None)
    if results is None:
        return
    if results.is_worker:
        gpu_slots.install(None)
    else:
        gpu_slots.GpuSlots(gpu_slots.run_slots_dir(results.run_id)).remove()
        daemon = config.stash.get(MPS_KEY, None)
        if daemon is not None:
            daemon.__exit__(None, None, None)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """``-n auto`` on a GPU host: no more workers than its GPUs' memory holds (``xdist_auto_workers``)."""
    from harness.ranks.placement import host_facts, n_gpus, xdist_auto_workers

    return xdist_auto_workers(host_facts()) if n_gpus() else None


def _n_xdist_workers(config: pytest.Config) -> int:
    # pytest-xdist has turned ``-n auto`` into a number before pytest_configure; ``-n 0`` runs in-process.
    return int(getattr(config.option, "numprocesses", None) or 1)


def _planned_lanes(config: pytest.Config, options: ParityOptions) -> list[Lane]:
    """The generated cases' pools of every xdist worker, as ``plan_pool`` places them: what runs at once."""
    from harness.ranks.placement import n_gpus

    gpus, n_workers = n_gpus(), _n_xdist_workers(config)
    plans = [plan_pool(ws, options.backend, gpus, w, n_workers, options.device)
             for w in range(n_workers) for ws in options.world_sizes]
    return [plan.lane for plan in plans if plan.lane is not None]


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Where the generated cases' ranks run, per world size (on the controller: before the workers start)."""
    from harness.ranks.placement import gpus_shared, host_facts, n_gpus, xdist_overcommit

    options = config.stash[OPTIONS_KEY]
    gpus = n_gpus()
    n_workers = _n_xdist_workers(config)
    daemon = config.stash.get(MPS_KEY, None)
    lines = [f"parity: {daemon.state.describe()}"] if daemon is not None and daemon.state.wanted else []
    for ws in options.world_sizes:
        plan = plan_pool(ws, options.backend, gpus, 0, n_workers, options.device)
        if plan.lane is None:
            where = f"skipped: {plan.skip_reason}"
        else:
            where = plan.lane.describe()
            if plan.lane.devices is not None and n_workers > 1:
                where += (f", {n_workers} xdist workers share them (timings are noisy)"
                          if gpus_shared(ws, gpus, n_workers) else f", a disjoint block per xdist worker ({n_workers})")
        lines.append(f"parity: --matrix {options.matrix}, world size {ws}: {where}")
    if options.loop_axes:
        lines.append("parity: --loop-axes: only the generated suites that vary a training-loop axis")
    if gpus and (overcommit := xdist_overcommit(host_facts(), n_workers)):
        lines.append(f"parity: warning: {overcommit}")
    return lines


# ---------------------------------------------------------------------------------------------------
# Generation and markers


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    options = metafunc.config.stash[OPTIONS_KEY]
    if "parity_case" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("parity_matrix")
        if marker is None or not marker.args or not isinstance(marker.args[0], SuiteMatrix):
            raise pytest.UsageError(
                f"{metafunc.definition.nodeid} takes parity_case but has no "
                "@pytest.mark.parity_matrix(SuiteMatrix(...)): say which slice of the matrix it runs"
            )
        suite: SuiteMatrix = marker.args[0]
        marks = [pytest.mark.slow] if options.matrix != "smoke" else []
        gpu = {ws: plan_here(ws, options).devices is not None for ws in options.world_sizes}

        def case_marks(case: CaseConfig) -> list[pytest.MarkDecorator]:
            device = "cuda" if gpu[case.world_size] else "cpu"
            expected = suite.expected_failure(case, device)
            xfail = [expect_failure(expected)] if expected else []
            return [*marks, *([pytest.mark.gpu] if device == "cuda" else []), *xfail]

        metafunc.parametrize("parity_case", [pytest.param(c, id=c.full_id, marks=case_marks(c)) for c in suite.cases(options)])
    if "fsdp_api" in metafunc.fixturenames:
        engines: list[Any] = [pytest.param(spec, id=engine_name(spec)) for spec in options.fsdp1_engines] or [pytest.param(
            None, id="no-fsdp1-engine",
            marks=pytest.mark.skip(reason=f"--engine {','.join(options.engines)} names no engine with torch FSDP1's API "
                                          "(e.g. builtin, torch-fsdp, NAME=fsdp1:MODULE)"),
        )]
        # Module scope: a ported module spawns its ranks once per engine, not once per check.
        metafunc.parametrize("fsdp_api", engines, scope="module")


def outside_options(item: pytest.Item, options: ParityOptions) -> bool:
    """Whether a test marked ``engine_cases`` runs a case (a ``CaseConfig`` parameter) on an engine or a
    reference that ``--engine``/``--reference`` leave out (a resumed case needs both of its engines)."""
    if item.get_closest_marker("engine_cases") is None:
        return False
    callspec = getattr(item, "callspec", None)
    engines = {engine_name(e) for e in options.engines}
    for case in (callspec.params.values() if callspec is not None else ()):
        if isinstance(case, CaseConfig):
            used = {case.engine_name, *([engine_name(case.resume_engine)] if case.resume_engine else [])}
            if not used <= engines or case.reference not in options.references:
                return True
    return False


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the cases the options leave out: hand-written cases (``engine_cases``) on other engines or
    references, and under ``--loop-axes`` the generated cases of suites that vary no training-loop axis; give
    the tests of each instance of a ``one_worker`` fixture their pytest-xdist group
    (``xdist_groups.batch_groups``). First, before pytest-xdist names the groups and pytest-split splits the items."""
    options = config.stash[OPTIONS_KEY]
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker("parity_matrix")
        generated = marker is not None and "parity_case" in getattr(item, "fixturenames", ())
        loop_off = options.loop_axes and generated and not marker.args[0].varies_loop_axes
        (dropped if loop_off or outside_options(item, options) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
    batch_groups(items)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    callspec = getattr(item, "callspec", None)
    engine = callspec.params.get("fsdp_api") if callspec is not None else None
    if engine is not None:
        item.user_properties.append((ENGINE_PROPERTY, engine_name(engine)))
        item.user_properties.append((KEY_PROPERTY, _key_without_engine(item, engine_name(engine))))
    if item.get_closest_marker("gpu") is not None:
        import torch

        if not torch.cuda.is_available():
            skip_here("marked gpu: needs CUDA GPUs; torch.cuda.is_available() is False on this machine")


def expect_failure(expected: ExpectedFailure) -> pytest.MarkDecorator:
    """The strict xfail mark of a known engine bug (``harness.collect.expectations.ExpectedFailure``; a pass fails
    the run, so a fixed engine is noticed): what a generated case whose suite expects it to fail carries,
    and what a test applies to itself (``request.applymarker``) when the expectation depends on where its
    ranks run. ``ParityRunner`` records its reason on the test's records (``expected_failure_of``)."""
    return pytest.mark.xfail(strict=True, reason=expected.reason)


def expected_failure_of(node: pytest.Item) -> str | None:
    """The reason of ``node``'s unconditional strict xfail mark (``expect_failure``, or a hand-written one
    alike), None when it has none: its cases' ``CaseRecord.expected_failure``. A conditional or non-strict
    xfail is no expectation a report can hold the engine to."""
    strict_default = bool(node.config.getini("xfail_strict"))
    for mark in node.iter_markers("xfail"):
        if not mark.args and mark.kwargs.get("strict", strict_default):
            return str(mark.kwargs.get("reason", "")) or "expected to fail (strict xfail, no reason given)"
    return None


def _key_without_engine(item: pytest.Item, engine: str) -> str:
    """``test_fsdp_core.py::test_check[builtin-check_x]`` -> ``test_fsdp_core.py::test_check[check_x]``."""
    ids = item.callspec.id.replace(engine, "", 1).replace("--", "-").strip("-")  # type: ignore[attr-defined]
    name = getattr(item, "originalname", item.name)
    return f"{item.path.name}::{name}" + (f"[{ids}]" if ids else "")


def act_on(outcome: TestOutcome) -> None:
    """Make ``outcome`` the running test's: a skip at the test's own location, a failure with its message (no
    traceback of this plugin's), a pass returns. How a case's record (``outcome_of``) and a rank check's
    outcome (``harness.pytest_plugin.rank_checks.CheckOutcome.as_test_outcome``) become a pytest outcome alike."""
    if outcome.action == "skip":
        skip_here(outcome.message)
    if outcome.action == "fail":
        pytest.fail(outcome.message, pytrace=False)


def needs_gpus(n: int, why: str = "") -> pytest.MarkDecorator:
    """``skipif`` with the reason, for tests and modules that need ``n`` CUDA GPUs."""
    reason = gpus_missing(n, why)
    return pytest.mark.skipif(reason is not None, reason=reason or "")


# ---------------------------------------------------------------------------------------------------
# Results: the results file and the verdict summary


class ParityResults:
    """This pytest process's share of the run: its results file, and (on the controller) the verdict counts.

    Registered as a plugin object so its hook methods see every report, including those xdist
    workers send to the controller.
    """

    def __init__(self, config: pytest.Config, options: ParityOptions) -> None:
        self.config = config
        self.options = options
        #: the merged results file; None when ``--results`` is not given.
        self.results = Path(options.results) if options.results else None
        #: True in an xdist worker (which runs tests but reports to a controller).
        self.is_worker = hasattr(config, "workerinput")
        self.run_id = self._run_id()
        #: opened on the first record, so a run without generated cases leaves no file.
        self._writer: ResultWriter | None = None
        self.counts: collections.Counter[str] = collections.Counter()
        self.case_wall_s = 0.0
        #: the ported checks per FSDP1-API engine, and the generated cases per engine.
        self.ported_agreement = Agreement()
        self.case_agreement = Agreement()
        if self.results is not None and not self.is_worker:
            self._refuse_stale_results(self.results)

    def _run_id(self) -> str:
        if self.is_worker:
            given = self.config.workerinput.get(RUN_ID_INPUT)  # type: ignore[attr-defined]
            if given:
                return str(given)
        # Sortable by start time, marked as a pytest run; the suffix separates runs started in one second.
        return f"pytest-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"

    @staticmethod
    def _refuse_stale_results(path: Path) -> None:
        from harness.collect.collector import worker_results_files

        stale = [p for p in [path, *worker_results_files(path)] if p.exists() and p.stat().st_size > 0]
        if stale:
            raise pytest.UsageError(
                f"--results {path}: {', '.join(str(p) for p in stale)} already hold results; "
                "choose a new path or remove them (a killed xdist run leaves per-worker files to merge with "
                "harness.collect.collector.merge_results)"
            )

    # -- records --------------------------------------------------------------------------------------

    def record(self, record: CaseRecord, node: pytest.Item, one_case_test: bool = True) -> None:
        """Append the record to this process's results file and, for a test that is one case, leave its
        verdict on the test report (a test of several cases is summarized by its own outcome)."""
        if one_case_test:
            self._annotate(record, node)
        if self.results is None:
            return
        if self._writer is None:
            from harness.collect.collector import ResultWriter, run_info, worker_results_path

            lanes = [plan.lane for plan in (plan_here(ws, self.options) for ws in self.options.world_sizes) if plan.lane]
            self._writer = ResultWriter(worker_results_path(self.results), run_info(lanes or "none", self.run_id))
        self._writer.append(record)

    @staticmethod
    def _annotate(record: CaseRecord, node: pytest.Item) -> None:
        node.user_properties.append((VERDICT_PROPERTY, record.verdict))
        node.user_properties.append((WALL_PROPERTY, record.wall_s))
        case = record.case
        name = getattr(node, "originalname", node.name)
        node.user_properties.append((ENGINE_PROPERTY, engine_name(case["engine"])))
        node.user_properties.append((KEY_PROPERTY, f"{name}[{case['reference']}:{record.case_id}]"))

    # -- hooks ----------------------------------------------------------------------------------------

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node: Any) -> None:
        """xdist (controller): every worker records under the controller's run id."""
        node.workerinput[RUN_ID_INPUT] = self.run_id

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if self.is_worker:
            return
        props = dict(report.user_properties)
        if VERDICT_PROPERTY in props:
            if report.when == "call":
                self.counts[props[VERDICT_PROPERTY]] += 1
                self.case_wall_s += float(props.get(WALL_PROPERTY, 0.0))
                self.case_agreement.add(props[KEY_PROPERTY], props[ENGINE_PROPERTY], props[VERDICT_PROPERTY])
        elif KEY_PROPERTY in props:
            # A ported check: the worst of its phases (a failing rank-checks fixture fails at setup).
            self.ported_agreement.add(props[KEY_PROPERTY], props[ENGINE_PROPERTY], report.outcome)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self._writer is not None:
            self._writer.close()
        if self.is_worker or self.results is None:
            return
        from harness.collect.collector import merge_results, worker_results_files

        parts = worker_results_files(self.results)
        if parts:
            merge_results(parts, self.results)
            for part in parts:
                part.unlink()

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.ported_agreement.compared():
            terminalreporter.write_sep("-", "ported torch tests: where the FSDP1-API engines agree")
            terminalreporter.write_line(self.ported_agreement.render("ported check"))
        if not self.counts:
            return
        terminalreporter.write_sep("-", "generated parity cases")
        terminalreporter.write_line(verdict_table(self.counts, self.case_wall_s, self.options.matrix))
        if self.case_agreement.compared():
            terminalreporter.write_line(self.case_agreement.render("case"))
        if self.results is not None and self.results.exists():
            terminalreporter.write_line(f"records: {self.results}")


# ---------------------------------------------------------------------------------------------------
# Pools and the runner


class ParityRunner:
    """Runs one generated case for one test: on the shared pool, recorded, verdict mapped to pytest."""

    def __init__(self, pools: PoolRegistry, results: ParityResults, node: pytest.Item) -> None:
        self.pools = pools
        self.results = results
        self.node = node

    def device_type(self, world_size: int) -> str:
        """``cuda`` where this process's pool of ``world_size`` ranks runs on GPUs, else ``cpu`` (what an
        expected failure measured on one kind of device is conditioned on)."""
        return "cpu" if plan_here(world_size, self.pools.options).devices is None else "cuda"

    def _expected(self, record: CaseRecord) -> CaseRecord:
        """``record`` with the test's expected failure (its strict xfail mark), the one decision that made the
        mark, so a report tells a known engine bug from new breakage."""
        record.expected_failure = expected_failure_of(self.node)
        return record

    def run(self, case: CaseConfig, timeout_s: float | None = None) -> CaseRecord:
        """The case's record when it passed; otherwise skips (unsupported) or fails the test.
        ``timeout_s`` overrides ``--case-timeout`` for this case (a test of a hang need not wait long)."""
        from harness.run.runner import run_case

        pool = self.pools.pool_for(case.world_size)
        record = self._expected(run_case(pool, case, timeout_s=timeout_s))
        self.results.record(record, self.node)
        act_on(outcome_of(record))
        return record

    def run_all(self, cases: Sequence[CaseConfig]) -> list[CaseRecord]:
        """Every case of a test that checks several (a ported check and its subtests, one verdict as the
        ported test has it), each recorded; fails the test naming every failing case, skips it when no case
        could run (the first reason), else returns the records."""
        from harness.run.runner import run_case

        records = []
        for case in cases:
            records.append(self._expected(run_case(self.pools.pool_for(case.world_size), case)))
            self.results.record(records[-1], self.node, one_case_test=False)
        outcomes = [(record, outcome_of(record)) for record in records]
        failed = [f"{CaseConfig.from_dict(r.case).full_id}: {o.message}" for r, o in outcomes if o.action == "fail"]
        if failed:
            pytest.fail(f"{len(failed)} of {len(records)} cases failed:\n" + "\n".join(failed), pytrace=False)
        if all(o.action == "skip" for _, o in outcomes):
            skip_here(outcomes[0][1].message if outcomes else "no case to run")
        return records


@pytest.fixture(scope="session")
def parity_options(pytestconfig: pytest.Config) -> ParityOptions:
    """The parsed parity options of this run."""
    return pytestconfig.stash[OPTIONS_KEY]


@pytest.fixture(scope="session")
def parity_pools(parity_options: ParityOptions) -> Iterator[PoolRegistry]:
    """One rank pool per world size for the whole pytest run (per xdist worker)."""
    registry = PoolRegistry(parity_options)
    try:
        yield registry
    finally:
        registry.close()


@pytest.fixture
def parity_runner(parity_pools: PoolRegistry, pytestconfig: pytest.Config, request: pytest.FixtureRequest) -> ParityRunner:
    """Runs ``parity_case`` (or any case) on the shared pool and turns its verdict into the test's outcome."""
    return ParityRunner(parity_pools, pytestconfig.stash[RESULTS_KEY], request.node)


__all__ = [
    "act_on",
    "ParityRunner",
    "expect_failure",
    "expected_failure_of",
    "ParityResults",
    "PoolRegistry",
    "RankPools",
    "gpus_missing",
    "needs_gpus",
    "parity_options",
    "parity_pools",
    "parity_runner",
    "skip_here",
]
