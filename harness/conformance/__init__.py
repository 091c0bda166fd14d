"""Conformance tests that ship in the package: what an installed ``harness`` runs without the
repository's ``suites/``.

A front end, beside ``harness.cli`` and ``harness.pytest_plugin``: these are pytest tests and their
runner, above the library (whose modules never import them); they may use the pytest plugin's
fixtures and marks.

- ``flat_cases``: Hypothesis strategies drawing module trees and flat-parameter handle arguments;
- ``flat_handles``: flat-parameter handles of any rank built in one process (a fake process group);
- ``flat_param_properties``: the flat-parameter fuzz properties (pytest tests);
- ``engine_layout``: the flat-parameter layout of any FSDP1-API engine against torch FSDP1's (a pytest
  test per ``--engine``; ``certify``'s ``flat-param`` family);
- ``torch_common_fsdp``: torch's own FSDP parity machinery over the engine (``certify``'s
  ``torch-common-fsdp`` family; GPU only);
- ``seeds``, ``mixed_precision``, ``wrap``: the ported suites, PyTorch's FSDP1 test files ported as
  conformance tests against any FSDP1-API engine (``certify``'s ``seeds`` family), with what they share:
- ``fsdp1_checks``: the ported checks' comparison helpers over an engine's FSDP1 names, and the ``api``
  fixture that loads them;
- (the rank checks, many checks in one set of rank processes, are the pytest plugin's `rank_checks`);
- ``engine_models``: the engine and ported suites' models, registered in the harness's zoo;
- ``profiles``: the Hypothesis profiles (``ci``, ``nightly``, ``dev``);
- ``fuzz_campaign``: ``python -m harness.conformance.fuzz_campaign``, the nightly's fuzz phase.

Why the tests live here and how the suites run them: each test is written once. A test module the
installed package must run (the fuzz campaign, certify's families) sits in this package, and pytest runs
it by its path inside the package (``pytest.main([file])``, or ``pytest --pyargs
harness.conformance.<module>``), which works from a wheel as from a checkout. Its ``__all__`` names what
a collector needs: its fixtures (defined there or imported: a module run alone must see them), its tests
in the order they run, its marks. The CI tier collects the same functions by importing them into a suite
module (``suites/flat_param/test_fuzz_flat_param.py``, ``test_engine_layout.py``; ``suites/seeds``,
``suites/mixed_precision``, ``suites/wrap``: ``test_<module>.py`` for ``<folder>.<module>`` here), so their
node ids, markers and the lane's counts are the suites' as before; the root ``conftest.py`` registers
``ASSERT_REWRITE`` for pytest's assertion rewriting, so a failing assert shows its values either way. No
``conftest.py`` here: pytest does not reliably load one from site-packages, so fixtures travel by import
(a suite folder's ``conftest.py`` may import one to share it across its modules, as the mixed-precision
pools are). The alternative, a second copy under ``suites/`` or a ``testpaths`` entry into the package,
would either duplicate the tests or move them out of the suite a reader looks in.
"""

#: the modules whose asserts pytest rewrites when a suite imports them (registered before that import).
ASSERT_REWRITE = (
    "harness.conformance.engine_layout",
    "harness.conformance.flat_handles",
    "harness.conformance.flat_param_properties",
    "harness.conformance.fsdp1_checks",
    "harness.conformance.mixed_precision",
    "harness.conformance.seeds",
    "harness.conformance.torch_common_fsdp",
    "harness.conformance.wrap",
)
