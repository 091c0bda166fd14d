"""Engine runtime suites (a package so spawned rank processes can import the checks)."""
