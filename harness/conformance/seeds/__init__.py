"""The seed suites: PyTorch's own FSDP1 test files (``test/distributed/fsdp/test_fsdp_core.py``,
``test_fsdp_use_orig_params.py``, ``test_fsdp_flatten_params.py``, ``test_wrap.py``,
``test_fsdp_mixed_precision.py``) ported as conformance checks run against every engine with torch
FSDP1's API (this package, with ``harness.conformance.wrap`` and ``harness.conformance.mixed_precision``).
"Seed" in the project means these files; "the seed's X" is what PyTorch's test file does.

One module per seed file, named after it: ``fsdp_core``, ``fsdp_use_orig_params``,
``fsdp_flatten_params``, ``fsdp_clip_grad_norm``, ``fsdp_checkpoint``, ``fsdp_wrap`` (the wrap structure
on a process-group double), ``foreach``; ``seed_parity`` holds the seed files' training-parity checks as
harness cases, ``fsdp_differences`` the documented differences between the engines. ``certify``'s
``seeds`` family runs them with ``pytest --pyargs``; ``suites/seeds`` collects them by import.
"""
