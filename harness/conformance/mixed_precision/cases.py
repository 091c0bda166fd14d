"""Case tables and result checks shared by the CPU and GPU test modules."""

from __future__ import annotations

from typing import Any, get_args

from tabulate import tabulate

from harness.cases.case import PRECISIONS, CaseConfig, PrecisionSpec, PrefetchName
from harness.cases.records import CaseRecord
from harness.collect.expectations import ExpectedFailure
from harness.conformance.mixed_precision.models import PARITY_NET

#: the prefetch subtests of the torch test's e2e test: forward prefetch x backward prefetch.
ALL_PREFETCH = [(fwd, bwd) for fwd in (False, True) for bwd in get_args(PrefetchName)]
#: configurations of the e2e product per mp config and CPU offload value: fp32/fp64 x grad scaler x prefetch.
E2E_RUNS = 2 * 2 * len(ALL_PREFETCH)

#: the torch test's embedding-table mixed-precision configs.
EMBEDDING_CONFIGS: dict[str, PrecisionSpec] = {
    "reduce": PRECISIONS["reduce_only"],
    "only_params_and_bufs": PRECISIONS["param_buffer"],
    "default": PRECISIONS["fp16"],
    # Not a precision of the matrix: float16 buffers beside the float32 reduce (the matrix's own has bfloat16).
    "params_and_reduce_diff": PrecisionSpec(full="float32", param="float16", reduce="float32", buffer="float16"),
}

#: ShardedGradScaler scenarios: parameter dtype, low-precision gradients, CPU offload.
SCALER_CASES: dict[str, dict[str, Any]] = {
    "fp32": {},
    "fp16_params": {"low": "float16"},
    "bf16_params": {"low": "bfloat16"},
    "fp16_low_grads": {"low": "float16", "keep_low": True},
    "fp16_low_grads_offload": {"low": "float16", "keep_low": True, "offload": True},
    "bf16_low_grads": {"low": "bfloat16", "keep_low": True},
    "fp32_offload": {"offload": True},
}
#: Scaler scenarios (``SCALER_CASES``, by name) torch FSDP1 fails on CUDA (measured on torch 2.11, 2 x H200),
#: with why. The GPU test expects the failure strictly: the day torch passes one, the test fails and this
#: entry goes.
TORCH_FSDP1_CUDA_SCALER_FAILURES: tuple[ExpectedFailure, ...] = tuple(
    ExpectedFailure(reason, engine="torch-fsdp", device="cuda", checks=(scenario,)) for scenario, reason in (
        ("bf16_low_grads", "torch FSDP1's ShardedGradScaler unscales with torch._amp_foreach_non_finite_check_and_unscale_, "
                           "which has no bfloat16 CUDA kernel (NotImplementedError); ours checks bfloat16 gradients itself"),
        ("fp16_low_grads_offload", "torch FSDP1 with keep_low_precision_grads and CPU offload assigns the float16 CPU "
                                   "gradient to the float32 flat parameter, which torch >= 2.11 refuses (grad_dtype "
                                   "check) at the end of backward"),
        ("fp32_offload", "torch FSDP1's ShardedGradScaler copies the scale and the inf flag to the CPU gradients' device "
                         "with non_blocking=True (_GeneralMultiDeviceReplicator.get) and reads them on CPU without "
                         "waiting: with the GPU busy (the job keeps it busy) the first step unscales by an unset scale "
                         "and leaves the parameters unchanged, and the inf on rank 1 is overwritten by the late copy, "
                         "so nobody skips"),
    )
)
#: the gradient dtype each scenario must produce (float32 unless listed).
SCALER_GRAD_DTYPE = {
    "fp16_low_grads": "torch.float16",
    "fp16_low_grads_offload": "torch.float16",
    "bf16_low_grads": "torch.bfloat16",
}


def check_scaler_agreement(values: list[dict[str, Any]], case: str) -> None:
    """Clean step, inf on rank 1 only, clean step: every rank steps, skips, steps; the scale
    backs off once on every rank."""
    for rank, steps in enumerate(values):
        assert steps["step0"]["stepped"] and steps["step2"]["stepped"], (rank, steps)
        assert not steps["step1"]["stepped"], f"rank {rank} stepped although rank 1 found an inf: {steps}"
        assert steps["step0"]["scale"] == 2.0**8 and steps["step1"]["scale"] == 2.0**7, (rank, steps)
        assert steps["step0"]["grads"] == [SCALER_GRAD_DTYPE.get(case, "torch.float32")], steps
        if SCALER_CASES[case].get("offload"):
            assert steps["step0"]["grad_devices"] == ["cpu"], steps


