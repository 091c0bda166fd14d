"""FairScale's FSDP (``harness.engines.fairscale_adapter``, issue 38): its name and strategies, the reader of
its flat parameters (a pure function over FairScale's metadata), its precision mapping and capability
reasons, ``unsupported`` in one line where it cannot run: on CPU. On two CUDA GPUs (``-m gpu``): the pairwise
matrix against DDP and the local reference over NCCL, with no failure but the declared engine bug (bf16).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.cases.case import PRECISIONS, CaseConfig
from harness.engines.fairscale_adapter import (FairScaleAdapter, fairscale_missing, fairscale_name, fairscale_precision,
                                               flat_param_slices)
from harness.cases.models import build_model
from harness.engines.registry import resolve
from harness.pytest_plugin import needs_gpus
from harness.ranks.rank import RankContext
from suites.plugins.cuda_engines import needs_package, run_records, undeclared_failures

#: FairScale 0.4.13's FSDP casts the root's floating inputs with ``.half()`` whenever mixed_precision is on
#: (``cast_floats_to_right_precision``), whatever ``compute_dtype`` says: bfloat16 parameters meet float16 inputs.
#: A model fed integer tokens (the transformer) has no floating input to cast, and passes (measured on 2 GPUs).
BF16_HALF_INPUTS = ("FairScale 0.4.13 casts the root's inputs with .half() whatever compute_dtype says: bf16 "
                    "parameters meet fp16 inputs")


@functools.cache
def _floating_inputs(model: str) -> bool:
    inputs = build_model(model, seed=0, rank=0, world_size=2).get_input(seed=0, step=0, rank=0)
    return any(t.is_floating_point() for t in inputs)


def _bf16(record: dict[str, Any]) -> str | None:
    case = record["case"]
    return BF16_HALF_INPUTS if case["precision"] == "bf16" and _floating_inputs(case["model"]) else None


def test_the_declared_bf16_failure_is_the_models_with_floating_inputs() -> None:
    bf16 = {"verdict": "error", "case_id": "x", "reason": ""}
    assert _bf16({**bf16, "case": {"precision": "bf16", "model": "nested"}}) == BF16_HALF_INPUTS
    assert _bf16({**bf16, "case": {"precision": "bf16", "model": "transformer"}}) is None
    assert _bf16({**bf16, "case": {"precision": "fp16", "model": "nested"}}) is None


def test_fairscale_is_registered_with_both_reshard_strategies() -> None:
    adapter = resolve("fairscale")
    assert adapter.strategies == ("full_shard", "shard_grad_op") and not adapter.owns_step


def test_a_shard_becomes_pieces_of_the_original_parameters_by_name() -> None:
    # Three parameters of 3, 4 and 2 elements, 9 in all, sharded over 2 ranks: chunks of 5, the last padded.
    names, numels = ["a", "b", "c"], [3, 4, 2]
    flat = torch.arange(9.0)
    rank0 = flat_param_slices(names, numels, 0, flat[:5])
    rank1 = flat_param_slices(names, numels, 5, torch.cat([flat[5:], torch.zeros(1)]))
    assert [(s.name, s.start, s.value.tolist()) for s in rank0] == [("a", 0, [0, 1, 2]), ("b", 0, [3, 4])]
    assert [(s.name, s.start, s.value.tolist()) for s in rank1] == [("b", 2, [5, 6]), ("c", 0, [7, 8])]
    # A rank past the end (more ranks than chunks) holds padding alone.
    assert flat_param_slices(names, numels, 10, torch.zeros(5)) == []
    with pytest.raises(ValueError, match="3 names for 2 sizes"):
        flat_param_slices(names, numels[:2], 0, flat)


def test_names_lose_fairscales_wrapper_segments() -> None:
    assert fairscale_name("_fsdp_wrapped_module._fpw_module.layers.0", "_fpw_module.linear.weight") == "layers.0.linear.weight"
    assert fairscale_name("", "embed.weight") == "embed.weight"


@pytest.mark.parametrize(("precision", "keywords"), [
    ("fp32", {"mixed_precision": False}),
    ("fp16", {"mixed_precision": True, "compute_dtype": "float16", "buffer_dtype": "float16", "fp32_reduce_scatter": False}),
    ("bf16", {"mixed_precision": True, "compute_dtype": "bfloat16", "buffer_dtype": "bfloat16", "fp32_reduce_scatter": False}),
    ("fp16_bf16buf_fp32reduce", {"mixed_precision": True, "compute_dtype": "float16", "buffer_dtype": "bfloat16",
                                 "fp32_reduce_scatter": True}),
    ("reduce_only", None),
    ("fp64", None),
])
def test_precisions_map_to_fairscales_keywords_or_to_none(precision: str, keywords: dict | None) -> None:
    assert fairscale_precision(PRECISIONS[precision]) == keywords


@pytest.mark.parametrize(("fields", "reason"), [
    ({"precision": "reduce_only"}, "no other reduce dtype"),
    ({"use_orig_params": True}, "has no use_orig_params"),
    ({"optimizer": "adamw_groups"}, "FairScale's FSDP exposes flat ones"),
    ({"init_mode": "never"}, "the module is moved before wrapping"),
    ({"checkpoint": "full"}, "keyed by its own flat parameter ids"),
    ({"backward_prefetch": "pre"}, "no backward_prefetch"),
    ({"sharding_strategy": "no_shard"}, "maps only the strategies full_shard, shard_grad_op"),
])
def test_what_it_cannot_express_is_unsupported_with_the_engines_reason(fields: dict, reason: str) -> None:
    assert reason in (resolve("fairscale").unsupported(CaseConfig(engine="fairscale", **fields)) or "")
    assert resolve("fairscale").unsupported(CaseConfig(engine="fairscale", precision="bf16")) is None


def test_without_the_package_every_case_is_unsupported_with_the_install_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fairscale" else real(name, *a))
    from harness.cases.models import build_model

    ctx = RankContext(0, 2, 0, 2, "gloo", torch.device("cpu"))
    reason = FairScaleAdapter("fairscale").unsupported_reason(CaseConfig(engine="fairscale"),
                                                              build_model("nested", seed=0, rank=0, world_size=2), ctx)
    assert reason is not None and reason.startswith("fairscale: fairscale is not installed: pip install -e .[fairscale]")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA here: the GPU tests run these cases for real")
def test_on_cpu_ranks_the_real_run_path_says_unsupported_in_one_line(tmp_path: Path) -> None:
    records = run_records(tmp_path / "cpu.jsonl", "--engines", "fairscale", "--matrix", "pairwise", "--limit", "2")
    assert len(records) == 2
    for record in records:
        assert record["verdict"] == "unsupported", record["reason"]
        if fairscale_missing() is None:
            assert record["reason"] == ("fairscale: fairscale needs CUDA ranks over NCCL (its FSDP builds CUDA streams); "
                                        "this rank runs on cpu over gloo")


@pytest.mark.gpu
@needs_gpus(2, "one GPU per rank: FairScale's FSDP runs over NCCL only")
@needs_package(fairscale_missing)
def test_the_pairwise_matrix_on_two_gpus_fails_only_the_declared_bf16_cases(tmp_path: Path) -> None:
    records = run_records(tmp_path / "fairscale.jsonl", "--engines", "fairscale", "--matrix", "pairwise", "--backend", "nccl",
                          # verdicts, not throughput: few pools leave the GPUs to the other xdist workers
                          "--pools-per-gpu", "2",
                          "--world-size", "2", "--references", "ddp,local", "--optimizers", "sgd,adamw", timeout=1800)
    assert [r for r in records if r["verdict"] == "pass"], [r["reason"] for r in records][:5]
    assert undeclared_failures(records, _bf16) == []
