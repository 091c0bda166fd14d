"""``python -m harness perf --host-cost``: the engines' host time per step in one process over torch's fake
process group. What it plans and refuses, losses left unchecked, the phase clock on process time, the fake
world left as it was found (the command runs in-process here), and one small end-to-end run of the CLI."""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.cli import main
from harness.perf.benchmark import MODEL_ALONE, GPTConfig, PerfJob, RankTiming, perf_job
from harness.perf.host_cost import FakeWorld
from harness.perf.perf_rows import PerfRow, add_ratios
from harness.perf.perf_run import PerfConfig, plan_runs
from harness.perf.phases import StepClock
from harness.ranks.pool import PoolStartError

TINY = GPTConfig(vocab=32, d_model=8, layers=2, heads=2, seq=4, batch=1)


def test_the_model_alone_runs_once_per_repetition_last_without_a_strategy() -> None:
    engines = ["builtin", MODEL_ALONE, "torch-fsdp"]
    assert plan_runs(engines, ["full_shard", "shard_grad_op"], repetition=1) == [
        ("torch-fsdp", "full_shard"), ("builtin", "full_shard"), ("torch-fsdp", "shard_grad_op"),
        ("builtin", "shard_grad_op"), (MODEL_ALONE, None)]


@pytest.mark.parametrize(("kwargs", "names"), [
    ({"host_cost": True, "engines": ["builtin", "ddp"]}, "ddp"),
    ({"host_cost": True, "zoo_models": ["gpt"]}, "--small"),
    ({"host_cost": True, "profile_dir": "/tmp/traces"}, "--profile"),
    ({"engines": ["builtin", MODEL_ALONE]}, "--host-cost"),
])
def test_what_the_host_cost_mode_cannot_measure_is_refused_naming_the_option(kwargs: dict, names: str) -> None:
    with pytest.raises(ValueError, match=re.escape(names)):
        PerfConfig(model=TINY, **kwargs)


def test_without_a_loss_tolerance_losses_are_not_compared() -> None:
    rows = [PerfRow("builtin", "full_shard", "ok", step_ms=2.0, final_loss=1.0),
            PerfRow("torch-fsdp", "full_shard", "ok", step_ms=4.0, final_loss=7.0)]
    add_ratios(rows, None)
    assert rows[0].ratio == 0.5 and rows[0].loss_matches is None
    add_ratios(rows, 1e-3)
    assert rows[0].loss_matches is False


def test_a_cpu_phase_clock_reads_the_clock_it_is_given() -> None:
    ticks = iter([1.0, 3.0, 6.0, 10.0])
    clock = StepClock(torch.device("cpu"), host_clock=lambda: next(ticks))
    clock.start()
    for _ in range(3):
        clock.mark()
    assert clock.read() == [2.0, 3.0, 4.0]


def test_the_fake_world_runs_jobs_here_and_leaves_the_process_as_it_found_it() -> None:
    threads, state = torch.get_num_threads(), torch.random.get_rng_state()
    assert not dist.is_initialized()
    with FakeWorld(2) as world:
        assert dist.get_backend() == "fake" and dist.get_world_size() == 2 and torch.get_num_threads() == 1
        # Over a process group already there it refuses, rather than replace or tear down someone else's.
        with pytest.raises(PoolStartError, match="already has a default process group"):
            FakeWorld(2).__enter__()
        answer = world.run(perf_job, PerfJob("builtin", "full_shard", TINY, "bf16", 1, 2, 0, 1e-3, host_cost=True))
        assert answer.status == "ok" and isinstance(answer.values[0], RankTiming)
        assert len(answer.values[0].step_s) == 2 and min(answer.values[0].step_s) > 0 and gc.isenabled()
        failed = world.run(lambda ctx, job: 1 / 0, None)
        assert failed.status == "error" and failed.reason.startswith("ZeroDivisionError: division by zero")
    assert not dist.is_initialized() and torch.get_num_threads() == threads
    assert torch.equal(torch.random.get_rng_state(), state)


def test_host_cost_cli_prints_host_ms_rows_and_the_ratio_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "host.json"
    code = main(["perf", "--host-cost", "--layers", "2", "--steps", "3", "--warmup", "1", "--json", str(out)])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert "one process, rank 0 of a fake process group of 2 ranks" in stdout and "process time" in stdout
    assert re.search(r"ratio builtin / torch-fsdp step time \(full_shard\): \d+\.\d+ \(", stdout), stdout
    assert re.search(r"ratio builtin / faster torch \(torch-fsdp2?\) step time \(full_shard\): \d+\.\d+", stdout), stdout
    data = json.loads(out.read_text())
    rows = {r["engine"]: r for r in data["rows"]}
    assert list(rows) == ["builtin", "torch-fsdp", "torch-fsdp2", MODEL_ALONE]
    assert all(r["status"] == "ok" and r["step_ms"] > 0 and r["loss_matches"] is None for r in rows.values()), rows
    # Process time over no-op collectives is no training rate: no throughput columns.
    assert rows["builtin"]["tokens_per_s"] is None and rows[MODEL_ALONE]["strategy"] is None
    assert data["config"]["host_cost"] is True and data["phase_clock"].startswith("process time")
    # Called in-process: the fake process group is gone afterwards.
    assert not dist.is_initialized()
