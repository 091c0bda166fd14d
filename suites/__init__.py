"""Test suites (a package so that ``python -m suites.flat_param.campaign`` resolves)."""
