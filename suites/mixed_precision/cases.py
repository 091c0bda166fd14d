"""Case tables and result checks shared by the CPU and GPU test modules."""

from __future__ import annotations

from typing import Any

from tabulate import tabulate

from harness.case import PRECISIONS

#: the prefetch subtests of the seed's e2e test: forward prefetch x backward prefetch.
ALL_PREFETCH = [(fwd, bwd) for fwd in (False, True) for bwd in ("none", "pre", "post")]
#: configurations of the e2e product per mp config and CPU offload value: fp32/fp64 x grad scaler x prefetch.
E2E_RUNS = 2 * 2 * len(ALL_PREFETCH)

#: the seed's embedding-table mixed-precision configs.
EMBEDDING_CONFIGS = {
    "reduce": {"reduce_dtype": "float16"},
    "only_params_and_bufs": {"param_dtype": "float16", "buffer_dtype": "float16"},
    "default": {"param_dtype": "float16", "buffer_dtype": "float16", "reduce_dtype": "float16"},
    "params_and_reduce_diff": {"param_dtype": "float16", "buffer_dtype": "float16", "reduce_dtype": "float32"},
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
#: Scaler scenarios torch FSDP1 fails on CUDA (measured on torch 2.11, 2 x H200), with why. The GPU test
#: expects the failure strictly: the day torch passes one, the test fails and this entry goes.
TORCH_FSDP1_CUDA_SCALER_FAILURES: dict[str, str] = {
    "bf16_low_grads": "torch FSDP1's ShardedGradScaler unscales with torch._amp_foreach_non_finite_check_and_unscale_, "
                      "which has no bfloat16 CUDA kernel (NotImplementedError); ours checks bfloat16 gradients itself",
    "fp16_low_grads_offload": "torch FSDP1 with keep_low_precision_grads and CPU offload assigns the float16 CPU gradient "
                              "to the float32 flat parameter, which torch >= 2.11 refuses (grad_dtype check) at the end "
                              "of backward",
    "fp32_offload": "torch FSDP1's ShardedGradScaler copies the scale and the inf flag to the CPU gradients' device "
                    "with non_blocking=True (_GeneralMultiDeviceReplicator.get) and reads them on CPU without waiting: "
                    "with the GPU busy (the job keeps it busy) the first step unscales by an unset scale and leaves the "
                    "parameters unchanged, and the inf on rank 1 is overwritten by the late copy, so nobody skips",
}
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
    {"strategy": "FULL_SHARD", "bwd": "pre"},
    {"strategy": "SHARD_GRAD_OP", "orig": True, "bwd": "post", "fwd": True},
    {"strategy": "NO_SHARD", "offload": True, "bwd": "none"},
    {"strategy": "FULL_SHARD", "orig": True, "offload": True, "bwd": "post"},
]


def parity_payload(engine: str, precision: str, offload: bool) -> dict[str, Any]:
    """The engine cases with (or without) CPU offload; the guards run with the offload-free ones (an
    engine that cannot offload on this host skips the offload payload, and keeps its guards)."""
    cases = [c for c in PARITY_CASES if c.get("offload", False) == offload]
    return {"engine": engine, "precision": precision, "cases": cases, "steps": 5, "guards": not offload}


def parity_table(records: list[dict[str, Any]]) -> str:
    columns = ["engine", "precision", "case", "error", "atol", "nearest", "distance_to_fp64", "floor", "passed", "must_fail"]
    return tabulate([[r[c] for c in columns] for r in records], headers=columns, floatfmt=".3g")


def check_parity_records(per_rank: list[list[dict[str, Any]]], record_property: Any, guards: bool = True) -> None:
    """Every engine case passes; every guard whose dropped cast changes the numbers fails (``guards``:
    the payload ran them)."""
    for rank, records in enumerate(per_rank):
        if rank == 0:
            print(f"\n{records[0]['plan']}\n{parity_table(records)}")
            print("distances from the emulation:", records[0]["distances"], "resolvable:", records[0]["resolvable"])
            for r in records:
                keys = ("error", "atol", "nearest", "distances", "distance_to_fp64", "floor", "passed")
                record_property(f"{r['engine']}:{r['precision']}:{r['case']}", {k: r[k] for k in keys})
        if PRECISIONS[records[0]["precision"]].is_mixed and guards:
            assert any(r["drop_casts"] == "all" for r in records), "no guard case ran"
        for r in records:
            if r["drop_casts"]:
                assert not (r["must_fail"] and r["passed"]), (
                    f"rank {rank}: {r['engine']} with {r['drop_casts']} casts dropped passed the comparison for "
                    f"{r['precision']} (error {r['error']:.3g} <= atol {r['atol']:.3g}): the tolerance looks away"
                )
            else:
                assert r["passed"], f"rank {rank}: {r['engine']} {r['precision']} {r['case']}: error {r['error']:.3g} > atol {r['atol']:.3g} at {r['worst']}"
