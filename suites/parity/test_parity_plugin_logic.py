"""The pure logic of the generated suites (``harness.pytest_plugin.cases``), without processes: option parsing,
suite slices per tier, where each xdist worker's ranks run, and what a record means to pytest."""

from __future__ import annotations

import itertools

import pytest

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord, QuantityError
from harness.pytest_plugin.cases import (
    Agreement,
    ParityOptions,
    SuiteMatrix,
    describe_failure,
    engine_baseline,
    outcome_of,
    plan_pool,
)
from harness.ranks.placement import gpus_shared
from harness.selection.matrix import invalid_reason, pairs_uncovered
from suites.parity.slices import CORE, MIXED_PRECISION, ORIG_PARAMS, SUITES, TRAINING_LOOP, WRAP

ENGINES = ("builtin", "torch-fsdp", "torch-fsdp2")


# ---------------------------------------------------------------------------------------------------
# Options


def parse(**overrides: object) -> ParityOptions:
    args = dict(engine="builtin,torch-fsdp,torch-fsdp2", reference="ddp,local", matrix="smoke", world_size="2",
                backend="auto", case_timeout=300.0, results=None)
    args.update(overrides)
    return ParityOptions.parse(**args)  # type: ignore[arg-type]


def test_default_options_are_every_engine_both_references_smoke_on_two_ranks() -> None:
    options = parse()
    assert options == ParityOptions()
    assert options.engines == ENGINES and options.references == ("ddp", "local")
    assert options.world_sizes == (2,) and options.matrix == "smoke"
    assert options.fsdp1_engines == ("builtin", "torch-fsdp")


def test_loop_axes_keeps_only_the_suites_that_vary_a_training_loop_axis() -> None:
    assert parse(loop_axes=True).loop_axes and not parse().loop_axes
    assert [s.name for s in SUITES if s.varies_loop_axes] == [TRAINING_LOOP.name]
    assert SuiteMatrix("accum", axes={"grad_accum": ["no_sync"]}).varies_loop_axes
    assert SuiteMatrix("groups", axes={"optimizer": ["adamw_groups"]}).varies_loop_axes


def test_options_parse_lists() -> None:
    options = parse(engine=" torch-fsdp2 , builtin", world_size="2,4", reference="local")
    assert options.engines == ("torch-fsdp2", "builtin")
    assert options.fsdp1_engines == ("builtin",)
    assert options.world_sizes == (2, 4) and options.references == ("local",)


@pytest.mark.parametrize(
    "overrides, option",
    [
        ({"engine": "builtin,fsdp3"}, "--engine"),
        ({"engine": ""}, "--engine"),
        ({"reference": "ddp,ddp"}, "--reference"),
        ({"world_size": "two"}, "--world-size"),
        ({"world_size": "0"}, "--world-size"),
        ({"matrix": "huge"}, "--matrix"),
        ({"backend": "mpi"}, "--backend"),
        ({"case_timeout": 0.0}, "--case-timeout"),
    ],
)
def test_bad_options_name_the_option(overrides: dict, option: str) -> None:
    with pytest.raises(ValueError, match=option):
        parse(**overrides)


# ---------------------------------------------------------------------------------------------------
# Where the ranks run


def test_cpu_host_runs_gloo_on_cpu() -> None:
    plan = plan_pool(2, "auto", n_gpus=0)
    assert (plan.backend, plan.devices, plan.skip_reason) == ("gloo", None, None)
    assert plan_pool(4, "gloo", n_gpus=8, device="cpu").devices is None, "--device cpu keeps the ranks on the CPU"
    assert plan_pool(4, "gloo", n_gpus=8).devices == (0, 1, 2, 3), "gloo alone runs on the GPUs"


def test_nccl_without_gpus_skips_with_the_reason() -> None:
    plan = plan_pool(2, "nccl", n_gpus=0)
    assert plan.backend is None and "needs a CUDA GPU" in plan.skip_reason


