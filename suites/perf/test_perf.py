"""``python -m harness perf``: the model's size arithmetic, the table's ratios and spread, what is not
applicable and why, and tiny CPU runs (the GPT with traces, and the host-bound zoo mode) that print our
engine's step time over torch FSDP1's from the same run."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness.cases.models import MODELS, BenchmarkGPT, GPTBlock, build_model, zoo_names
from harness.perf.benchmark import (
    CPU_MODEL,
    MEMORY_SUFFIX,
    SIZES,
    PROFILE_STEPS,
    GPTConfig,
    PerfJob,
    RankTiming,
    Unsupported,
    count_params,
    perf_job,
    trace_name,
    unsupported_reason,
    ZooJob,
    zoo_job,
)
from harness.perf.phases import STEP_PHASES
from harness.perf.profile_summary import load_trace, step_marks
from harness.perf.perf_rows import PerfRow, add_ratios, spread, tflops_per_gpu
from harness.perf.perf_run import PerfConfig, plan_runs, row_from_values
from harness.pytest_plugin import needs_gpus
from harness.ranks.rank import RankContext

#: why the GPU benchmarks need one GPU per rank: they time NCCL and its overlap with compute; ranks sharing
#: a GPU run gloo, whose host staging is no measure of either.
NCCL_TIMING = "NCCL with one GPU per rank: the benchmark times NCCL's overlap with compute"

ROOT = Path(__file__).resolve().parents[2]


def _perf(*args: str, gpus: bool = False, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTEST_XDIST_WORKER", None)
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run([sys.executable, "-m", "harness", "perf", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("cfg", [CPU_MODEL, GPTConfig(vocab=50, d_model=24, layers=3, heads=3, seq=4, batch=1)])
def test_count_params_is_the_built_models(cfg: GPTConfig) -> None:
    assert count_params(cfg) == sum(p.numel() for p in BenchmarkGPT(cfg).parameters())


def test_the_default_model_is_the_anchors() -> None:
    assert SIZES["1b"] == GPTConfig() and round(count_params(GPTConfig()) / 1e6, 1) == 936.5
    # The anchors' FSDP1 line: 201.2 ms per step of 8 x 2048 tokens is 458 TFLOP/s per GPU.
    assert round(tflops_per_gpu(count_params(GPTConfig()), 8 * 2048, 0.2012)) == 458


def test_the_second_size_is_about_three_billion() -> None:
    assert 2.8e9 < count_params(SIZES["3b"]) < 3.2e9


def test_the_benchmark_gpt_is_built_of_the_zoos_block_without_linear_biases() -> None:
    model = BenchmarkGPT(CPU_MODEL)
    assert all(type(b) is GPTBlock for b in model.blocks)
    assert not any(name.endswith("bias") for name, _ in model.blocks.named_parameters() if ".ln" not in f".{name}")
    assert GPTBlock(8, 2).qkv.bias is not None  # the zoo's tiny GPT keeps its biases


def test_what_is_not_measured_says_why() -> None:
    assert unsupported_reason("builtin", "full_shard", 2) is None
    assert "fully_shard always shards" in str(unsupported_reason("torch-fsdp2", "no_shard", 2))
    hybrid = unsupported_reason("builtin", "hybrid_shard", 2)
    assert hybrid is not None and "at least 4 ranks" in hybrid and "--world-size 4" in hybrid
    assert unsupported_reason("torch-fsdp", "hybrid_shard", 4) is None
    assert trace_name("builtin", "full_shard", 1) == "gpt-builtin-full_shard-rank1.json"
    assert trace_name("ddp", None, 0, "transformer", "prof") == "transformer-ddp-ddp-rank0.prof"


def test_spread_is_min_deciles_max() -> None:
    assert spread([5.0]) == (5.0, 5.0, 5.0, 5.0)
    lo, p10, p90, hi = spread([float(x) for x in range(1, 12)])  # 1..11
    assert (lo, hi) == (1.0, 11.0) and p10 == pytest.approx(2.0) and p90 == pytest.approx(10.0)


def test_config_names_bad_choices() -> None:
    with pytest.raises(ValueError, match="engines"):
        PerfConfig(model=CPU_MODEL, engines=["megatron"])
    with pytest.raises(ValueError, match="strategies"):
        PerfConfig(model=CPU_MODEL, strategies=[])
    with pytest.raises(ValueError, match="heads"):
        GPTConfig(d_model=10, heads=3)
    with pytest.raises(ValueError, match="zoo_models"):
        PerfConfig(model=CPU_MODEL, zoo_models=["resnet"])


def test_runs_are_planned_per_strategy_with_ddp_once() -> None:
    assert plan_runs(["builtin", "ddp", "torch-fsdp"], ["full_shard", "no_shard"]) == [
        ("builtin", "full_shard"), ("torch-fsdp", "full_shard"), ("builtin", "no_shard"), ("torch-fsdp", "no_shard"),
        ("ddp", None),
    ]


def _values(step_s: list[list[float]], loss: float) -> list[RankTiming]:
    return [RankTiming(step_s=s, losses=[9.0, loss + r * 1e-4], device="CPU") for r, s in enumerate(step_s)]


def test_rows_take_the_slowest_rank_per_step_and_ratios_match_strategies() -> None:
    params, tokens = 1000, 10
    ours = row_from_values("builtin", "full_shard", _values([[0.1, 0.3, 0.2], [0.2, 0.1, 0.2]], 5.0), params, tokens)
    assert ours.steps_ms == pytest.approx([200, 300, 200]) and ours.step_ms == pytest.approx(200)
    assert ours.final_loss == pytest.approx(5.00005) and ours.peak_gib is None
    assert ours.tflops == pytest.approx(6 * params * tokens / 0.2 / 1e12)
    assert ours.tokens_per_s == pytest.approx(2 * tokens / 0.2)  # both ranks' tokens
    assert (ours.min_ms, ours.max_ms) == (pytest.approx(200), pytest.approx(300)) and ours.reserved_gib is None
    gpu = row_from_values("builtin", "full_shard", [dataclasses.replace(v, peak_bytes=2 * 1024**3, reserved_bytes=(3 + r) * 1024**3)
                                                    for r, v in enumerate(_values([[0.1]] * 2, 5.0))], params, tokens)
    assert gpu.peak_gib == pytest.approx(2) and gpu.reserved_gib == pytest.approx(4)
    torch_fsdp = row_from_values("torch-fsdp", "full_shard", _values([[0.1, 0.1, 0.1]] * 2, 5.0), params, tokens)
    off = row_from_values("builtin", "no_shard", _values([[0.1]] * 2, 6.0), params, tokens)
    ddp = row_from_values("ddp", None, _values([[0.05]] * 2, 5.0), params, tokens)
    failed = PerfRow("torch-fsdp", "no_shard", "timeout", "no answer")
    rows = [ours, torch_fsdp, off, ddp, failed]
    add_ratios(rows, loss_rtol=1e-3)
    assert ours.ratio == pytest.approx(2.0) and ours.loss_matches
    assert torch_fsdp.ratio == pytest.approx(1.0)
    assert ddp.ratio == pytest.approx(0.5) and ddp.loss_matches  # DDP against FSDP1 FULL_SHARD
    assert off.ratio is None and off.loss_matches is None  # its baseline timed out
    add_ratios([ours, row_from_values("torch-fsdp", "full_shard", _values([[0.1]] * 2, 5.1), params, tokens)], 1e-3)
    assert ours.loss_matches is False


def test_zoo_timings_give_cpu_and_setup_columns_and_no_throughput() -> None:
    ranks = [RankTiming(step_s=[0.1, 0.2], losses=[3.0, 2.0], device="CPU", cpu_s=[0.05 + r, 0.01], build_s=0.5,
                        first_step_s=0.25 * (r + 1), units=3) for r in range(2)]
    row = row_from_values("builtin", "full_shard", ranks, None, None, model="always_wrap")
    assert row.cpu_ms == pytest.approx(1000 * (1.05 + 0.01) / 2) and row.setup_ms == pytest.approx(1000)
    assert row.tokens_per_s is None and row.tflops is None and row.label == "always_wrap: builtin full_shard"
    assert ranks[0].setup_s == pytest.approx(0.75) and RankTiming([0.1], [1.0], "CPU").setup_s is None


def test_an_unsupported_answer_makes_an_unsupported_row_and_other_answers_are_refused() -> None:
    row = row_from_values("torch-fsdp2", "no_shard", [Unsupported("no NO_SHARD"), Unsupported("no NO_SHARD")], 1, 1)
    assert (row.status, row.reason, row.step_ms) == ("unsupported", "no NO_SHARD", None)
    with pytest.raises(TypeError, match="RankTiming or Unsupported"):
        row_from_values("builtin", "full_shard", [{"step_s": [0.1], "losses": [1.0]}], 1, 1)  # type: ignore[list-item]


def test_rank_jobs_answer_unsupported_records_before_touching_a_process_group() -> None:
    ctx = RankContext(0, 2, 0, 2, "gloo", torch.device("cpu"))
    gpt = perf_job(ctx, PerfJob("builtin", "hybrid_shard", CPU_MODEL, "fp32", 0, 1, 0, 1e-3))
    zoo = zoo_job(ctx, ZooJob("torch-fsdp2", "nested", "no_shard", "fp32", 0, 1))
    assert isinstance(gpt, Unsupported) and "at least 4 ranks" in gpt.reason
    assert isinstance(zoo, Unsupported) and "fully_shard always shards" in zoo.reason


def test_the_benchmark_gpt_is_a_zoo_entry_of_its_own() -> None:
    model = build_model("perf_gpt")
    assert isinstance(model, BenchmarkGPT) and model.cfg == CPU_MODEL and "perf_gpt" not in zoo_names()
    assert sum(p.numel() for p in model.parameters()) == count_params(CPU_MODEL)
    assert model.wrap_units() == list(model.blocks) and MODELS["perf_gpt"].listed is False
    inputs = model.get_input(seed=0, step=0, rank=0)
    assert [tuple(t.shape) for t in inputs] == [(CPU_MODEL.batch, CPU_MODEL.seq)] * 2
    assert torch.equal(inputs[0][:, 1:], inputs[1][:, :-1])  # targets are the next tokens
    assert model.get_loss(inputs, model(*inputs)).dtype.is_floating_point


def test_perf_on_cpu_prints_the_ratio_against_torch_fsdp1(tmp_path: Path) -> None:
    out = tmp_path / "perf.json"
    done = _perf("--engines", "builtin,torch-fsdp", "--strategies", "full_shard,hybrid_shard", "--steps", "3",
                 "--warmup", "1", "--json", str(out), "--profile", str(tmp_path / "traces"))
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.search(r"ratio builtin / torch-fsdp step time \(full_shard\): (\d+\.\d+) \(", done.stdout)
    assert match and float(match[1]) > 0, done.stdout
    assert "2 ranks, gloo" in done.stdout
    data = json.loads(out.read_text())
    hybrid = [r for r in data["rows"] if r["strategy"] == "hybrid_shard"]
    assert [r["status"] for r in hybrid] == ["unsupported"] * 2 and "at least 4 ranks" in hybrid[0]["reason"]
    rows = {r["engine"]: r for r in data["rows"] if r["strategy"] == "full_shard"}
    assert set(rows) == {"builtin", "torch-fsdp"} and all(r["status"] == "ok" for r in rows.values())
    assert rows["builtin"]["p10_ms"] <= rows["builtin"]["step_ms"] <= rows["builtin"]["p90_ms"]
    assert rows["builtin"]["tokens_per_s"] > 0
    # One Chrome trace per engine, strategy and rank, of steps after the timed ones; beside each, on CPU ranks,
    # the peak of live tensors of one more step.
    names = sorted(p.name for p in (tmp_path / "traces").iterdir())
    traces = [n for n in names if not n.endswith(MEMORY_SUFFIX)]
    assert traces == [trace_name(e, "full_shard", r) for e in ("builtin", "torch-fsdp") for r in (0, 1)]
    assert [n for n in names if n.endswith(MEMORY_SUFFIX)] == [t.removesuffix(".json") + MEMORY_SUFFIX for t in traces]
    peak = json.loads((tmp_path / "traces" / (traces[0].removesuffix(".json") + MEMORY_SUFFIX)).read_text())
    assert peak["peak_bytes"] >= sum(nbytes for _, nbytes, _ in peak["largest"]) > 0
    assert peak["peak_phase"] in STEP_PHASES and peak["before_bytes"] > 0, peak
    assert len(re.findall(r"full_shard-rank\d: peak of live tensors \d+\.\d+ MiB in (forward|backward|optimizer)",
                          done.stdout)) == 4, done.stdout
    # The profiled steps are marked one by one, as the timer sees them; on CPU ranks the summary is the host's.
    assert len(step_marks(load_trace(tmp_path / "traces" / traces[0]))) == PROFILE_STEPS
    assert len(re.findall(r"first collective issued \d+\.\d+ ms after the step's start", done.stdout)) == 4, done.stdout
    assert len(rows["builtin"]["steps_ms"]) == 3 and rows["builtin"]["ratio"] == pytest.approx(float(match[1]), abs=1e-3)
    assert rows["builtin"]["loss_matches"] is True
    assert data["params"] == count_params(CPU_MODEL)
    # Every timed step split into phases, on CPU ranks in host time: a table under the step times, and the JSON
    # per row and per step; a step's phases lie inside it, so they add up to no more than it.
    assert "phase ms (median over the timed steps, each step's slowest rank; host time" in done.stdout, done.stdout
    assert re.search(r"\| builtin full_shard +\| (\d+\.\d+ +\| ){5}", done.stdout), done.stdout
    assert data["phases"] == list(STEP_PHASES) and data["phase_clock"].startswith("host time")
    for row in rows.values():
        assert set(row["phase_ms"]) == set(STEP_PHASES) and all(v > 0 for v in row["phase_ms"].values()), row
        assert 0 < row["phase_sum_ms"] <= row["step_ms"] + 1e-3
        for i, step in enumerate(row["steps_ms"]):
            assert 0 < sum(row["steps_phase_ms"][p][i] for p in STEP_PHASES) <= step + 1e-3, row
    assert all(r["phase_ms"] is None for r in hybrid)


def test_small_mode_times_zoo_models_against_torch_fsdp1(tmp_path: Path) -> None:
    out = tmp_path / "zoo.json"
    done = _perf("--small", "--zoo-models", "always_wrap", "--steps", "3", "--warmup", "1", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "host-bound regime" in done.stdout
    match = re.search(r"ratio builtin / torch-fsdp step time \(always_wrap, full_shard\): (\d+\.\d+)", done.stdout)
    assert match and float(match[1]) > 0, done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["model"], r["engine"], r["status"]) for r in rows] == [("always_wrap", "builtin", "ok"), ("always_wrap", "torch-fsdp", "ok")]
    assert rows[0]["loss_matches"] is True and rows[0]["tokens_per_s"] is None and rows[0]["cpu_ms"] > 0 and rows[0]["setup_ms"] > 0
    # The zoo's steps are split by the same clock as the GPT's.
    assert all(set(r["phase_ms"]) == set(STEP_PHASES) and 0 < r["phase_sum_ms"] <= r["step_ms"] + 1e-3 for r in rows), rows
    assert "phase ms (median over the timed steps" in done.stdout


def test_perf_with_two_repetitions_prints_paired_ratios_and_keeps_every_repetition(tmp_path: Path) -> None:
    out = tmp_path / "perf.json"
    done = _perf("--engines", "builtin,torch-fsdp,torch-fsdp2", "--repeats", "2", "--steps", "2", "--warmup", "1",
                 "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    number, span = r"(\d+\.\d+)", r"per-rep ratios (\d+\.\d+)\.\.(\d+\.\d+)"
    fsdp1 = re.search(rf"ratio builtin / torch-fsdp step time \(full_shard\): {number} \(median of 2; {span};", done.stdout)
    faster = re.search(rf"ratio builtin / faster torch \((torch-fsdp2?)\) step time \(full_shard\): {number} "
                       rf"\(median of 2; {span};", done.stdout)
    assert fsdp1 and faster, done.stdout
    assert "2 interleaved repetitions" in done.stdout and "3 runs x 2 repetitions" in done.stdout
    data = json.loads(out.read_text())
    assert data["repeats"] == 2 and [r["repetition"] for r in data["repetitions"]] == [1, 2]
    assert [r["order"] for r in data["repetitions"]] == [
        ["builtin full_shard", "torch-fsdp full_shard", "torch-fsdp2 full_shard"],
        ["torch-fsdp full_shard", "torch-fsdp2 full_shard", "builtin full_shard"]]
    summary = {r["engine"]: r for r in data["rows"]}
    per_rep = [{r["engine"]: r for r in rep["rows"]} for rep in data["repetitions"]]
    ours = summary["builtin"]
    assert ours["repeats"] == 2 and ours["step_ms"] == pytest.approx(statistics.median(p["builtin"]["step_ms"] for p in per_rep))
    paired = sorted(p["builtin"]["step_ms"] / p["torch-fsdp"]["step_ms"] for p in per_rep)
    assert ours["ratio"] == pytest.approx(float(fsdp1[1]), abs=1e-3) == pytest.approx(statistics.median(paired), abs=1e-3)
    assert (ours["ratio_min"], ours["ratio_max"]) == (pytest.approx(paired[0]), pytest.approx(paired[1]))
    assert ours["faster_torch"] == faster[1] and ours["faster_ratio"] == pytest.approx(float(faster[2]), abs=1e-3)
    assert ours["loss_matches"] is True and ours["tflops"] > 0 and len(ours["steps_ms"]) == 4
    # The phases fold over the repetitions as the step time does: medians, and every step kept.
    assert len(ours["steps_phase_ms"]["forward"]) == 4 and 0 < ours["phase_sum_ms"] <= ours["step_ms"] + 1e-3


@pytest.mark.gpu
@needs_gpus(2, NCCL_TIMING)
def test_perf_on_two_gpus_small_model() -> None:
    done = _perf("--engines", "builtin,torch-fsdp,torch-fsdp2,ddp", "--layers", "4", "--d-model", "512", "--heads", "8",
                 "--seq", "512", "--steps", "5", gpus=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 ranks, nccl" in done.stdout and "ratio builtin / torch-fsdp step time (full_shard)" in done.stdout


@pytest.mark.gpu
@needs_gpus(2, NCCL_TIMING)
def test_perf_on_two_gpus_reports_memory_and_traces(tmp_path: Path) -> None:
    out = tmp_path / "perf.json"
    done = _perf("--engines", "builtin,torch-fsdp", "--strategies", "full_shard,no_shard,hybrid_shard", "--layers", "2",
                 "--d-model", "512", "--heads", "8", "--seq", "512", "--steps", "3", "--json", str(out),
                 "--profile", str(tmp_path / "traces"), gpus=True)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = [r for r in json.loads(out.read_text())["rows"] if r["status"] == "ok"]
    assert {r["strategy"] for r in rows} == {"full_shard", "no_shard"}
    assert all(r["reserved_gib"] >= r["peak_gib"] > 0 for r in rows)
    # On GPUs the phases are GPU time between CUDA events, read after each step's closing synchronize.
    assert "GPU time between CUDA events" in done.stdout and all(min(r["phase_ms"].values()) > 0 for r in rows)
    assert len(list((tmp_path / "traces").iterdir())) == 2 * 2 * 2
    # Each trace's steps split as the timer saw them (host lead-in, GPU window, host after).
    assert len(re.findall(r"step \d+\.\d+ ms = host lead-in \d+\.\d+ \+ GPU window", done.stdout)) == 2 * 2 * 2, done.stdout


def test_a_log_of_perf_runs_starts_with_a_header_before_any_run_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import harness.ranks.pool as pool
    from harness.cli import main

    class NoRanks:
        """A pool whose every run errs at once: what is tested is the order of the lines."""

        def __init__(self, config: object) -> None:
            pass

        def __enter__(self) -> "NoRanks":
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def run(self, fn: object, job: object) -> pool.PoolOutcome:
            return pool.PoolOutcome("error", [None, None], reason="no ranks here")

    monkeypatch.setattr(pool, "RankPool", NoRanks)
    assert main(["perf", "--engines", "builtin,torch-fsdp", "--steps", "2", "--warmup", "1"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("perf: 2 run(s) of 2 timed steps on 2 ranks") and err[0].endswith("as it ends:")
    assert [line.strip() for line in err[1:3]] == ["builtin full_shard: error", "torch-fsdp full_shard: error"]
