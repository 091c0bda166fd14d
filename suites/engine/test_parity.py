"""Training parity on 2 CPU ranks (gloo): every strategy x use_orig_params x backward prefetch x
forward prefetch x CPU offload (the matrix's axes: ``parity.sweep_plan``), on the nested,
tied-transformer and mixture-of-experts models, against the all-data local reference and against DDP
(each axis value sees both), 5 SGD-momentum steps each.

The whole cross product runs in one spawned session (about 30 s on 2 cores).
"""

from __future__ import annotations

import torch

from suites.engine import parity
from suites.engine.ranks import session_tests


def check_nested_sweep(rank: int, world_size: int) -> None:
    parity.sweep("engine_nested", torch.device("cpu"))


def check_transformer_sweep(rank: int, world_size: int) -> None:
    parity.sweep("engine_transformer", torch.device("cpu"))


def check_moe_sweep(rank: int, world_size: int) -> None:
    parity.sweep("engine_moe", torch.device("cpu"))


def check_both_references_default_kwargs(rank: int, world_size: int) -> None:
    for model in ("engine_nested", "engine_transformer"):
        for reference in ("local", "ddp"):
            parity.train_parity(model, {}, torch.device("cpu"), reference=reference)


def test_the_sweep_crosses_every_value_of_its_axes_with_both_references() -> None:
    plan = parity.sweep_plan()
    sizes = [len({getattr(case, axis) for case, _ in plan}) for axis in parity.SWEEP_AXES]
    assert sizes == [3, 2, 3, 2, 2] and len(plan) == 72, sizes
    seen = {(axis, getattr(case, axis), reference) for case, reference in plan for axis in parity.SWEEP_AXES}
    for axis in parity.SWEEP_AXES:
        for value in {getattr(case, axis) for case, _ in plan}:
            assert {(axis, value, r) for r in ("local", "ddp")} <= seen, f"{axis}={value} misses a reference"


CHECKS = [check_nested_sweep, check_transformer_sweep, check_moe_sweep, check_both_references_default_kwargs]
session, test_check = session_tests(CHECKS)