def test_more_ranks_than_gpus_share_them_through_gloo_never_move_to_cpu() -> None:
    plan = plan_pool(4, "auto", n_gpus=2)
    assert (plan.backend, plan.devices, plan.skip_reason) == ("gloo", (0, 1, 0, 1), None)
    refused = plan_pool(4, "nccl", n_gpus=2)
    assert refused.devices is None and "one GPU per rank" in refused.skip_reason and "2 visible" in refused.skip_reason


@pytest.mark.parametrize("n_gpus, n_workers", [(g, w) for g in range(1, 9) for w in range(1, 9)])
def test_xdist_workers_own_disjoint_gpus_where_they_fit_and_share_evenly_where_not(n_gpus: int, n_workers: int) -> None:
    """Every pool of every world size gets GPUs of the host: distinct ones (NCCL) where the host has one
    per rank, shared ones (gloo) where it has fewer. Where every worker has a block of at least
    ``world_size`` GPUs, two workers never hold the same GPU; where not, the workers' pools of one world
    size load every GPU within one pool of each other."""
    block = n_gpus // n_workers
    owned: dict[int, set[int]] = {}
    for world_size in range(1, 5):
        load = [0] * n_gpus
        for worker in range(n_workers):
            plan = plan_pool(world_size, "auto", n_gpus, worker, n_workers)
            assert plan.skip_reason is None and len(plan.devices) == world_size
            assert all(0 <= d < n_gpus for d in plan.devices)
            if world_size > n_gpus:
                assert plan.backend == "gloo" and plan.lane.ranks_per_gpu == -(-world_size // n_gpus)
                continue
            assert plan.backend == "nccl" and len(set(plan.devices)) == world_size
            assert gpus_shared(world_size, n_gpus, n_workers) == (world_size > block)
            for d in plan.devices:
                load[d] += 1
            if world_size <= block:
                owned.setdefault(worker, set()).update(plan.devices)
        if world_size <= n_gpus and world_size > block:
            assert max(load) - min(load) <= 1, f"world_size={world_size}: uneven GPU load {load}"
    for a, b in itertools.combinations(owned, 2):
        assert not owned[a] & owned[b], f"workers {a} and {b} share GPUs {owned[a] & owned[b]}"


def test_two_gpus_one_worker_two_ranks_takes_both() -> None:
    assert plan_pool(2, "auto", n_gpus=2).devices == (0, 1)
    assert plan_pool(2, "auto", n_gpus=4, worker=1, n_workers=2).devices == (2, 3)
    # 8 workers on 2 GPUs: every worker's pool runs on both, none is skipped.
    assert {plan_pool(2, "auto", n_gpus=2, worker=w, n_workers=8).devices for w in range(8)} == {(0, 1)}


# ---------------------------------------------------------------------------------------------------
# Suite slices


def test_engine_baseline_moves_fsdp2_only_where_it_must() -> None:
    assert engine_baseline("builtin")["use_orig_params"] is False
    assert engine_baseline("builtin")["backward_prefetch"] == "none"
    fsdp2 = engine_baseline("torch-fsdp2")
    assert fsdp2["use_orig_params"] is True and fsdp2["backward_prefetch"] == "pre"
    assert {k: v for k, v in fsdp2.items() if k not in ("engine", "use_orig_params", "backward_prefetch")} == {
        k: v for k, v in engine_baseline("builtin").items() if k not in ("engine", "use_orig_params", "backward_prefetch")
    }


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"axes": {"engine": ["builtin"]}}, "--engine"),
        ({"axes": {}, "fixed": {"world_size": 4}}, "--world-size"),
        ({"axes": {"colour": ["red"]}}, "unknown axes"),
        ({"axes": {"precision": ["fp32"]}, "fixed": {"precision": "bf16"}}, "both varied and fixed"),
        ({"axes": {"precision": ["fp32"]}, "smoke_each": ("model",)}, "smoke_each"),
    ],
)
def test_bad_slices_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SuiteMatrix("bad", **kwargs)


