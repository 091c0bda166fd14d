"""The ported suites: PyTorch's own FSDP1 test files (``test/distributed/fsdp/test_fsdp_core.py``,
``test_fsdp_use_orig_params.py``, ``test_fsdp_flatten_params.py``, ``test_wrap.py``,
``test_fsdp_mixed_precision.py``) ported as conformance checks run against every engine with torch
FSDP1's API (this package, with ``harness.conformance.wrap`` and ``harness.conformance.mixed_precision``).
"The ported test's X" is what PyTorch's test file does. The package, ``suites/seeds``, ``seed_parity`` and
``certify``'s ``seeds`` family keep the name from when these files were called "seed" files
(docs/glossary.md).

One module per ported test file, named after it: ``fsdp_core``, ``fsdp_use_orig_params``,
``fsdp_flatten_params``, ``fsdp_clip_grad_norm``, ``fsdp_checkpoint``, ``fsdp_wrap`` (the wrap structure
on a process-group double), ``foreach``; ``seed_parity`` holds the ported test files' training-parity
checks as harness cases, ``fsdp_differences`` the documented differences between the engines. ``certify``'s
``seeds`` family runs them with ``pytest --pyargs``; ``suites/seeds`` collects them by import.
"""
