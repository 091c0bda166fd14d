"""Run many checks in one set of rank processes (spawned once per test module).

Torch's own FSDP tests spawn ``world_size`` processes per test, which costs seconds each on a
small machine. Here a test module lists its checks (module-level functions ``check(rank,
world_size)``), one :class:`RankSession` spawns the ranks once, every rank runs every check in
order in the same process group, and each pytest test asserts the outcome of its check.

A check that fails on a rank aborts that rank's session (the remaining checks would pair their
collectives with a peer still inside the failed one); those checks report which failure stopped
them. Every collective has the process group's timeout, so a hang surfaces as a failure.

A check may call ``pytest.skip(reason=...)`` before its first collective (on every rank alike, e.g. a
feature the engine under test lacks here): the test skips with that reason and the session goes on.
Checks can take leading arguments (``args``, e.g. the engine API of the seed conformance suites):
``check(*args, rank, world_size)``.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness.pool import gpus_hidden

__all__ = ["CheckOutcome", "RankSession", "api_session_tests", "run_checks", "session_tests"]

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


def _worker(
    rank: int,
    world_size: int,
    init_file: str,
    backend: str,
    checks: Sequence[Check],
    results: "mp.Queue[tuple[int, str, str | None, str | None]]",
    timeout_s: float,
    args: tuple[Any, ...] = (),
) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    failed: str | None = None
    try:
        for check in checks:
            name = check.__name__
            if failed is not None:
                results.put((rank, name, f"not run: check {failed} failed earlier on this rank", None))
                continue
            try:
                torch.manual_seed(0)
                check(*args, rank, world_size)
                results.put((rank, name, None, None))
            except pytest.skip.Exception as skip:
                results.put((rank, name, None, str(skip.msg)))
            except BaseException:  # noqa: BLE001 - reported to the parent
                failed = name
                results.put((rank, name, traceback.format_exc(), None))
    finally:
        if failed is None:
            dist.destroy_process_group()


def run_checks(
    checks: Sequence[Check],
    world_size: int = 2,
    backend: str = "gloo",
    timeout_s: float = 120.0,
    collective_timeout_s: float = 60.0,
    args: tuple[Any, ...] = (),
) -> dict[str, CheckOutcome]:
    """Spawn ``world_size`` ranks, run every check on each (``check(*args, rank, world_size)``),
    return outcomes by check name."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, init_file, backend, list(checks), results, collective_timeout_s, args),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        with gpus_hidden(backend == "gloo"):  # gloo sessions are the CPU lane, on a GPU host too
            for p in procs:
                p.start()
        errors: dict[str, list[str | None]] = {c.__name__: ["rank did not report"] * world_size for c in checks}
        skips: dict[str, list[str | None]] = {c.__name__: [None] * world_size for c in checks}
        expected = len(checks) * world_size
        got = 0
        deadline = time.monotonic() + timeout_s
        while got < expected and time.monotonic() < deadline:
            try:
                rank, name, err, skip = results.get(timeout=1.0)
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
                continue
            errors[name][rank] = err
            skips[name][rank] = skip
            got += 1
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        if got < expected:
            for name, errs in errors.items():
                for r, e in enumerate(errs):
                    if e == "rank did not report":
                        errs[r] = f"rank {r} did not report within {timeout_s:.0f}s (crashed or hung; exit codes {[p.exitcode for p in procs]})"
    return {name: CheckOutcome(name, tuple(errs), tuple(skips[name])) for name, errs in errors.items()}


class RankSession:
    """The outcomes of one spawned session, looked up by check (for a module-scoped fixture)."""

    def __init__(self, outcomes: dict[str, CheckOutcome]) -> None:
        self.outcomes = outcomes

    def assert_passed(self, check: Check | str) -> None:
        """Fails the test with every rank's report, skips it when every rank skipped, else passes."""
        name = check if isinstance(check, str) else check.__name__
        outcome = self.outcomes[name]
        if not outcome.passed:
            raise AssertionError(f"check {name} failed:\n{outcome.report()}")
        reason = outcome.skip_reason
        if reason is not None:
            pytest.skip(reason=reason)
        ran = [r for r, s in enumerate(outcome.skips) if s is None]
        if outcome.skips and len(ran) != len(outcome.skips):
            raise AssertionError(f"check {name} skipped on some ranks but ran on ranks {ran}: {outcome.skips}")


def _one_xdist_worker(checks: Sequence[Check]) -> pytest.MarkDecorator:
    """Keep a module's checks on one pytest-xdist worker (``--dist loadgroup``): the session fixture
    runs every check of the module, so each worker that got one of them would run them all again."""
    return pytest.mark.xdist_group(name=f"rank-session:{checks[0].__module__}")


def session_tests(checks: Sequence[Check], world_size: int = 2, backend: str = "gloo", timeout_s: float = 240.0):
    """A module-scoped ``session`` fixture and a test per check, for a test module's namespace::

        session, test_check = session_tests(CHECKS)
    """
    import pytest

    @pytest.fixture(scope="module")
    def session() -> RankSession:
        return RankSession(run_checks(checks, world_size=world_size, backend=backend, timeout_s=timeout_s))

    @_one_xdist_worker(checks)
    @pytest.mark.parametrize("check", list(checks), ids=lambda c: c.__name__)
    def test_check(session: RankSession, check: Check) -> None:
        session.assert_passed(check)

    return session, test_check


def api_session_tests(
    checks: Sequence[Check],
    load_api: Callable[[str], Any],
    world_size: int = 2,
    backend: str = "gloo",
    timeout_s: float = 240.0,
):
    """``session_tests`` once per engine of the ``fsdp_api`` parametrization (``harness.pytest_plugin``:
    the engines with torch FSDP1's API that ``--engine`` names). Each check is called
    ``check(api, rank, world_size)`` with ``api = load_api(fsdp_api)``, built in the parent and pickled
    to the ranks; the ranks are spawned once per engine::

        session, test_check = api_session_tests(CHECKS, load_api)
    """

    @pytest.fixture(scope="module")
    def session(fsdp_api: str) -> RankSession:
        api = load_api(fsdp_api)
        return RankSession(run_checks(checks, world_size=world_size, backend=backend, timeout_s=timeout_s, args=(api,)))

    @_one_xdist_worker(checks)
    @pytest.mark.parametrize("check", list(checks), ids=lambda c: c.__name__)
    def test_check(session: RankSession, check: Check) -> None:
        session.assert_passed(check)

    return session, test_check
