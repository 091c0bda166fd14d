"""Flat-parameter suites: fuzz properties, ports of FSDP1's flatten tests, bad inputs."""
