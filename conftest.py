"""Root pytest configuration: the project's plugin and the Hypothesis profiles shared by every suite.

``harness.pytest_plugin`` adds the parity options (``--engine``, ``--reference``, ``--matrix``,
``--world-size``, ``--backend``, ``--case-timeout``, ``--results``), the generated parity cases, the
``fsdp_api`` parametrization of the seed suites and the shared rank pools; see its docstring.

The Hypothesis profile is chosen with Hypothesis's own ``--hypothesis-profile`` option or, when that is
not given, the ``FUZZ_PROFILE`` environment variable (default ``ci``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

# pytester: the plugins' own tests run pytest on scratch suites (suites/parity/test_parity_plugin.py).
# split_groups: a pytest-split group that drew no test passes (harness/pytest_plugin/split_groups.py).
pytest_plugins = ["harness.pytest_plugin", "harness.pytest_plugin.split_groups", "pytester"]

# ci: fast and derandomized, so a pull request sees the same examples every run.
settings.register_profile(
    "ci",
    max_examples=300,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# nightly: a real search; failures print the blob that replays them with @reproduce_failure.
settings.register_profile(
    "nightly",
    max_examples=10_000,
    deadline=None,
    print_blob=True,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=50, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("FUZZ_PROFILE", "ci"))
