"""The pytest-xdist groups of rank checks (``--dist loadgroup``): one per batch that shares a set of ranks.

``harness.pytest_plugin.rank_checks`` marks a module's check tests with one group, ``GROUP_PREFIX`` and the
module; at collection :func:`batch_groups` narrows it to one batch of the module-scoped fixture (its engine and
device), so the batches of one module run on different workers side by side while each batch's checks, which
its fixture runs all at once, stay on one.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

__all__ = ["GROUP_PREFIX", "batch_groups"]

#: the start of the pytest-xdist group name of a module's rank checks.
GROUP_PREFIX = "rank-checks:"


def batch_groups(items: Sequence[pytest.Item]) -> None:
    """Give each batch of a module's rank checks its own pytest-xdist group: the module-scoped fixture is
    parametrized by engine (``fsdp_api``) and device, and each of its instances spawns its own ranks and runs
    every check of the module, so the batches of one module can run on different workers side by side (the
    use_orig_params module's four batches, run one after another on one worker, were a GPU run's longest
    test). Items without a rank-check group, or without parameters besides the check, keep their group."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        params = {k: v for k, v in callspec.params.items() if k != "check"} if callspec is not None else {}
        if not params:
            continue
        for i, mark in enumerate(item.own_markers):
            name = str(mark.kwargs.get("name", mark.args[0] if mark.args else ""))
            if mark.name == "xdist_group" and name.startswith(GROUP_PREFIX):
                batch = ",".join(f"{k}={v}" for k, v in sorted(params.items()))
                item.own_markers[i] = pytest.mark.xdist_group(name=f"{name}/{_scope_safe(batch)}").mark


def _scope_safe(text: str) -> str:
    """``text`` without the characters that hide a group from pytest-xdist: ``LoadGroupScheduling`` takes the
    part of a node id after its last ``@`` as the group only when no ``]`` follows that ``@`` (so that a
    parameter holding ``@`` is not read as a group). A group named ``module[engine]`` was therefore no group
    at all: each test was its own unit, and every worker that got one of a batch's tests ran the batch's
    whole fixture again (16 times under ``-n 16``)."""
    return text.translate(str.maketrans("[]@", "()_"))
