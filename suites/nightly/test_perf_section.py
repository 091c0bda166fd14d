"""The nightly's performance section: its shape in ``nightly.json`` (what the history charts), the
comparison of ratios between nights, and the smoke check on CPU that is never compared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.perf.benchmark import CPU_MODEL
from harness.perf.perf_rows import PerfRow
from harness.perf.perf_section import (
    build_section,
    compare_sections,
    previous_section,
    section_config,
    summary_lines,
)
from reports.history import flatten_numbers


def _row(engine: str, strategy: str, ratio: float | None, step_ms: float = 100.0) -> PerfRow:
    return PerfRow(engine, strategy, "ok", step_ms=step_ms, p10_ms=step_ms - 1, p90_ms=step_ms + 1, peak_gib=28.5,
                   reserved_gib=30.0, tokens_per_s=1e5, ratio=ratio)


def _gpu_section(ours: float, device: str = "NVIDIA H200") -> dict:
    config = section_config(n_gpus=2)
    rows = [_row("builtin", "full_shard", ours), _row("torch-fsdp", "full_shard", 1.0),
            _row("builtin", "shard_grad_op", 1.0), PerfRow("torch-fsdp", "shard_grad_op", "timeout", "no answer")]
    return build_section(rows, config, device)


def test_the_section_runs_the_anchor_model_on_gpus_and_the_tiny_one_on_cpu() -> None:
    gpu, cpu = section_config(n_gpus=8), section_config(n_gpus=0)
    assert gpu.backend == "nccl" and gpu.model.d_model == 2048 and gpu.strategies == ["full_shard", "shard_grad_op"]
    assert cpu.backend == "gloo" and cpu.model == CPU_MODEL


def test_a_gpu_section_keeps_numbers_per_engine_and_strategy_for_the_history() -> None:
    section = _gpu_section(1.07)
    assert section["kind"] == "gpu" and section["not_ok"] == {"torch-fsdp/shard_grad_op": "timeout: no answer"}
    flat = flatten_numbers(section)
    assert flat["rows.builtin/full_shard.ratio"] == pytest.approx(1.07)
    assert flat["rows.torch-fsdp/full_shard.peak_gib"] == pytest.approx(28.5)
    assert "rows.builtin/shard_grad_op.step_ms" in flat


def test_a_ratio_worse_by_more_than_five_percent_is_a_regression() -> None:
    previous = _gpu_section(1.00)
    result = compare_sections(previous, _gpu_section(1.06))
    assert result.compared and [c.key for c in result.regressions] == ["builtin/full_shard"]
    assert result.regressions[0].change == pytest.approx(0.06)
    within = compare_sections(previous, _gpu_section(1.04))
    assert within.compared and not within.regressions and "builtin/full_shard" in [c.key for c in within.unchanged]
    better = compare_sections(_gpu_section(1.07), _gpu_section(1.00))
    assert not better.regressions and [c.key for c in better.improvements] == ["builtin/full_shard"]
    assert json.loads(json.dumps(result.to_dict()))["regressions"][0]["change"] == pytest.approx(0.06)


def test_smoke_sections_other_devices_and_missing_sections_are_never_compared() -> None:
    smoke = build_section([_row("builtin", "full_shard", 9.0)], section_config(n_gpus=0), "CPU")
    assert smoke["kind"] == "smoke" and "rows" not in smoke and "smoke.builtin/full_shard.ratio" in flatten_numbers(smoke)
    for previous, current, why in ((smoke, smoke, "smoke"), (_gpu_section(1.0), smoke, "smoke"),
                                   (smoke, _gpu_section(2.0), "smoke"),
                                   (_gpu_section(1.0, "NVIDIA H100"), _gpu_section(2.0), "device"),
                                   (None, _gpu_section(2.0), "previous"), (_gpu_section(1.0), None, "tonight")):
        result = compare_sections(previous, current)
        assert not result.compared and not result.regressions and why in result.reason


def test_the_summary_labels_a_smoke_check_and_names_regressions() -> None:
    smoke = build_section([_row("builtin", "full_shard", 1.5)], section_config(n_gpus=0), "CPU")
    assert "smoke check" in summary_lines(smoke)[0]
    lines = summary_lines(_gpu_section(1.2), compare_sections(_gpu_section(1.0), _gpu_section(1.2)).to_dict())
    assert "smoke" not in lines[0] and "builtin/full_shard" in lines[1] and "1.200" in lines[1]
    assert lines[-1].startswith("perf diff: 1 ratio regression(s): builtin/full_shard 1.000 -> 1.200")
    assert summary_lines({"skipped": "--no-perf"}) == ["perf: skipped (--no-perf)"]


def test_the_previous_section_is_read_from_the_previous_nightly(tmp_path: Path) -> None:
    (tmp_path / "nightly.json").write_text(json.dumps({"perf": _gpu_section(1.0)}))
    assert previous_section(tmp_path)["kind"] == "gpu"
    assert previous_section(tmp_path / "results.jsonl")["kind"] == "gpu"  # the diff's baseline is a file in it
    assert previous_section(tmp_path / "elsewhere" / "x") is None and previous_section(None) is None
