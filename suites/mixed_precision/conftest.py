"""The mixed-precision suites' rank pools (``harness.conformance.mixed_precision.pools``), here so that
one pool serves the whole folder: the test modules import only the tests, and these package-scoped
fixtures are shared by all of them (a module importing them would start its own)."""

from __future__ import annotations

from harness.conformance.mixed_precision.pools import cpu_pair, gpu_pair

__all__ = ["cpu_pair", "gpu_pair"]
