"""Ports of the seed behaviours (torch FSDP test files) onto our engine."""
