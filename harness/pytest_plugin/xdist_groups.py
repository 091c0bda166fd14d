"""The pytest-xdist groups (``--dist loadgroup``) of the tests that share a costly module-scoped fixture.

A module-scoped fixture is set up once per worker that runs one of its tests: under ``-n 16`` a batch of rank
checks (ranks spawned, every check of a module run), a ``harness certify`` or ``harness run`` in a subprocess,
would run on every worker that got one of its tests, each copy competing for the same GPUs. A fixture marked
:func:`one_worker` keeps its tests on one worker: at collection :func:`batch_groups` gives every test that uses
one a group named by its module, the marked fixtures it uses and the fixture's instance (the parameters the
test does not take itself: engine, device), so the instances of one fixture (the engine and device batches of
a module's rank checks) still run on different workers side by side.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest

__all__ = ["batch_groups", "one_worker"]

#: the start of the pytest-xdist group names :func:`batch_groups` gives.
_GROUP_PREFIX = "shared:"
_ONE_WORKER = "_harness_one_worker"

F = TypeVar("F", bound=Callable[..., Any])


def one_worker(function: F) -> F:
    """Mark a module-scoped fixture's function (under ``@pytest.fixture``) whose tests run on one worker."""
    setattr(function, _ONE_WORKER, True)
    return function


def batch_groups(items: Sequence[pytest.Item]) -> None:
    """Put each test that uses a :func:`one_worker` fixture first in the group of that fixture's instance
    (ahead of any group it had, which pytest-xdist would otherwise read first)."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        module = getattr(item, "module", None)
        if info is None or module is None:
            continue
        shared = sorted(name for name in item.fixturenames
                        if any(getattr(d.func, _ONE_WORKER, False) for d in info.name2fixturedefs.get(name, ())))
        if not shared:
            continue
        own = _own_parameters(item)
        callspec = getattr(item, "callspec", None)
        params = {k: v for k, v in callspec.params.items() if k not in own} if callspec is not None else {}
        name = f"{_GROUP_PREFIX}{module.__name__}:{','.join(shared)}"
        if params:
            name += "/" + ",".join(f"{k}={v}" for k, v in sorted(params.items()))
        item.add_marker(pytest.mark.xdist_group(name=_scope_safe(name)), append=False)


def _own_parameters(item: pytest.Item) -> set[str]:
    """The argument names the test parametrizes itself (each a test of the batch, not a batch of its own)."""
    names: set[str] = set()
    for mark in item.iter_markers("parametrize"):
        argnames = mark.args[0] if mark.args else mark.kwargs.get("argnames", ())
        names.update(n.strip() for n in (argnames.split(",") if isinstance(argnames, str) else argnames))
    return names


def _scope_safe(text: str) -> str:
    """``text`` without the characters that hide a group from pytest-xdist: ``LoadGroupScheduling`` takes the
    part of a node id after its last ``@`` as the group only when no ``]`` follows that ``@`` (so that a
    parameter holding ``@`` is not read as a group). A group named ``module[engine]`` was therefore no group
    at all: each test was its own unit, and every worker that got one of a batch's tests ran the batch's
    whole fixture again (16 times under ``-n 16``)."""
    return text.translate(str.maketrans("[]@", "()_"))
