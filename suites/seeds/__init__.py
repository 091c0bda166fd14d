"""The ported suites: PyTorch's own FSDP1 test files (``test/distributed/fsdp/test_fsdp_core.py``,
``test_fsdp_use_orig_params.py``, ``test_fsdp_flatten_params.py``, ``test_wrap.py``,
``test_fsdp_mixed_precision.py``) ported as conformance checks run against every engine with torch
FSDP1's API (``suites/seeds``, with ``suites/wrap`` and ``suites/mixed_precision``). "The torch test's X"
is what PyTorch's test file does; ``suites/seeds`` keeps the name from when these files were called "seed"
files (docs/glossary.md)."""