@pytest.mark.parametrize("matrix", ["smoke", "pairwise", "full"])
@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_every_tier_gives_valid_unique_cases_for_every_engine(suite: SuiteMatrix, matrix: str) -> None:
    options = ParityOptions(matrix=matrix)  # type: ignore[arg-type]
    cases = suite.cases(options)
    assert cases == suite.cases(options), "deterministic"
    assert len({c.full_id for c in cases}) == len(cases)
    assert all(invalid_reason(c) is None for c in cases)
    assert {c.engine for c in cases} == set(ENGINES)
    assert {c.reference for c in cases} == {"ddp", "local"}
    for case in cases:
        # Axes outside the slice stay at the engine's baseline, or at what the suite pins.
        base = {**engine_baseline(case.engine), **suite.fixed}
        outside = [a for a in base if a not in suite.axes and a not in ("engine", "reference", "world_size")]
        assert {a: getattr(case, a) for a in outside} == {a: base[a] for a in outside}, case.full_id


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_pairwise_covers_every_pair_of_the_slice_for_every_engine(suite: SuiteMatrix) -> None:
    cases = suite.cases(ParityOptions(matrix="pairwise"))
    for engine in ENGINES:
        for reference in ("ddp", "local"):
            mine = [c for c in cases if c.engine == engine and c.reference == reference]
            pins = {a: v for a, v in {**engine_baseline(engine), **suite.fixed}.items()
                    if a not in suite.axes and a not in ("reference",)}
            pins["reference"] = reference
            assert not pairs_uncovered(mine, axes=suite.axes, **pins), (engine, reference)


@pytest.mark.parametrize("suite", SUITES, ids=lambda s: s.name)
def test_full_is_the_product_of_the_slice_minus_invalid(suite: SuiteMatrix) -> None:
    cases = suite.cases(ParityOptions(matrix="full", references=("ddp",)))
    if suite.widest == "pairwise":
        # Too large a product for the full tier: the tier walks it pairwise.
        assert [c.full_id for c in cases] == [c.full_id for c in suite.cases(ParityOptions(matrix="pairwise", references=("ddp",)))]
        return
    for engine in ENGINES:
        mine = [c for c in cases if c.engine == engine]
        base = {**engine_baseline(engine), **suite.fixed}
        product = [
            CaseConfig(**{**base, "reference": "ddp", **dict(zip(suite.axes, values))})
            for values in itertools.product(*suite.axes.values())
        ]
        assert {c.full_id for c in mine} == {c.full_id for c in product if invalid_reason(c) is None}


def test_smoke_shows_every_variant_through_the_slice() -> None:
    cases = [c for c in CORE.cases(ParityOptions(references=("ddp",))) if c.engine == "builtin"]
    assert {c.model for c in cases} == {"nested", "transformer"}, "smoke_each shows every model"
    # The matrix's smoke variants, restricted to the axes CORE varies.
    assert {(c.sharding_strategy, c.backward_prefetch, c.cpu_offload, c.use_orig_params) for c in cases if c.model == "nested"} == {
        ("full_shard", "none", False, False),
        ("shard_grad_op", "pre", False, True),
        ("no_shard", "none", False, False),
        ("full_shard", "post", True, False),
    }
    assert all(c.precision == "fp32" for c in cases), "precision is not CORE's axis"
    fsdp2 = [c for c in CORE.cases(ParityOptions(references=("ddp",))) if c.engine == "torch-fsdp2"]
    assert fsdp2 and all(c.use_orig_params and c.backward_prefetch == "pre" for c in fsdp2)
    assert any(c.cpu_offload for c in fsdp2), "a variant keeps what the engine can run (offload) when it drops BACKWARD_POST"


