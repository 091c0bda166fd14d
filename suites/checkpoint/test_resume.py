"""Save after step k of n, resume in a fresh model, wrapper and optimizer: the same run as without.

Every strategy x ``use_orig_params`` x state-dict type (full, sharded, local) x optimizer (SGD with
momentum, AdamW), and each strategy x ``use_orig_params`` x type with CPU offload and bf16 mixed
precision, on CPU/gloo must match the uninterrupted run bitwise. The CI tier runs a slice
(each strategy, each type and each optimizer at least once at 2 ranks, a few cases at 4 ranks,
CPU offload and bf16 mixed precision once each); the whole product runs with ``--matrix full`` (marked
``slow``). The same slice runs on 2 GPUs with NCCL (marked ``gpu``).
"""

from __future__ import annotations

import itertools
import sys
from typing import Callable

import pytest

from engine import ShardingStrategy as S
from harness.pytest_plugin.rank_checks import RankChecks, run_checks, rank_checks_fixture
from harness.pytest_plugin import needs_gpus
from harness.pytest_plugin.xdist_groups import one_worker
from suites.checkpoint import training
from suites.checkpoint.training import SD_TYPES, Setup

STEPS, SAVE_AT = 4, 2

CI_2 = [
    (Setup(S.FULL_SHARD, False, "adamw"), "full"),
    (Setup(S.FULL_SHARD, True, "sgd"), "sharded"),
    (Setup(S.SHARD_GRAD_OP, True, "adamw"), "local"),
    (Setup(S.NO_SHARD, False, "adamw"), "sharded"),
    (Setup(S.HYBRID_SHARD, True, "adamw"), "full"),
    (Setup(S._HYBRID_SHARD_ZERO2, False, "sgd"), "local"),
    (Setup(S.FULL_SHARD, True, "adamw", offload=True, mixed_precision=True), "sharded"),
]
CI_4 = [
    (Setup(S.FULL_SHARD, True, "adamw"), "sharded"),
    (Setup(S.HYBRID_SHARD, False, "sgd"), "local"),
]
FULL_PRODUCT = [
    (Setup(strategy, orig, optimizer), sd)
    for strategy, orig, sd, optimizer in itertools.product(S, (False, True), SD_TYPES, ("sgd", "adamw"))
] + [
    # CPU offload with bf16 mixed precision: the state dicts hold the full-precision shards.
    (Setup(strategy, orig, "adamw", offload=True, mixed_precision=True), sd)
    for strategy, orig, sd in itertools.product(S, (False, True), SD_TYPES)
]


def _make_check(setup: Setup, sd: str, world_size: int) -> Callable[[int, int], None]:
    name = f"check_ws{world_size}_{setup.label().replace('-', '_')}_ckpt_{sd}"
    module = sys.modules[__name__]
    if hasattr(module, name):
        return getattr(module, name)

    def check(rank: int, ws: int) -> None:
        exact = training.device_for(rank).type == "cpu"
        want = training.uninterrupted(setup, rank, ws, STEPS)
        got = training.resumed(setup, SD_TYPES[sd], rank, ws, SAVE_AT, STEPS)
        training.assert_same_run(got, want, f"{setup.label()} ckpt_{sd} at {ws} ranks", exact)

    check.__name__ = check.__qualname__ = name
    # Spawned ranks find the check by name in this module.
    setattr(module, name, check)
    return check


def _checks(cases: list[tuple[Setup, str]], world_size: int) -> list[Callable[[int, int], None]]:
    return [_make_check(setup, sd, world_size) for setup, sd in cases]


CHECKS_2 = _checks(CI_2, 2)
CHECKS_4 = _checks(CI_4, 4)
FULL_2 = _checks(FULL_PRODUCT, 2)
FULL_4 = _checks(FULL_PRODUCT, 4)

checks_2 = rank_checks_fixture(CHECKS_2, world_size=2, timeout_s=600)
checks_4 = rank_checks_fixture(CHECKS_4, world_size=4, timeout_s=600)


@pytest.mark.parametrize("check", CHECKS_2, ids=lambda c: c.__name__)
def test_resume_2_ranks(checks_2: RankChecks, check: Callable[[int, int], None]) -> None:
    checks_2.assert_passed(check)


@pytest.mark.parametrize("check", CHECKS_4, ids=lambda c: c.__name__)
def test_resume_4_ranks(checks_4: RankChecks, check: Callable[[int, int], None]) -> None:
    checks_4.assert_passed(check)


@pytest.fixture(scope="module")
@one_worker
def full_product(request: pytest.FixtureRequest) -> dict[int, RankChecks]:
    if request.config.getoption("--matrix") != "full":
        pytest.skip(reason="the whole strategy x use_orig_params x type x optimizer product runs with --matrix full")
    return {
        2: RankChecks(run_checks(FULL_2, world_size=2, timeout_s=1800)),
        4: RankChecks(run_checks(FULL_4, world_size=4, timeout_s=1800)),
    }


@pytest.mark.slow
@pytest.mark.parametrize("check", FULL_2 + FULL_4, ids=lambda c: c.__name__)
def test_resume_full_product(full_product: dict[int, RankChecks], check: Callable[[int, int], None]) -> None:
    full_product[4 if check.__name__.startswith("check_ws4") else 2].assert_passed(check)


gpu_checks = rank_checks_fixture(CHECKS_2, world_size=2, device="cuda", timeout_s=600)


@pytest.mark.gpu
@needs_gpus(1)
@pytest.mark.parametrize("check", CHECKS_2, ids=lambda c: c.__name__)
def test_resume_2_gpus(gpu_checks: RankChecks, check: Callable[[int, int], None]) -> None:
    gpu_checks.assert_passed(check)
