"""The runner's pure logic: repeats and the flaky verdict, the interleaved order under a budget, the ETA
for what a budget will run, and where stress delays fire (on CPU, with a recording sleep)."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
import torch.nn as nn

from harness.cases.case import CaseConfig
from harness.cases.models import build_model
from harness.cases.records import CaseRecord, QuantityError
from harness.compare.stress import Stress, unsupported_reason
from harness.compare.trace import CommTrace
from harness.run.repeats import decide, merge_runs, needs_rerun
from harness.run.runner import Selection, expected_total, select_cases
from harness.selection.sampling import interleave, sample_order

CASE = CaseConfig()


def _run(verdict: str, reason: str = "", ratio: float = 0.0, wall_s: float = 1.0) -> CaseRecord:
    errors = [QuantityError("loss@1", ratio, ratio, 1e-5, 1e-5, ratio <= 1, ratio)]
    return CaseRecord(CASE.to_dict(), CASE.case_id, verdict, reason, errors=errors, wall_s=wall_s)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("verdicts", "verdict", "counts"),
    [
        (["pass"], "pass", {"pass": 1}),
        (["pass"] * 5, "pass", {"pass": 5}),
        (["fail"] * 3, "fail", {"fail": 3}),
        (["pass", "pass", "fail", "pass", "fail"], "flaky", {"pass": 3, "fail": 2}),
        (["fail", "pass", "pass", "pass", "pass"], "flaky", {"fail": 1, "pass": 4}),  # a majority never passes it
        (["timeout", "crash"], "flaky", {"timeout": 1, "crash": 1}),
        (["unsupported", "pass"], "flaky", {"unsupported": 1, "pass": 1}),
    ],
)
def test_runs_that_disagree_are_flaky_never_pass(verdicts: list[str], verdict: str, counts: dict[str, int]) -> None:
    assert decide(verdicts) == (verdict, counts)


def test_decide_needs_a_run() -> None:
    with pytest.raises(ValueError, match="at least once"):
        decide([])


def test_a_flaky_record_counts_its_outcomes_and_shows_the_failing_run() -> None:
    merged = merge_runs([_run("pass", wall_s=1), _run("fail", "loss@1: max_abs 3 exceeds", ratio=3.0, wall_s=2),
                         _run("pass", wall_s=1)])
    assert merged.verdict == "flaky" and merged.outcomes == {"pass": 2, "fail": 1}
    assert merged.reason.startswith("runs disagree (pass 2, fail 1); first fail: loss@1")
    assert merged.worst_ratio == 3.0 and merged.wall_s == 4
    assert [r["verdict"] for r in merged.detail["runs"]] == ["pass", "fail", "pass"]
    # Written and read back: the field survives, and records without it still read.
    again = CaseRecord.from_dict(json.loads(json.dumps(merged.to_dict())))
    assert again.outcomes == {"pass": 2, "fail": 1} and again.verdict == "flaky"
    old = merged.to_dict()
    del old["outcomes"]
    assert CaseRecord.from_dict(old).outcomes is None


def test_agreeing_runs_keep_their_verdict_and_one_run_is_unchanged() -> None:
    single = _run("fail", "x", ratio=2.0)
    assert merge_runs([single]) is single
    merged = merge_runs([_run("fail", "x", ratio=2.0)] * 3)
    assert merged.verdict == "fail" and merged.outcomes == {"fail": 3} and merged.reason == "x"
    assert needs_rerun(merged) and not needs_rerun(_run("pass")) and not needs_rerun(_run("unsupported"))
    other = CaseConfig(model="transformer")
    with pytest.raises(ValueError, match="different cases"):
        merge_runs([_run("pass"), CaseRecord(other.to_dict(), other.case_id, "pass")])


def test_interleave_reaches_every_engine_reference_and_model_first() -> None:
    cases = select_cases(Selection(matrix="full"), [2])
    ordered = interleave(cases)
    assert sorted(c.full_id for c in ordered) == sorted(c.full_id for c in cases)
    combos = {(c.engine, c.reference, c.model) for c in cases}
    head = ordered[: len(combos)]
    assert {(c.engine, c.reference, c.model) for c in head} == combos
    # Deeper: the next cases vary the strategy before repeating one.
    first = ordered[0]
    same = [c for c in ordered if (c.engine, c.reference, c.model) == (first.engine, first.reference, first.model)]
    strategies = {c.sharding_strategy for c in cases if c.engine == first.engine}
    assert {c.sharding_strategy for c in same[: len(strategies)]} == strategies
    # In generator order, the first as many cases cover one engine only.
    assert len({c.engine for c in cases[: len(combos)]}) == 1
    assert interleave([]) == []


def test_the_eta_is_for_what_the_budget_will_run() -> None:
    assert expected_total(100, 0, 0.0, 10.0) == 100  # nothing measured yet
    assert expected_total(100, 10, 10.0, None) == 100  # no budget
    assert expected_total(100, 10, 10.0, 20.0) == 30  # 1 case/s, 20 s left
    assert expected_total(100, 10, 10.0, 1000.0) == 100
    assert expected_total(100, 10, 10.0, -5.0) == 10  # budget spent: what is done


def test_without_a_bar_a_status_line_comes_every_minute_and_a_budget_keeps_the_total(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import harness.run.runner as runner

    clock = [1000.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: clock[0])
    progress = runner.Progress(100, enabled=False, deadline=1000.0 + 120)
    verdicts = ["pass"] * 9 + ["fail"]
    for n, verdict in enumerate(verdicts * 3):
        clock[0] += 3.0  # a case every 3 s: 20 a minute
        progress.update(CaseRecord(CaseConfig().to_dict(), CaseConfig().case_id, verdict, reason="x"), f"c{n}")  # type: ignore[arg-type]
    lines = [line for line in capsys.readouterr().err.splitlines() if "cases (" in line]
    assert len(lines) == 1, lines  # 90 s: one minute passed once
    assert lines[0].startswith("20/40 (budget; 100 selected) cases (pass 18, fail 2); 0.33 cases/s; ETA 60 s"), lines
    assert progress.bar.total == 100, "the total stays the cases to run"
    progress.close()
    quiet = runner.Progress(10, enabled=True)
    assert quiet.log_every_s is None  # the bar shows it
    quiet.close()


def test_the_eta_never_runs_past_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    import harness.run.runner as runner
    from harness.cli.fuzz import FUZZ_SHARE, cases_deadline, report_reserve

    clock = [1000.0]
    monkeypatch.setattr(runner.time, "monotonic", lambda: clock[0])
    record = CaseRecord(CaseConfig().to_dict(), CaseConfig().case_id, "pass", reason="x")  # type: ignore[arg-type]
    progress = runner.Progress(100, enabled=True, deadline=1000.0 + 150)
    progress.bar.fp = io.StringIO()
    for n in range(3):
        clock[0] += 60.0  # slow cases: at this rate 97 more would take 97 min
        progress.update(record, f"c{n}")
    assert progress.eta_s(clock[0]) == 0.0, "the budget is spent: nothing runs after it"
    assert "ETA 0 s" in progress.status_line(clock[0]) and "ETA=0 s" in str(progress.bar)
    assert "<" not in str(progress.bar), "no tqdm remaining time over every case to run"
    clock[0] = 1000.0 + 130
    assert progress.eta_s(clock[0]) <= 20.0  # at most the 20 s left
    progress.close()
    free = runner.Progress(10, enabled=False)
    clock[0] += 10.0
    free.update(record, "c")
    assert free.eta_s(clock[0]) == 90.0, "without a budget: the rate so far"
    # A fuzz campaign after the cases keeps its share of the budget.
    assert cases_deadline(0.0, 150.0) == 150.0 - report_reserve(150.0)
    assert cases_deadline(0.0, 150.0, fuzz_after=True) == pytest.approx((150.0 - report_reserve(150.0)) * (1 - FUZZ_SHARE))
    assert cases_deadline(0.0, None, fuzz_after=True) is None


def test_stress_is_unsupported_on_cpu_with_the_reason() -> None:
    assert unsupported_reason("none", "cpu") is None
    assert unsupported_reason("delay", "cuda") is None
    reason = unsupported_reason("delay", "cpu")
    assert reason is not None and "stress='delay'" in reason and "CUDA" in reason
    assert CaseConfig(stress="delay").case_id.endswith("-stress_delay")
    assert "stress" not in CaseConfig().case_id
    with pytest.raises(ValueError, match="stress"):
        CaseConfig(stress="sometimes")  # type: ignore[arg-type]


def test_stress_delays_fire_at_every_point_and_are_removed() -> None:
    calls: list[float] = []
    stress = Stress(torch.device("cpu"), ms=7.0, sleep=lambda ms, device: calls.append(ms))
    model = build_model("nested")
    stress.watch_model(model)
    stress.watch_parameters(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stress.watch_optimizer(optimizer)
    inputs = model.get_input(seed=0, step=0, rank=0)
    with CommTrace(around=stress.on_collective) as trace:
        trace.phase = "backward"
        model.run_backward(model.get_loss(inputs, model(*inputs)))
        for kind_call in ("reduce_scatter", "all_reduce"):
            stress.on_collective("before", kind_call, "backward")
            stress.on_collective("after", kind_call, "backward")
        stress.on_collective("before", "all_gather", "forward")  # not a reduction: no delay
    optimizer.step()
    with stress.around("around_summon"):
        pass
    units = len(model.wrap_units()) + 1
    n_params = sum(1 for p in model.parameters() if p.requires_grad)
    assert stress.counts["before_forward"] == stress.counts["before_free"] == units
    assert stress.counts["before_backward"] >= 1 and stress.counts["after_grad"] == n_params
    assert stress.counts["before_reduce"] == stress.counts["before_offload_copy"] == 2
    assert stress.counts["before_step"] == 1 and stress.counts["around_summon"] == 2
    assert set(calls) == {7.0} and len(calls) == sum(stress.counts.values())
    stress.remove()
    fired = sum(stress.counts.values())
    model(*inputs)
    optimizer.step()
    assert sum(stress.counts.values()) == fired


def test_stress_skips_parameters_that_refuse_the_hook() -> None:
    stress = Stress(torch.device("cpu"), sleep=lambda ms, device: None)
    leaf = nn.Parameter(torch.ones(2))
    stress.watch_parameters([leaf, leaf * 2, nn.Parameter(torch.ones(1), requires_grad=False)])
    (leaf * 3).sum().backward()
    assert stress.counts["after_grad"] == 1


def test_stress_wraps_no_sync_and_restores_it() -> None:
    entered: list[str] = []

    class WithNoSync(nn.Linear):
        @contextlib.contextmanager
        def no_sync(self):
            entered.append("in")
            yield "value"

    module = WithNoSync(2, 2)
    stress = Stress(torch.device("cpu"), sleep=lambda ms, device: None)
    stress.watch_no_sync(module)
    stress.watch_no_sync(nn.Linear(2, 2))  # no no_sync: nothing to wrap
    with module.no_sync() as value:
        assert value == "value" and stress.counts["around_no_sync"] == 1
    assert stress.counts["around_no_sync"] == 2 and entered == ["in"]
    stress.remove()
    with module.no_sync():
        pass
    assert stress.counts["around_no_sync"] == 2 and entered == ["in", "in"]


def _values(cases: list, axes: list[str]) -> set:
    return {(a, getattr(c, a)) for c in cases for a in axes}


def test_a_limit_samples_every_value_of_every_axis_per_engine_then_pairs() -> None:
    import itertools

    from harness.selection.sampling import sample_axes

    cases = select_cases(Selection(matrix="full"), [2])
    axes = sample_axes(cases)
    assert {"backward_prefetch", "cpu_offload", "use_orig_params", "forward_prefetch", "precision"} <= set(axes)
    ordered = sample_order(cases)
    assert sorted(c.full_id for c in ordered) == sorted(c.full_id for c in cases)
    limited = select_cases(Selection(matrix="full", limit=60), [2])
    assert [c.full_id for c in limited] == [c.full_id for c in ordered[:60]]
    for engine in {c.engine for c in cases}:
        mine = [c for c in cases if c.engine == engine]
        head = [c for c in limited if c.engine == engine]
        # 20 cases of one engine show every value its cases take on every axis.
        assert _values(head, axes) == _values(mine, axes), engine
        # Deeper, each engine's prefix covers every pair its cases hold before any case repeats one.
        pairs = {p for c in mine for p in itertools.combinations([(a, getattr(c, a)) for a in axes], 2)}
        seen: set = set()
        own = [c for c in ordered if c.engine == engine]
        for n, case in enumerate(own):
            if seen == pairs:
                break
            seen |= set(itertools.combinations([(a, getattr(case, a)) for a in axes], 2))
        assert seen == pairs and n < len(own) // 4, (engine, n)
    # The generator's first 60 cases, by contrast, keep one engine, reference, model, strategy and precision.
    assert all(len({getattr(c, a) for c in cases[:60]}) == 1
               for a in ("engine", "reference", "model", "sharding_strategy", "precision"))


def test_the_sampled_axes_are_the_matrix_table(monkeypatch: pytest.MonkeyPatch) -> None:
    import harness.selection.matrix
    from harness.selection.sampling import sample_axes

    cases = select_cases(Selection(matrix="full", engines=["builtin"]), [2])
    assert "init_mode" in sample_axes(cases)
    monkeypatch.setattr(harness.selection.matrix, "AXES", {k: v for k, v in harness.selection.matrix.AXES.items() if k != "init_mode"})
    assert "init_mode" not in sample_axes(cases)


def test_fsdp2_offload_clipping_is_unsupported_on_nccl_only_groups() -> None:
    """Seen on 4 GPUs: torch FSDP2 clips offloaded gradients with a CPU all-reduce that NCCL refuses. The
    same case runs on gloo (CPU ranks, ranks sharing a GPU), where the CPU collective is taken."""
    from harness.engines.registry import resolve
    from harness.ranks.rank import RankContext

    adapter = resolve("torch-fsdp2")
    case = CaseConfig(engine="torch-fsdp2", cpu_offload=True, use_orig_params=True, clip_grad="norm",
                      backward_prefetch="pre")
    model = build_model(case.model, seed=case.seed, rank=0, world_size=case.world_size)

    def reason(backend: str, case: CaseConfig = case) -> str | None:
        return adapter.unsupported_reason(case, model, RankContext(0, 2, 0, 2, backend, torch.device("cpu")))

    assert "NCCL-only process group refuses" in str(reason("nccl"))
    assert reason("gloo") is None
    assert reason("nccl", case.replace(clip_grad="none")) is None
