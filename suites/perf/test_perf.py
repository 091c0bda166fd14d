"""``python -m harness perf``: the model's size arithmetic, the table's ratios, and a tiny CPU run that
prints our engine's step time over torch FSDP1's from the same run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli.perf import (
    CPU_MODEL,
    GPT,
    GPTConfig,
    PerfConfig,
    PerfRow,
    add_ratios,
    count_params,
    plan_runs,
    row_from_values,
    tflops_per_gpu,
)
from harness.pytest_plugin import needs_gpus

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
    assert count_params(cfg) == sum(p.numel() for p in GPT(cfg).parameters())


def test_the_default_model_is_the_anchors() -> None:
    assert round(count_params(GPTConfig()) / 1e6, 1) == 936.5
    # The anchors' FSDP1 line: 201.2 ms per step of 8 x 2048 tokens is 458 TFLOP/s per GPU.
    assert round(tflops_per_gpu(count_params(GPTConfig()), 8 * 2048, 0.2012)) == 458


def test_config_names_bad_choices() -> None:
    with pytest.raises(ValueError, match="engines"):
        PerfConfig(model=CPU_MODEL, engines=["megatron"])
    with pytest.raises(ValueError, match="strategies"):
        PerfConfig(model=CPU_MODEL, strategies=[])
    with pytest.raises(ValueError, match="heads"):
        GPTConfig(d_model=10, heads=3)


def test_runs_are_planned_per_strategy_with_ddp_once() -> None:
    assert plan_runs(["builtin", "ddp", "torch-fsdp"], ["full_shard", "no_shard"]) == [
        ("builtin", "full_shard"), ("torch-fsdp", "full_shard"), ("builtin", "no_shard"), ("torch-fsdp", "no_shard"),
        ("ddp", None),
    ]


def _values(step_s: list[list[float]], loss: float) -> list[dict]:
    return [{"step_s": s, "losses": [9.0, loss + r * 1e-4], "peak_bytes": None} for r, s in enumerate(step_s)]


def test_rows_take_the_slowest_rank_per_step_and_ratios_match_strategies() -> None:
    params, tokens = 1000, 10
    ours = row_from_values("builtin", "full_shard", _values([[0.1, 0.3, 0.2], [0.2, 0.1, 0.2]], 5.0), params, tokens)
    assert ours.steps_ms == pytest.approx([200, 300, 200]) and ours.step_ms == pytest.approx(200)
    assert ours.final_loss == pytest.approx(5.00005) and ours.peak_gib is None
    assert ours.tflops == pytest.approx(6 * params * tokens / 0.2 / 1e12)
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


def test_perf_on_cpu_prints_the_ratio_against_torch_fsdp1(tmp_path: Path) -> None:
    out = tmp_path / "perf.json"
    done = _perf("--engines", "builtin,torch-fsdp", "--steps", "3", "--warmup", "1", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    match = re.search(r"ratio builtin / torch-fsdp step time \(full_shard\): (\d+\.\d+) \(", done.stdout)
    assert match and float(match[1]) > 0, done.stdout
    assert "2 ranks, gloo" in done.stdout
    data = json.loads(out.read_text())
    rows = {r["engine"]: r for r in data["rows"]}
    assert set(rows) == {"builtin", "torch-fsdp"} and all(r["status"] == "ok" for r in rows.values())
    assert len(rows["builtin"]["steps_ms"]) == 3 and rows["builtin"]["ratio"] == pytest.approx(float(match[1]), abs=1e-3)
    assert rows["builtin"]["loss_matches"] is True
    assert data["params"] == count_params(CPU_MODEL)


@pytest.mark.gpu
@needs_gpus(2)
def test_perf_on_two_gpus_small_model() -> None:
    done = _perf("--engines", "builtin,torch-fsdp,torch-fsdp2,ddp", "--layers", "4", "--d-model", "512", "--heads", "8",
                 "--seq", "512", "--steps", "5", gpus=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 ranks, nccl" in done.stdout and "ratio builtin / torch-fsdp step time (full_shard)" in done.stdout
