"""Torch's ``test_fsdp_mixed_precision.py`` (and its grad-scaler tests) as conformance tests against
every engine with torch FSDP1's API.

The tests: ``mixed_precision`` (on two gloo CPU ranks), ``gpu`` (the same jobs and the CUDA-only ones on
two GPUs), ``grad_scaler``, ``parity`` (against the harness's emulating reference per precision config)
and ``precision_logic`` (the pure parts, in process). What they run on the ranks: ``rank_api`` (the
engine's names and the traces on a rank), the jobs (``e2e_jobs``, ``eval_jobs``, ``grad_jobs``,
``module_jobs``, ``parity_jobs``, ``scaler_jobs``), ``models`` and ``cases``; ``pools`` the rank pools.
``suites/mixed_precision`` collects the tests by import.
"""
