"""Parity cases end to end on the rank pool: torch FSDP1 and FSDP2 pass a smoke set against DDP and
the local reference; the built-in engine passes or, while it cannot be imported, is an honest error;
a wrong gradient, an ignored setting and an unsupported combination are reported as such.
"""

from __future__ import annotations


import pytest

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord
from harness.compare.parity import record_from_outcome, run_case_on_rank
from harness.pytest_plugin import needs_gpus
from harness.ranks.pool import RankPool

FSDP1 = {"engine": "torch-fsdp"}
# FSDP2 always uses the original parameters and prefetches one module ahead in backward.
FSDP2 = {"engine": "torch-fsdp2", "use_orig_params": True, "backward_prefetch": "pre"}

SMOKE: list[CaseConfig] = [
    CaseConfig(**FSDP1, reference="ddp", model="nested"),
    CaseConfig(**FSDP1, reference="local", model="transformer", sharding_strategy="shard_grad_op",
               backward_prefetch="pre", use_orig_params=True, steps=3),
    CaseConfig(**FSDP1, reference="ddp", model="moe", backward_prefetch="post", forward_prefetch=True),
    CaseConfig(**FSDP1, reference="local", model="gpt", precision="bf16", steps=3),
    CaseConfig(**FSDP1, reference="ddp", model="lora", sharding_strategy="no_shard", use_orig_params=True),
    CaseConfig(**FSDP1, reference="local", model="batchnorm", precision="reduce_only"),
    CaseConfig(**FSDP2, reference="ddp", model="nested"),
    CaseConfig(**FSDP2, reference="local", model="transformer", sharding_strategy="shard_grad_op", steps=3),
    CaseConfig(**FSDP2, reference="ddp", model="moe", forward_prefetch=True),
    CaseConfig(**FSDP2, reference="local", model="gpt", precision="bf16", steps=3),
    CaseConfig(**FSDP2, reference="ddp", model="lora"),
    CaseConfig(**FSDP2, reference="local", model="always_wrap", precision="fp64"),
]

BUILTIN: list[CaseConfig] = [
    CaseConfig(engine="builtin", reference="ddp", model="nested"),
    CaseConfig(engine="builtin", reference="local", model="transformer", use_orig_params=True, steps=3),
]


def _run(pool: RankPool, case: CaseConfig) -> CaseRecord:
    return record_from_outcome(case, pool.run(run_case_on_rank, case))


@pytest.mark.parametrize("case", SMOKE, ids=lambda c: c.full_id)
def test_torch_engines_pass_the_smoke_set(parity_pool: RankPool, case: CaseConfig) -> None:
    record = _run(parity_pool, case)
    assert record.verdict == "pass", record.reason
    names = {e.name for e in record.errors}
    assert {f"loss@{s}" for s in range(case.steps)} <= names
    assert any(n.startswith("grad:") for n in names) and any(n.startswith("param:") for n in names)
    assert all(e.passed and e.ratio <= 1 for e in record.errors)
    assert record.wall_s > 0
    sharded = case.sharding_strategy != "no_shard"
    assert (record.bytes_all_gathered > 0) == sharded and (record.bytes_reduce_scattered > 0) == sharded
    knobs = {k["knob"]: k["status"] for k in record.detail["knobs"]}
    assert "ignored" not in knobs.values()
    assert knobs["sharding_strategy"] == "ok"
    if case.backward_prefetch != "none" and case.sharding_strategy == "full_shard":
        assert knobs["backward_prefetch"] == "ok"
    if case.forward_prefetch:
        assert knobs["forward_prefetch"] == "ok"
    if case.precision_spec.is_mixed:
        assert knobs["precision"] == "ok" and record.detail["budget_source"] == "ablation"


@pytest.mark.parametrize("case", BUILTIN, ids=lambda c: c.full_id)
def test_builtin_engine_passes(parity_pool: RankPool, case: CaseConfig) -> None:
    record = _run(parity_pool, case)
    assert record.verdict == "pass", record.reason


def test_a_wrong_gradient_fails_and_names_where(parity_pool: RankPool) -> None:
    case = CaseConfig(**FSDP1, reference="local", model="nested", steps=2, extras=(("fault", "perturb_grad_rank1"),))
    record = _run(parity_pool, case)
    assert record.verdict == "fail"
    assert record.reason.startswith("grad:") and "step 0 on rank 1" in record.reason
    failing = {e.name for e in record.errors if not e.passed}
    assert "loss@1" in failing and any(n.startswith("param:") for n in failing)
    assert "loss@0" not in failing  # the first forward ran before any gradient was touched


@pytest.mark.parametrize("case,knob", [
    (CaseConfig(**FSDP1, model="nested", backward_prefetch="pre", steps=2,
                extras=(("fault", "ignore_option:backward_prefetch"),)), "backward_prefetch"),
    (CaseConfig(**FSDP1, model="nested", forward_prefetch=True, steps=2,
                extras=(("fault", "ignore_option:forward_prefetch"),)), "forward_prefetch"),
    (CaseConfig(**FSDP2, model="nested", sharding_strategy="shard_grad_op", steps=2,
                extras=(("fault", "ignore_option:reshard_after_forward"),)), "sharding_strategy"),
], ids=lambda v: v.full_id if isinstance(v, CaseConfig) else v)
def test_a_silently_ignored_setting_fails(parity_pool: RankPool, case: CaseConfig, knob: str) -> None:
    record = _run(parity_pool, case)
    assert record.verdict == "fail"
    assert f"knob {knob} ignored" in record.reason
    # The numbers alone would not have caught it: the engine trained correctly, just not as asked.
    assert all(e.passed for e in record.errors)


