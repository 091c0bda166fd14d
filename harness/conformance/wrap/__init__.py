"""Torch's ``test_wrap.py`` as conformance tests: ``wrap_policies`` (which modules become units, with
a recording wrapper), ``wrap_oracle`` (auto wrapping against torch FSDP1's over random module trees) and
``wrap_engine`` (training behaviours on rank processes, running ``wrap_jobs``); ``wrap_models`` holds the
models and the recording wrapper. ``suites/wrap`` collects the tests by import.
"""
