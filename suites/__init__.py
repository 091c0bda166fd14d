"""Test suites (a package: the suites import each other's helpers as ``suites.<suite>.<module>``)."""