def test_dropped_mixed_precision_fails_on_values_and_on_the_knob(parity_pool: RankPool) -> None:
    """Every cast dropped: the values fail (half the distance to float64 is the budget) and so does the
    precision knob check."""
    case = CaseConfig(**FSDP1, reference="local", model="nested", precision="bf16", steps=2,
                      extras=(("fault", "ignore_option:mixed_precision"),))
    record = _run(parity_pool, case)
    assert record.verdict == "fail" and "knob precision ignored" in record.reason
    assert not all(e.passed for e in record.errors), "the values alone let an engine without mixed precision pass"


#: An engine that silently ignores one MixedPrecision field, per engine (FSDP2 has no buffer dtype;
#: dropping a buffer cast on values is shown on a model whose buffer moves the numbers, in
#: suites/mixed_precision/test_parity.py).
PLANTED = [
    CaseConfig(**engine, reference="local", model="nested", precision="fp16_bf16buf_fp32reduce", steps=3,
               extras=(("fault", f"ignore_option:{field}"), ("knob_checks", "off")))
    for engine in ({"engine": "builtin"}, FSDP1, FSDP2)
    for field in ("param_dtype", "reduce_dtype")
]


@pytest.mark.parametrize("case", PLANTED, ids=lambda c: f"{c.engine}-{c.extra['fault']}")
def test_an_engine_dropping_one_cast_fails_on_values_alone(parity_pool: RankPool, case: CaseConfig) -> None:
    record = _run(parity_pool, case)
    ablation = "no_" + case.extra["fault"].split(":")[1].removesuffix("_dtype")
    assert record.detail["resolvable"][ablation], f"{ablation} moves no quantity: the case shows nothing"
    assert record.detail["knobs"] == [], "the knob checks must be off"
    assert record.verdict == "fail" and any(not e.passed for e in record.errors), record.reason
    honest = _run(parity_pool, case.replace(extras=()))
    assert honest.verdict == "pass", honest.reason


def test_determinism_check(parity_pool: RankPool) -> None:
    record = _run(parity_pool, CaseConfig(**FSDP2, model="gpt", steps=2, check_determinism=True))
    assert record.verdict == "pass", record.reason
    assert record.deterministic is True


@pytest.mark.parametrize("case,reason", [
    (CaseConfig(**FSDP2, sharding_strategy="no_shard"), "NO_SHARD"),
    (CaseConfig(**{**FSDP2, "backward_prefetch": "post"}), "BACKWARD_PRE"),
    (CaseConfig(**{**FSDP2, "use_orig_params": False}), "use_orig_params=False"),
    (CaseConfig(**FSDP2, model="transformer", precision="bf16"), "buffer dtype"),
    (CaseConfig(**FSDP1, world_size=3), "world_size=3"),
    # DDP computes in full precision: a mixed-precision case is judged against local only, never twice.
    (CaseConfig(**FSDP1, precision="reduce_only"), "only the local reference (which emulates the casts) can judge it"),
], ids=lambda v: v.full_id if isinstance(v, CaseConfig) else v)
def test_unsupported_cases_say_why(parity_pool: RankPool, case: CaseConfig, reason: str) -> None:
    record = _run(parity_pool, case)
    assert record.verdict == "unsupported" and reason in record.reason, record.reason


#: What only a GPU run exercises: the sleeps race the engine's streams, offload moves parameters to
#: the host, and the init modes put the model on the device at different times.
GPU_CASES: list[CaseConfig] = [
    *(CaseConfig(**FSDP1, reference="ddp", model=m) for m in ("moe_sleep_reduce", "moe_sleep_step", "moe_sleep_free")),
    *(CaseConfig(**FSDP2, reference="local", model=m) for m in ("moe_sleep_reduce", "moe_sleep_step", "moe_sleep_free")),
    CaseConfig(**FSDP1, reference="ddp", model="transformer", cpu_offload=True, init_mode="never"),
    CaseConfig(**FSDP1, reference="local", model="nested", init_mode="after", precision="fp16"),
    CaseConfig(**FSDP2, reference="ddp", model="gpt", cpu_offload=True),
]


@pytest.mark.gpu
@needs_gpus(1)
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.full_id)
def test_gpu_only_behaviours(parity_pool: RankPool, case: CaseConfig) -> None:
    assert parity_pool.config.lane.device == "cuda"
    record = _run(parity_pool, case)
    assert record.verdict == "pass", record.reason
    assert record.peak_mem_bytes > 0
    knobs = {k["knob"]: k["status"] for k in record.detail["knobs"]}
    assert knobs["cpu_offload"] == "ok"
    if case.cpu_offload:
        assert knobs["offload_placement"] == "ok", record.detail["knobs"]


def test_a_run_gathers_its_gradient_norms_once(parity_pool: RankPool) -> None:
    """Each gather of the norms' pieces is a collective every rank waits on (two over NCCL, with host copies), so
    a run makes one for all its steps, and still observes a norm per step (a resumed run makes one per stretch of
    steps around its checkpoint, whose helpers gather objects of their own)."""
    import harness_jobs

    case = CaseConfig(engine="builtin", reference="local", model="nested", steps=4)
    outcome = parity_pool.run(harness_jobs.object_gathers_of_a_run, case)
    assert outcome.status == "ok", outcome.reason
    for value in outcome.values:
        assert value["gathers"] == 1 and len(value["norms"]) == 4 and all(n > 0 for n in value["norms"]), value
    assert outcome.values[0]["norms"] == outcome.values[1]["norms"]