def test_tier_sizes_stay_within_their_budgets() -> None:
    """How many cases each tier runs on 2 ranks, every engine, both references: smoke stays small for
    the CPU tier, full fits the 10-minute 2-GPU tier (a case takes well under a second there)."""
    sizes = {
        matrix: {s.name: len(s.cases(ParityOptions(matrix=matrix))) for s in SUITES}  # type: ignore[arg-type]
        for matrix in ("smoke", "pairwise", "full")
    }
    # 200 before the training-loop suite, whose 24 smoke cases (compile and checkpointing among them) took
    # about 80 s on 2 contended CPU cores, and the fp16 single iteration's 36 (7 s).
    assert sum(sizes["smoke"].values()) <= 260, sizes
    # 1074 before the training-loop suite, whose full tier is its pairwise walk (96 cases), and the fp16
    # single iteration (60 one-step cases).
    assert sum(sizes["smoke"].values()) < sum(sizes["pairwise"].values()) < sum(sizes["full"].values()) <= 1250, sizes
    assert len(WRAP.cases(ParityOptions())) >= 3 * 2 * len(WRAP.axes["model"]), "smoke shows every wrap model per engine"
    assert {c.precision for c in MIXED_PRECISION.cases(ParityOptions(matrix="pairwise"))} == set(MIXED_PRECISION.axes["precision"])
    assert {c.forward_prefetch for c in ORIG_PARAMS.cases(ParityOptions(matrix="pairwise"))} == {False, True}


# ---------------------------------------------------------------------------------------------------
# Records to pytest outcomes

CASE = CaseConfig(engine="builtin")


def record(verdict: str, reason: str = "", **kwargs: object) -> CaseRecord:
    return CaseRecord(case=CASE.to_dict(), case_id=CASE.case_id, verdict=verdict, reason=reason, **kwargs)  # type: ignore[arg-type]


def test_pass_passes_and_unsupported_skips_with_the_reason() -> None:
    assert outcome_of(record("pass")).action == "pass"
    outcome = outcome_of(record("unsupported", "torch-fsdp2: fully_shard always shards"))
    assert outcome.action == "skip" and "fully_shard always shards" in outcome.message


def test_a_rank_check_s_outcome_maps_as_a_case_s() -> None:
    """Rank checks (``RankChecks.assert_passed``) take the same pass / skip / fail outcome a case's record does."""
    from harness.pytest_plugin.rank_checks import CheckOutcome

    assert CheckOutcome("c", (None, None), (None, None)).as_test_outcome().action == "pass"
    skipped = CheckOutcome("c", (None, None), ("no GPU", "no GPU")).as_test_outcome()
    assert skipped.action == "skip" and skipped.message == "no GPU"
    failed = CheckOutcome("c", (None, "Traceback: boom"), (None, None)).as_test_outcome()
    assert failed.action == "fail" and failed.message == "check c failed:\n--- rank 1 ---\nTraceback: boom"
    half = CheckOutcome("c", (None, None), ("no GPU", None)).as_test_outcome()
    assert half.action == "fail" and "skipped on some ranks but ran on ranks [1]" in half.message


def test_fail_lists_the_worst_quantities_and_ignored_knobs() -> None:
    errors = [
        QuantityError("loss@0", 0.0, 0.0, 1e-5, 1e-6, True, 0.1),
        QuantityError("grad:0.weight", 0.5, 0.1, 1e-5, 1e-6, False, 50.0),
        QuantityError("param:1.bias", 0.01, 0.01, 1e-5, 1e-6, False, 5.0),
    ]
    detail = {
        "worst_at": {"grad:0.weight": {"step": 2, "rank": 1}},
        "knobs": [{"knob": "backward_prefetch", "status": "ignored", "reason": "same order as none"}],
    }
    outcome = outcome_of(record("fail", "grad:0.weight: max_abs 0.5 ...", errors=errors, detail=detail))
    assert outcome.action == "fail"
    lines = outcome.message.splitlines()
    assert lines[0].startswith("fail: grad:0.weight")
    assert "grad:0.weight" in lines[1] and "step 2, rank 1" in lines[1] and "ratio 50" in lines[1]
    assert "param:1.bias" in lines[2]
    assert not any("loss@0" in line for line in lines), "passing quantities are not listed"
    assert "knob backward_prefetch ignored: same order as none" in outcome.message


