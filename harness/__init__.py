"""The parity harness. The library is grouped by the stages a case goes through, each importing only the
stages before it (``suites/layering/test_imports.py``): ``cases`` -> ``ranks`` -> ``engines`` ->
``selection`` -> ``compare`` -> ``collect`` -> ``run`` -> ``perf``; the front ends (``cli``,
``pytest_plugin``, ``conformance``, ``python -m harness``) sit above them and the reports
(docs/architecture.md).

The names a plug-in author writes an adapter or registers a model with are importable from here, the
stable place whichever stage holds them (docs/engines.md)::

    from harness import EngineAdapter, FSDP1Adapter, ParamSlice, canonical_name, register

They are loaded on first use: ``import harness`` imports neither torch nor a stage.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

#: public name -> the module that defines it.
PUBLIC: dict[str, str] = {
    **dict.fromkeys(("CaseConfig",), "harness.cases.case"),
    **dict.fromkeys(("Rule", "prefixed_rule"), "harness.cases.capabilities"),
    **dict.fromkeys(("ZooModel",), "harness.cases.model_protocol"),
    **dict.fromkeys(("MODELS", "register_model", "build_model"), "harness.cases.models"),
    **dict.fromkeys(("RankContext",), "harness.ranks.rank"),
    **dict.fromkeys(("EngineAdapter", "EngineFacts", "EngineTrainee", "EngineUtilities", "FSDP1Adapter", "ParamSlice",
                     "canonical_name"), "harness.engines.adapters"),
    **dict.fromkeys(("FSDP2Adapter",), "harness.engines.fsdp2_adapter"),
    **dict.fromkeys(("DeepSpeedAdapter",), "harness.engines.deepspeed_adapter"),
    **dict.fromkeys(("MegatronFSDPAdapter",), "harness.engines.megatron_fsdp_adapter"),
    **dict.fromkeys(("FairScaleAdapter",), "harness.engines.fairscale_adapter"),
    **dict.fromkeys(("FINDING", "OwnedStep"), "harness.engines.owned_step"),
    **dict.fromkeys(("build_optimizers",), "harness.engines.optim"),
    **dict.fromkeys(("API_KINDS", "ENTRY_POINT_GROUP", "EngineSpecError", "check_engines", "register",
                     "registered_names", "resolve"), "harness.engines.registry"),
}

__all__ = sorted(PUBLIC)

if TYPE_CHECKING:
    from harness.cases.capabilities import Rule, prefixed_rule
    from harness.cases.case import CaseConfig
    from harness.cases.model_protocol import ZooModel
    from harness.cases.models import MODELS, build_model, register_model
    from harness.engines.adapters import (EngineAdapter, EngineFacts, EngineTrainee, EngineUtilities, FSDP1Adapter,
                                          ParamSlice, canonical_name)
    from harness.engines.deepspeed_adapter import DeepSpeedAdapter
    from harness.engines.fairscale_adapter import FairScaleAdapter
    from harness.engines.fsdp2_adapter import FSDP2Adapter
    from harness.engines.megatron_fsdp_adapter import MegatronFSDPAdapter
    from harness.engines.optim import build_optimizers
    from harness.engines.owned_step import FINDING, OwnedStep
    from harness.engines.registry import (API_KINDS, ENTRY_POINT_GROUP, EngineSpecError, check_engines, register,
                                          registered_names, resolve)
    from harness.ranks.rank import RankContext


def __getattr__(name: str) -> Any:
    module = PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'harness' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *PUBLIC})
