"""Checkpoint cases built by hand: resharding with DCP (2 -> 4, 4 -> 2, 2 -> 1 unsharded), cross-engine
resume (saved by one engine, resumed by another), and planted load bugs that must make a case fail.

Every case runs through ``harness.run.runner.run_case`` on the shared rank pools (``parity_pools``), so it is
decided exactly as ``harness run`` decides it, and (but for the planted bugs) is recorded in ``--results``; a resharded case compares against the local reference,
which replays the same change of world size. The CI tier runs a slice (each reshard direction, each
engine pair once, two planted bugs); the cases marked ``slow`` run with ``--matrix full``.
"""

from __future__ import annotations

import pytest

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord
from harness.pytest_plugin import ParityRunner, PoolRegistry
from harness.pytest_plugin.cases import ParityOptions
from harness.run.runner import run_case


SLOW = pytest.mark.slow


@pytest.fixture(autouse=True)
def _lane(request: pytest.FixtureRequest, parity_options: ParityOptions) -> None:
    if request.node.get_closest_marker("slow") is not None and parity_options.matrix != "full":
        pytest.skip(reason="runs in the --matrix full tier; the CI tier runs a slice of these cases")


def _run(pools: PoolRegistry, case: CaseConfig) -> CaseRecord:
    return run_case(pools.pool_for(case.world_size), case)


def _passes(record: CaseRecord) -> None:
    from harness.pytest_plugin.cases import describe_failure

    assert record.verdict == "pass", f"{record.case_id}: {describe_failure(record)}"


# --- DCP reshard -------------------------------------------------------------------------------------

RESHARD = [
    # (engine, save ranks, resume ranks, extra fields, CI tier)
    ("torch-fsdp", 2, 1, {}, True),
    ("builtin", 2, 1, {"optimizer": "adamw", "use_orig_params": True}, False),
    ("torch-fsdp2", 2, 1, {"optimizer": "adamw"}, False),
    ("torch-fsdp", 2, 4, {"optimizer": "adamw"}, False),
    ("torch-fsdp", 4, 2, {"use_orig_params": True}, False),
    ("builtin", 2, 4, {}, True),
    ("builtin", 4, 2, {"optimizer": "adamw"}, False),
    ("torch-fsdp2", 2, 4, {}, False),
    ("torch-fsdp2", 4, 2, {"optimizer": "adamw"}, True),
]


def _reshard_case(engine: str, saving: int, resuming: int, extra: dict) -> CaseConfig:
    fsdp2 = {"use_orig_params": True, "backward_prefetch": "pre"} if engine == "torch-fsdp2" else {}
    return CaseConfig(
        engine=engine, reference="local", checkpoint="dcp-reshard", reshard=(saving, resuming),  # type: ignore[arg-type]
        world_size=max(saving, resuming), **{**fsdp2, **extra},
    )


@pytest.mark.parametrize(("engine", "saving", "resuming", "extra"), [
    pytest.param(*r[:4], id=_reshard_case(*r[:4]).full_id, marks=[] if r[4] else [SLOW]) for r in RESHARD
])
def test_dcp_reshard(parity_runner: ParityRunner, engine: str, saving: int, resuming: int, extra: dict) -> None:
    parity_runner.run(_reshard_case(engine, saving, resuming, extra))


# --- cross-engine resume -----------------------------------------------------------------------------

FSDP2_OK = {"use_orig_params": True, "backward_prefetch": "pre"}

CROSS = [
    # (saved by, resumed by, checkpoint, fields, CI tier)
    ("builtin", "torch-fsdp", "full", {"optimizer": "adamw"}, True),
    ("torch-fsdp", "builtin", "full", {"use_orig_params": True}, False),
    ("builtin", "torch-fsdp", "sharded", {"use_orig_params": True}, False),
    ("torch-fsdp", "builtin", "sharded", {"optimizer": "adamw"}, True),
    ("builtin", "torch-fsdp2", "sharded", {"optimizer": "adamw", **FSDP2_OK}, True),
    ("torch-fsdp2", "builtin", "sharded", FSDP2_OK, True),
    ("builtin", "torch-fsdp2", "full", FSDP2_OK, False),
    ("torch-fsdp2", "builtin", "full", {"optimizer": "adamw", **FSDP2_OK}, False),
]


def cross_case(saver: str, loader: str, checkpoint: str, fields: dict) -> CaseConfig:
    return CaseConfig(engine=saver, resume_engine=loader, checkpoint=checkpoint, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(("saver", "loader", "checkpoint", "fields"), [
    pytest.param(*c[:4], id=cross_case(*c[:4]).full_id, marks=[] if c[4] else [SLOW]) for c in CROSS
])
def test_cross_engine_resume(parity_runner: ParityRunner, saver: str, loader: str, checkpoint: str, fields: dict) -> None:
    parity_runner.run(cross_case(saver, loader, checkpoint, fields))


def test_local_checkpoint_across_engines_is_unsupported_with_its_reason(
    parity_pools: PoolRegistry, parity_runner: ParityRunner
) -> None:
    from harness.selection.matrix import invalid_reason

    case = cross_case("builtin", "torch-fsdp", "local", {})
    assert "LOCAL" in (invalid_reason(case) or "")
    record = _run(parity_pools, case)
    parity_runner.results.record(record, parity_runner.node)  # the resume matrix shows the refused cell
    assert record.verdict == "unsupported" and "flat" in record.reason, record.reason


# --- planted bugs: the resume check can fail -----------------------------------------------------------

PLANTED = [
    pytest.param("torch-fsdp", "full", "sgd", "drop_optimizer_state"),
    pytest.param("torch-fsdp", "sharded", "adamw", "swap_optimizer_state", marks=SLOW),
    pytest.param("builtin", "local", "sgd", "drop_optimizer_state", marks=SLOW),
    pytest.param("builtin", "sharded", "adamw", "swap_optimizer_state"),
]


@pytest.mark.parametrize(("engine", "checkpoint", "optimizer", "fault"), PLANTED)
def test_a_planted_load_bug_fails_the_case(
    parity_pools: PoolRegistry, engine: str, checkpoint: str, optimizer: str, fault: str
) -> None:
    healthy = CaseConfig(engine=engine, checkpoint=checkpoint, optimizer=optimizer, reference="local")  # type: ignore[arg-type]
    _passes(_run(parity_pools, healthy))
    record = _run(parity_pools, healthy.replace(extras=(("fault", fault),)))
    assert record.verdict == "fail", f"{fault}: {record.verdict}: {record.reason}"
    # The steps before the checkpoint agree; the damage shows after it.
    failing = {e.name for e in record.errors if not e.passed}
    k = healthy.checkpoint_step
    assert not failing & {f"loss@{s}" for s in range(k + 1)}, failing
    assert any(name.startswith("param:") for name in failing), failing


def test_a_planted_bug_fails_a_resharded_case(parity_pools: PoolRegistry) -> None:
    case = _reshard_case("torch-fsdp", 2, 1, {}).replace(extras=(("fault", "drop_optimizer_state"),))
    record = _run(parity_pools, case)
    assert record.verdict == "fail", f"{record.verdict}: {record.reason}"