@pytest.mark.parametrize(
    "verdict, detail, expected",
    [
        ("error", {"tracebacks": {"1": "Traceback ...\nRuntimeError: boom"}}, ["rank 1 traceback", "RuntimeError: boom"]),
        ("timeout", {"stacks": {"0": 'File "x.py", line 3 in all_reduce'}}, ["rank 0 stack", "all_reduce"]),
        ("crash", {"exit_codes": {"1": -11}, "stderr_tails": {"1": "Segmentation fault"}}, ["exit code -11", "Segmentation fault"]),
    ],
)
def test_error_timeout_crash_fail_with_their_evidence(verdict: str, detail: dict, expected: list[str]) -> None:
    outcome = outcome_of(record(verdict, "why", detail=detail))
    assert outcome.action == "fail" and outcome.message.startswith(f"{verdict}: why")
    for text in expected:
        assert text in outcome.message


def test_long_evidence_keeps_its_end() -> None:
    tail = "x" * 10_000 + "THE END"
    message = describe_failure(record("crash", "died", detail={"stderr_tails": {"0": tail}}))
    assert message.endswith("THE END") and len(message) < 4000


# ---------------------------------------------------------------------------------------------------
# Agreement between engines


def test_agreement_separates_disagreements_from_capabilities() -> None:
    agreement = Agreement()
    for engine, outcome in (("builtin", "passed"), ("torch-fsdp", "passed")):
        agreement.add("same", engine, outcome)
    agreement.add("differ", "builtin", "passed")
    agreement.add("differ", "torch-fsdp", "passed")
    agreement.add("differ", "torch-fsdp", "failed")  # a later phase failed: the worst phase counts
    agreement.add("differ", "torch-fsdp", "passed")
    agreement.add("offload", "builtin", "passed")
    agreement.add("offload", "torch-fsdp", "skipped")
    agreement.add("alone", "builtin", "failed")
    assert set(agreement.compared()) == {"same", "differ", "offload"}
    assert agreement.disagreements() == {"differ": {"builtin": "passed", "torch-fsdp": "failed"}}
    assert set(agreement.one_engine_only()) == {"offload"}
    text = agreement.render("ported check")
    assert text.splitlines()[0] == (
        "ported check on builtin, torch-fsdp: 3 compared, 1 agree, 1 disagree, 1 ran on one engine only"
    )
    assert "differ" in text and "offload" in text and "alone" not in text


def test_agreement_ranks_verdicts_and_pytest_outcomes_on_one_severity() -> None:
    """The worst outcome is kept by ``harness.cases.records.SEVERITY``: a flaky case counts as failing, a crash
    is worse than an error, pytest's ``failed`` as a failure."""
    agreement = Agreement()
    for key, outcomes in (("flaky", ("pass", "flaky", "pass")), ("crash", ("error", "crash", "fail")),
                          ("ported", ("passed", "failed", "skipped"))):
        for outcome in outcomes:
            agreement.add(key, "builtin", outcome)
    assert agreement.outcomes == {"flaky": {"builtin": "flaky"}, "crash": {"builtin": "crash"}, "ported": {"builtin": "failed"}}


# ---------------------------------------------------------------------------------------------------
# Hand-written cases obey --engine and --reference (engine_cases)


def test_hand_written_cases_obey_the_engine_and_reference_options() -> None:
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "suites/parity/test_world_sizes.py", "--engine", "builtin", "--reference", "local",
         "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    cases = [i for i in ids if "[" in i and ":" in i.split("[", 1)[1]]
    assert cases and all("[builtin:local:" in i for i in cases), "\n".join(i for i in cases if "[builtin:local:" not in i)
    # ... and what they leave out starts no pool: no world-size-8 case of another engine remains.
    assert "deselected" in done.stdout
