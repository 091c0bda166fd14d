"""``python -m harness``: a smoke run on the pool and resuming it, the overhead benchmark, and the same
run under ``torchrun`` (the ranks are torchrun's, rank 0 records; ``--repeat`` and ``--resume`` there too)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli import main
from harness.collect.collector import read_records
from harness.pytest_plugin import needs_gpus
from harness.ranks.placement import n_gpus
from harness.run.stored_selection import read_selection

ROOT = Path(__file__).resolve().parents[2]
#: the warm-pool overhead target on CPU with two gloo ranks.
CPU_TARGET_MS = 100.0


#: the warm-pool overhead target on two GPUs with NCCL.
GPU_TARGET_MS = 50.0

#: the NCCL overhead target needs NCCL itself: one GPU per rank (ranks sharing a GPU run gloo).
needs_two_gpus = needs_gpus(2, "NCCL with one GPU per rank: the overhead target is NCCL's")


def _harness(
    *args: str, launcher: tuple[str, ...] = ("-m", "harness"), timeout: float = 240, gpus: bool = False
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTEST_XDIST_WORKER", None)  # the subprocess is not an xdist worker
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU tier, even on a GPU machine
    return subprocess.run(
        [sys.executable, *launcher, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _listed(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    assert main(["list", *args]) == 0
    return capsys.readouterr().out.split()


def test_list_names_the_selected_cases(capsys: pytest.CaptureFixture[str]) -> None:
    ids = _listed(capsys, "--matrix", "smoke", "--engines", "torch-fsdp", "--references", "ddp,local")
    assert ids and all(i.startswith("torch-fsdp:") for i in ids)
    assert {i.split(":")[1] for i in ids} == {"ddp", "local"}
    assert all(i.endswith("-steps2") for i in _listed(capsys, "--engines", "torch-fsdp2", "--steps", "2"))


def test_a_bad_selection_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["list", "--models", "resnet"])
    assert exit_info.value.code == 2 and "harness.cases.models.MODELS" in capsys.readouterr().err


def test_smoke_run_records_every_case_and_resumes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "smoke.jsonl"
    args = ("--matrix", "smoke", "--engines", "torch-fsdp,torch-fsdp2", "--out", str(out), "--no-progress")
    done = _harness("run", *args)
    assert done.returncode == 0, done.stdout + done.stderr
    records, bad = read_records(out)
    assert not bad
    # Listed as the run saw the machine (GPUs hidden): smoke judges its cases for the devices the ranks see.
    monkeypatch.setattr("harness.ranks.placement.n_gpus", lambda: 0)
    listed = _listed(capsys, "--matrix", "smoke", "--engines", "torch-fsdp,torch-fsdp2")
    # Pools side by side record in the order cases end: the same cases, in any order.
    assert sorted(f"{r.case['engine']}:{r.case['reference']}:{r.case_id}" for r in records) == sorted(listed)
    verdicts = {r.verdict for r in records}
    assert verdicts <= {"pass", "unsupported"} and "pass" in verdicts
    assert all(r.run is not None and r.run.backend == "gloo" for r in records)
    assert "cases in" in done.stdout and "cases/s" in done.stdout

    again = _harness("run", *args, "--resume")
    assert again.returncode == 0, again.stderr
    assert f"{len(records)} of {len(records)} cases already recorded" in again.stderr
    assert len(read_records(out)[0]) == len(records)


def test_stress_on_cpu_is_unsupported_in_every_repeat(tmp_path: Path) -> None:
    out = tmp_path / "stress.jsonl"
    # Pairwise: the smoke selection holds only cases the ranks here can run, so no stressed case on CPU.
    done = _harness("run", "--stress", "--repeat", "2", "--lanes", "1", "--engines", "builtin", "--references", "local",
                    "--matrix", "pairwise", "--limit", "2", "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stdout + done.stderr
    records, bad = read_records(out)
    assert not bad and len(records) == 2
    for record in records:
        assert record.case_id.endswith("-stress_delay") and record.case["stress"] == "delay"
        assert record.verdict == "unsupported" and "CUDA" in record.reason
        assert record.outcomes == {"unsupported": 2}
    assert "cases/s" in done.stdout


def test_a_run_refuses_to_mix_into_an_existing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "taken.jsonl"
    out.write_text('{"not": "a record"}\n')
    assert main(["run", "--engines", "torch-fsdp", "--limit", "1", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--out {out} already holds results; add --resume" in err
    assert out.read_text() == '{"not": "a record"}\n'


def test_bench_warm_pool_beats_the_target_and_spawning(tmp_path: Path) -> None:
    done = _harness("bench", "--world-size", "2", "--backend", "gloo", "--warm-cases", "30", "--spawn-cases", "1")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"meets the target of < {CPU_TARGET_MS:g} ms" in done.stdout
    assert "warm pool" in done.stdout and "spawn per case" in done.stdout


@pytest.mark.parametrize("nproc", [2])
def test_torchrun_runs_the_same_cases_and_rank0_records(tmp_path: Path, nproc: int) -> None:
    out = tmp_path / "torchrun.jsonl"
    done = _harness(
        "--standalone", "--nproc-per-node", str(nproc), "-m", "harness", "run", "--matrix", "smoke",
        "--engines", "torch-fsdp,torch-fsdp2", "--references", "local", "--limit", "3", "--out", str(out), "--no-progress",
        launcher=("-m", "torch.distributed.run"),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    records, bad = read_records(out)
    assert not bad and len(records) == 3
    assert all(r.case["world_size"] == nproc and r.case["reference"] == "local" for r in records)
    assert [r.verdict for r in records] == ["pass"] * 3, [r.reason for r in records]
    # Rank 0 stores the selection, so the printed resume line continues exactly it.
    stored = read_selection(out)
    assert stored is not None and sorted(stored.case_ids) == sorted(
        f"{r.case['engine']}:{r.case['reference']}:{r.case_id}" for r in records)


def test_torchrun_repeats_a_case_and_resumes_with_nothing_left(tmp_path: Path) -> None:
    out = tmp_path / "repeat.jsonl"
    run = ("--standalone", "--nproc-per-node", "2", "-m", "harness", "run", "--engines", "torch-fsdp",
           "--references", "local", "--limit", "1", "--repeat", "2", "--out", str(out), "--no-progress")
    done = _harness(*run, launcher=("-m", "torch.distributed.run"))
    assert done.returncode == 0, done.stdout + done.stderr
    records, bad = read_records(out)
    # Both runs went through the world (rank 0's runner), folded into one record.
    assert not bad and [r.outcomes for r in records] == [{"pass": 2}], [r.reason for r in records]
    # Nothing left to run: rank 0 sends the other ranks the stop before any case, and every rank ends.
    again = _harness(*run, "--resume", launcher=("-m", "torch.distributed.run"))
    assert again.returncode == 0, again.stdout + again.stderr
    assert "0 cases in" in again.stdout and len(read_records(out)[0]) == 1
    # Without --resume the file is refused with the pool path's one line, and every rank ends.
    refused = _harness(*run, launcher=("-m", "torch.distributed.run"))
    assert refused.returncode != 0
    assert refused.stderr.count(f"--out {out} already holds results; add --resume") == 1, refused.stderr
    # torchrun's agent reports rank 0's exit status 2 (with a traceback of its own); no rank raised.
    assert "exitcode  : 2" in refused.stderr and "rank      : 0" in refused.stderr, refused.stderr
    assert not [line for line in refused.stderr.splitlines() if line.strip().startswith("File") and "harness" in line]
    assert len(read_records(out)[0]) == 1


@pytest.mark.gpu
@needs_two_gpus
def test_bench_on_two_gpus() -> None:
    done = _harness("bench", "--world-size", "2", "--backend", "nccl", "--warm-cases", "50", "--spawn-cases", "2", gpus=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"meets the target of < {GPU_TARGET_MS:g} ms" in done.stdout


@pytest.mark.gpu
@needs_gpus(1)
@pytest.mark.parametrize("launcher", ["pool", "torchrun"])
def test_smoke_run_on_gpus(tmp_path: Path, launcher: str) -> None:
    out = tmp_path / f"{launcher}.jsonl"
    run = ("run", "--matrix", "smoke", "--engines", "torch-fsdp,torch-fsdp2", "--references", "ddp,local",
           "--out", str(out), "--no-progress")
    if launcher == "torchrun":
        done = _harness("--standalone", "--nproc-per-node", "2", "-m", "harness", *run,
                        launcher=("-m", "torch.distributed.run"), gpus=True, timeout=600)
    else:
        done = _harness(*run, gpus=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    records, bad = read_records(out)
    assert records and not bad
    # Two ranks on the GPUs: NCCL with one GPU each where there are two, gloo sharing one otherwise.
    shared = n_gpus() < 2
    assert all(r.run is not None and r.run.device == "cuda" and r.run.gpu
               and r.run.backend == ("gloo" if shared else "nccl") and r.run.ranks_per_gpu == (2 if shared else 1)
               for r in records), [r.run for r in records]
    assert {r.verdict for r in records} <= {"pass", "unsupported"}
    # On GPUs CPU offload runs, and its knob check must see the parameters on CPU.
    offloaded = [r for r in records if r.case["cpu_offload"] and r.verdict == "pass"]
    assert offloaded and all(
        k["status"] == "ok" for r in offloaded for k in r.detail["knobs"] if k["knob"] == "cpu_offload"
    )
