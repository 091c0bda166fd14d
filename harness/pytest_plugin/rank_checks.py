"""Rank checks: many checks of one test module run in one set of rank processes (started once per module).

Torch's own FSDP tests spawn ``world_size`` processes per test, which costs seconds each on a
small machine. Here a test module lists its checks (module-level functions ``check(rank,
world_size)``), one :class:`harness.ranks.pool.RankPool` starts the ranks once, every check runs on
every rank in order in the same process group, and each pytest test asserts the outcome of its check.
The pool is held as every pool a test runs on is (``harness.pytest_plugin.pools.RankPools``, through
``placed_pool``); the generated cases run on the plugin's shared ``RankPools`` instead (``ParityRunner``).

The pool is the harness's own, so a check that hangs is a timeout with every rank's stack, a rank
that dies is a crash with its stderr, and a check that fails on one rank while its peers wait in a
collective is an error after the pool's grace period; in each case the pool is respawned and the
next check runs on fresh ranks.

A check may call ``pytest.skip(reason=...)`` before its first collective (on every rank alike, e.g. a
feature the engine under test lacks here): the test skips with that reason and the other checks go on.
Checks can take leading arguments (``args``, e.g. the engine API of the ported suites):
``check(*args, rank, world_size)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import pytest
import torch

from harness.collect.expectations import ExpectedFailure, expected_failure
from harness.pytest_plugin import act_on, expect_failure
from harness.pytest_plugin.cases import TestOutcome
from harness.pytest_plugin.pools import gpus_missing, placed_pool
from harness.pytest_plugin.xdist_groups import one_worker
from harness.ranks.placement import DeviceChoice
from harness.ranks.pool import PoolConfig, PoolOutcome
from harness.ranks.rank import RankContext

__all__ = ["CheckOutcome", "RankChecks", "api_rank_check_tests", "batch_timeout", "rank_check_tests", "rank_checks_fixture",
           "run_checks"]

Check = Callable[..., None]


@dataclasses.dataclass(frozen=True)
class CheckOutcome:
    """What one check did on every rank."""

    name: str
    #: per rank: None when it passed, else the formatted traceback or the reason it did not run.
    errors: tuple[str | None, ...]
    #: per rank: the reason the check skipped itself there, else None.
    skips: tuple[str | None, ...] = ()

    @property
    def passed(self) -> bool:
        return all(e is None for e in self.errors)

    @property
    def skip_reason(self) -> str | None:
        """The reason when every rank skipped the check; None when it ran (on some ranks at least)."""
        if self.skips and all(s is not None for s in self.skips):
            return self.skips[0]
        return None

    def report(self) -> str:
        return "\n".join(f"--- rank {r} ---\n{e}" for r, e in enumerate(self.errors) if e is not None)

    def as_test_outcome(self) -> TestOutcome:
        """What pytest makes of it, as of a case's record (``harness.pytest_plugin.cases.outcome_of``): a
        failure with every failing rank's report, a skip when every rank skipped, a failure when only some
        ranks skipped (they would wait in each other's collectives), else a pass."""
        if not self.passed:
            return TestOutcome("fail", f"check {self.name} failed:\n{self.report()}")
        reason = self.skip_reason
        if reason is not None:
            return TestOutcome("skip", reason)
        ran = [r for r, s in enumerate(self.skips) if s is None]
        if self.skips and len(ran) != len(self.skips):
            return TestOutcome("fail", f"check {self.name} skipped on some ranks but ran on ranks {ran}: {self.skips}")
        return TestOutcome("pass")


def _run_check(ctx: RankContext, job: tuple[Check, tuple[Any, ...]]) -> str | None:
    """The pool job: one check on this rank; returns the skip reason, or None when it ran."""
    check, args = job
    torch.manual_seed(0)
    try:
        check(*args, ctx.rank, ctx.world_size)
    except pytest.skip.Exception as skip:
        return str(skip.msg)
    return None


def outcome_of_check(name: str, outcome: PoolOutcome, world_size: int) -> CheckOutcome:
    """A pool outcome as a check outcome: each rank's traceback, or why it gave no answer."""
    if outcome.status == "ok":
        return CheckOutcome(name, (None,) * world_size, tuple(outcome.values))
    errors: list[str | None] = []
    skips: list[str | None] = []
    for r in range(world_size):
        # After an error, a rank with neither a traceback nor a stack answered normally.
        answered = outcome.status == "error" and r not in outcome.errors and r not in outcome.stacks
        if r in outcome.errors:
            errors.append(outcome.errors[r].traceback)
        elif answered:
            errors.append(None)
        else:
            detail = outcome.stacks.get(r) or outcome.stderr_tails.get(r, "")
            errors.append(f"{outcome.status}: {outcome.reason}\n{detail}".rstrip())
        skips.append(outcome.values[r] if answered else None)
    return CheckOutcome(name, tuple(errors), tuple(skips))


def run_checks(
    checks: Sequence[Check],
    world_size: int = 2,
    device: DeviceChoice = "cpu",
    timeout_s: float = 120.0,
    args: tuple[Any, ...] = (),
) -> dict[str, CheckOutcome]:
    """Start ``world_size`` ranks once, run every check on each (``check(*args, rank, world_size)``),
    return outcomes by check name; ``timeout_s`` bounds each check. ``device='cuda'`` places the ranks
    on this worker's GPUs by ``harness.ranks.placement.place`` (NCCL with one GPU per rank where there are
    enough, gloo ranks sharing them where there are fewer); a check finds its device with
    ``harness.ranks.rank.rank_device()``."""
    outcomes: dict[str, CheckOutcome] = {}
    with placed_pool(world_size, device, timeout_s=timeout_s, threads_per_rank=1 if device == "cpu" else None) as pool:
        for check in checks:
            outcomes[check.__name__] = outcome_of_check(check.__name__, pool.run(_run_check, (check, args)), world_size)
    return outcomes


class RankChecks:
    """The outcomes of one spawn of the ranks for a module's checks, looked up by check (for a module-scoped
    fixture)."""

    def __init__(self, outcomes: dict[str, CheckOutcome], engine: str = "", device: DeviceChoice = "cpu") -> None:
        self.outcomes = outcomes
        #: the engine spec and the device the checks ran with (for expected failures).
        self.engine = engine
        self.device = device

    def assert_passed(self, check: Check | str) -> None:
        """Fails the test with every rank's report, skips it when every rank skipped, else passes
        (``CheckOutcome.as_test_outcome``, made the test's as a case's is: ``harness.pytest_plugin.act_on``)."""
        act_on(self.outcomes[check if isinstance(check, str) else check.__name__].as_test_outcome())


def batch_timeout(n_checks: int, timeout_s: float) -> pytest.MarkDecorator:
    """pytest-timeout's limit for a module's rank-check tests: the first one's set-up runs every check of
    the module (the fixture), each bounded by the pool's watchdog (``timeout_s``) and the ranks' start by
    ``PoolConfig.start_timeout_s``; a per-test ``--timeout`` below that (300 s is common) would end a
    worker whose checks are all within their own limits (a module of use_orig_params checks took 307 s
    on CUDA ranks of a 4-GPU host under ``-n 16``). Without pytest-timeout the mark does nothing."""
    return pytest.mark.timeout(n_checks * timeout_s + PoolConfig.start_timeout_s)


def rank_checks_fixture(
    checks: Sequence[Check],
    world_size: int = 2,
    device: DeviceChoice | tuple[DeviceChoice, ...] = "cpu",
    timeout_s: float = 240.0,
    args: tuple[Any, ...] = (),
):
    """A module-scoped fixture whose value is the :class:`RankChecks` of ``checks`` (``run_checks``: one
    spawn of the ranks for them all), named as the module binds it::

        checks_4 = rank_checks_fixture(CHECKS_4, world_size=4)

    ``device=("cpu", "cuda")`` runs every check on CPU ranks and again on ranks on the GPUs (sharing one
    where there are fewer GPUs than ranks); the CUDA run skips, with the reason, on a host without. Its
    tests run on one pytest-xdist worker per device (``xdist_groups.one_worker``): a worker that got one of
    them would run every check again.
    """
    devices, params = _device_params(device)

    @pytest.fixture(scope="module", **params)
    @one_worker
    def rank_checks(request: pytest.FixtureRequest) -> RankChecks:
        where = _checks_device(request, devices)
        return RankChecks(run_checks(checks, world_size=world_size, device=where, timeout_s=timeout_s, args=args),
                          device=where)

    return rank_checks


def rank_check_tests(
    checks: Sequence[Check],
    world_size: int = 2,
    device: DeviceChoice | tuple[DeviceChoice, ...] = "cpu",
    timeout_s: float = 240.0,
):
    """A module-scoped ``rank_checks`` fixture (``rank_checks_fixture``) and a test per check, for a test
    module's namespace::

        rank_checks, test_check = rank_check_tests(CHECKS)
    """
    fixture = rank_checks_fixture(checks, world_size, device, timeout_s)

    @batch_timeout(len(checks), timeout_s)
    @pytest.mark.parametrize("check", list(checks), ids=lambda c: c.__name__)
    def test_check(rank_checks: RankChecks, check: Check) -> None:
        rank_checks.assert_passed(check)

    return fixture, test_check


def _device_params(device: DeviceChoice | tuple[DeviceChoice, ...]) -> tuple[tuple[DeviceChoice, ...], dict[str, Any]]:
    devices = device if isinstance(device, tuple) else (device,)
    # One device keeps the test ids as they were; several add ``on_cpu``/``on_cuda``.
    params = {"params": devices, "ids": [f"on_{d}" for d in devices]} if len(devices) > 1 else {}
    return devices, params


def _checks_device(request: pytest.FixtureRequest, devices: tuple[DeviceChoice, ...]) -> DeviceChoice:
    """The device of this parametrization of the checks; skips the CUDA one, saying why, without a GPU."""
    where: DeviceChoice = getattr(request, "param", devices[0])
    chosen = request.config.getoption("device", default="auto")
    if len(devices) > 1 and chosen in devices and where != chosen:
        # ``--device`` narrows checks run on both (``harness certify`` passes its placement's).
        pytest.skip(reason=f"--device {chosen}: the {where} rank checks are not selected")
    if where == "cuda" and (reason := gpus_missing(1)):
        pytest.skip(reason=reason)
    return where


#: why a check of ``slow_checks`` did not run: the tier.
SLOW_TIER = ("runs with --matrix pairwise|full (the slow tier: the ported test's whole product); the CI tier runs a "
             "representative part of it")


def api_rank_check_tests(
    checks: Sequence[Check],
    load_api: Callable[[str], Any],
    world_size: int = 2,
    device: DeviceChoice | tuple[DeviceChoice, ...] = "cpu",
    timeout_s: float = 240.0,
    expected_failures: Sequence[ExpectedFailure] = (),
    slow_checks: Sequence[Check] = (),
):
    """``rank_check_tests`` once per engine of the ``fsdp_api`` parametrization (``harness.pytest_plugin``:
    the engines with torch FSDP1's API that ``--engines`` names) and per device. Each check is called
    ``check(api, rank, world_size)`` with ``api = load_api(fsdp_api)``, built in the parent and pickled
    to the ranks; the ranks are spawned once per engine and device::

        rank_checks, test_check = api_rank_check_tests(CHECKS, load_api, device=("cpu", "cuda"))

    ``expected_failures`` names what an engine gets wrong (its checks by name, ``ExpectedFailure.checks``,
    on a device): those tests are strict xfails there (a pass fails the test, so a fixed engine is noticed).

    ``slow_checks`` (a ported test's whole product, where a check of ``checks`` runs a representative part)
    run after ``checks`` on the same ranks with ``--matrix pairwise|full`` only; their tests are marked
    ``slow`` and skip, saying so, in the smoke tier (the CI tier).
    """
    devices, params = _device_params(device)
    slow_names = {c.__name__ for c in slow_checks}

    @pytest.fixture(scope="module", **params)
    @one_worker
    def rank_checks(request: pytest.FixtureRequest, fsdp_api: str) -> RankChecks:
        where = _checks_device(request, devices)
        api = load_api(fsdp_api)
        slow = request.config.getoption("matrix", default="smoke") != "smoke"
        run = [*checks, *(slow_checks if slow else ())]
        outcomes = run_checks(run, world_size=world_size, device=where, timeout_s=timeout_s, args=(api,))
        return RankChecks(outcomes, engine=fsdp_api, device=where)

    every = [pytest.param(c, id=c.__name__, marks=[pytest.mark.slow] if c.__name__ in slow_names else [])
             for c in [*checks, *slow_checks]]

    @batch_timeout(len(every), timeout_s)
    @pytest.mark.parametrize("check", every)
    def test_check(request: pytest.FixtureRequest, rank_checks: RankChecks, check: Check) -> None:
        if check.__name__ not in rank_checks.outcomes:
            pytest.skip(reason=SLOW_TIER)
        # Applied during the call: the engine and device are the fixture's, known only once it ran.
        expected = expected_failure(expected_failures, rank_checks.device, engine=rank_checks.engine, check=check.__name__)
        if expected is not None:
            request.applymarker(expect_failure(expected))
        rank_checks.assert_passed(check)

    return rank_checks, test_check