#: engine cases per precision config: strategies, use_orig_params, offload and prefetch spread over them.
PARITY_CASES: list[dict[str, Any]] = [
    {"sharding_strategy": "full_shard", "backward_prefetch": "pre"},
    {"sharding_strategy": "shard_grad_op", "use_orig_params": True, "backward_prefetch": "post", "forward_prefetch": True},
    {"sharding_strategy": "no_shard", "cpu_offload": True, "backward_prefetch": "none"},
    {"sharding_strategy": "full_shard", "use_orig_params": True, "cpu_offload": True, "backward_prefetch": "post"},
]
#: the guards' dropped casts: ``all`` (no mixed precision at all) or one ``MixedPrecision`` field, and the
#: run of the harness's reference an engine dropping it computes (``harness.engines.references.cast_ablations``).
GUARDS: dict[str, tuple[str, str]] = {
    "all": ("mixed_precision", "fp64"),
    "param": ("param_dtype", "no_param"),
    "reduce": ("reduce_dtype", "no_reduce"),
    "buffer": ("buffer_dtype", "no_buffer"),
}


def parity_cases(engine: str, precision: str, offload: bool) -> list[tuple[str, CaseConfig]]:
    """``(dropped cast or "", case)``: the engine cases with (or without) CPU offload on ``ParityNet``
    against the harness's emulating reference, and for mixed configs without offload the guards: the
    first case with casts dropped (adapters' ``ignore_option``) and the knob checks off, so that only
    the values can fail them."""
    base = CaseConfig(engine=engine, reference="local", model=PARITY_NET, precision=precision, steps=5, lr=0.1)  # type: ignore[arg-type]
    cases = [("", base.replace(**c)) for c in PARITY_CASES if c.get("cpu_offload", False) == offload]
    if PRECISIONS[precision].is_mixed and not offload:
        first = cases[0][1]
        for dropped, (option, _) in GUARDS.items():
            cases.append((dropped, first.replace(extras=(("fault", f"ignore_option:{option}"), ("knob_checks", "off")))))
    return cases


def must_fail(dropped: str, record: CaseRecord) -> bool:
    """A guard must fail where the reference run it computes differs from the emulation by more than
    the tolerance on some quantity (``detail["resolvable"]``); a cast with no numerical effect is not."""
    return bool(dropped) and bool(record.detail.get("resolvable", {}).get(GUARDS[dropped][1]))


def check_parity_records(engine: str, precision: str, results: list[tuple[str, CaseRecord]], record_property: Any) -> None:
    """Every engine case passes; every guard whose dropped cast changes the numbers fails (with the
    knob checks off: on values alone); for a mixed config the all-casts guard is one of those."""
    rows = []
    for dropped, record in results:
        worst = max(record.errors, key=lambda e: e.ratio, default=None)
        rows.append([record.case_id, dropped or "-", record.verdict, record.worst_ratio, worst.name if worst else "",
                     must_fail(dropped, record), record.reason[:80]])
        record_property(f"{engine}:{precision}:{record.case_id}:{dropped or 'engine'}",
                        {"verdict": record.verdict, "worst_ratio": record.worst_ratio, "resolvable": record.detail.get("resolvable")})
    print("\n" + tabulate(rows, headers=["case", "dropped", "verdict", "worst ratio", "at", "must fail", "reason"], floatfmt=".3g"))
    for dropped, record in results:
        if record.verdict == "unsupported":
            continue
        if not dropped:
            assert record.verdict == "pass", f"{engine} {precision} {record.case_id}: {record.verdict}: {record.reason}"
        elif must_fail(dropped, record):
            assert record.verdict != "pass", (
                f"{engine} with {dropped} casts dropped passed {precision} on values (worst ratio {record.worst_ratio:.3g}): "
                "the tolerance looks away"
            )
    guards = {d: r for d, r in results if d}
    if guards:
        assert must_fail("all", guards["all"]), f"{precision}: dropping every cast is within the tolerance: {guards['all'].detail}"
