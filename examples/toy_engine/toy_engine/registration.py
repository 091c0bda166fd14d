"""The toy engines' registrations: factories the entry points of ``fsdp_parity.engines`` name.

Each returns the harness's generic FSDP1 adapter over a namespace; an engine without torch FSDP1's API
would return its own ``harness.EngineAdapter`` subclass here.
"""

from __future__ import annotations

from harness import EngineAdapter, FSDP1Adapter


def clean(name: str) -> EngineAdapter:
    return FSDP1Adapter(name, "toy_engine")


def buggy(name: str) -> EngineAdapter:
    return FSDP1Adapter(name, "toy_engine.buggy")
