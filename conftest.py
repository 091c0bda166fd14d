"""Root pytest configuration: the project's plugin and the Hypothesis profiles shared by every suite.

``harness.pytest_plugin`` adds the parity options (``--engine``, ``--reference``, ``--matrix``,
``--world-size``, ``--backend``, ``--case-timeout``, ``--results``), the generated parity cases, the
``fsdp_api`` parametrization of the ported suites and the shared rank pools; see its docstring.

``harness.conformance.profiles`` registers the Hypothesis profiles; one is chosen with Hypothesis's own
``--hypothesis-profile`` option or, when that is not given, the ``FUZZ_PROFILE`` environment variable
(default ``ci``).
"""

from __future__ import annotations

import pytest

from harness.conformance import ASSERT_REWRITE

# The conformance tests live in the package (so that an installed package runs them) and the suites
# collect them by import: registered before that import, their asserts report the values they compared.
pytest.register_assert_rewrite(*ASSERT_REWRITE)

# pytester: the plugins' own tests run pytest on scratch suites (suites/parity/test_parity_plugin.py). An
# in-process run drops from sys.modules what was first imported inside it, and a module that registers torch
# operators (torch.distributed.fsdp pulls in symmetric memory's) cannot be imported twice: imported here, first.
import torch.distributed.fsdp  # noqa: E402,F401

# split_groups: a pytest-split group that drew no test passes (harness/pytest_plugin/split_groups.py).
pytest_plugins = ["harness.pytest_plugin", "harness.pytest_plugin.split_groups", "harness.conformance.profiles", "pytester"]
