"""``nightly --submit local|slurm --shards N``: the array a submission plans (pure, nothing submitted), its
option errors, how it reads its tasks' ends, and one real submission through submitit's local executor (two
shards of one real case each on gloo ranks, then the merge)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from harness.cli import build_parser, main
from harness.cli.nightly_submit import SUBMIT_DIR, SubmitOptions, _wait, plan_array, submit_options
from harness.run.parts import PartSpec

#: a nightly of few real cases: no fuzz campaign, no performance section, no determinism reruns.
SMALL = ["--matrix", "smoke", "--engines", "builtin", "--references", "local", "--fuzz-profile", "none",
         "--no-perf", "--no-progress", "--no-determinism-sample"]
REPO = Path(__file__).resolve().parents[2]


def _args(*argv: str) -> Any:
    return build_parser().parse_args(["nightly", *argv])


def test_the_array_runs_shard_k_of_n_in_task_k_into_the_night_s_shard_directories(tmp_path: Path) -> None:
    args = _args("--out", str(tmp_path / "night"), "--submit", "slurm", "--shards", "3", "--resume", *SMALL)
    options = submit_options(args)
    assert options is not None and options.cluster == "slurm" and options.parts == 3
    plan = plan_array(args, options)
    assert [t.part for t in plan.tasks] == [PartSpec(0, 3), PartSpec(1, 3), PartSpec(2, 3)]
    assert [t.out for t in plan.tasks] == [tmp_path / "night" / "shards" / f"{k}-of-3" for k in (1, 2, 3)]
    assert plan.folder == tmp_path / "night" / SUBMIT_DIR
    for task in plan.tasks:  # each task is the shard's own nightly, with the night's options
        assert task.args.submit is None and not task.args.merge_parts and task.args.resume
        assert task.args.matrix == "smoke" and task.args.engines == ["builtin"]
    assert args.part is None and args.submit == "slurm", "planning leaves the command line's options alone"
    folder = tmp_path / "logs"
    assert plan_array(args, SubmitOptions("local", 2, folder=folder)).folder == folder
    # ``--parts`` is the option's name, ``--shards`` its old spelling (an alias): the same plan.
    new = _args("--out", str(tmp_path / "night"), "--submit", "slurm", "--parts", "3", "--resume", *SMALL)
    assert submit_options(new) == options and [t.part for t in plan_array(new, options).tasks] == [t.part for t in plan.tasks]


def test_a_requeued_task_resumes_its_own_shard(tmp_path: Path) -> None:
    pytest.importorskip("submitit", reason="submitit is a dependency of --submit (pyproject.toml)")
    args = _args("--out", str(tmp_path), "--submit", "slurm", "--shards", "2", *SMALL)
    task = plan_array(args, submit_options(args)).tasks[1]
    assert not task.args.resume
    again = task.checkpoint().function
    assert again.part == PartSpec(1, 2) and not again.args.resume, "stopped before its results file: starts afresh"
    task.out.mkdir(parents=True)
    (task.out / "results.jsonl").write_text("")
    again = task.checkpoint().function
    assert again.part == PartSpec(1, 2) and again.args.resume and not task.args.resume


def test_slurm_options_reach_submitit_s_parameters() -> None:
    args = _args("--out", "night", "--submit", "slurm", "--shards", "4", "--partition", "gpu", "--time-limit-min", "120",
                 "--gpus-per-task", "8", "--cpus-per-task", "32", "--array-parallelism", "2",
                 "--slurm-param", "account=team", "--slurm-param", "qos=low")
    params = submit_options(args).executor_parameters()
    assert params["slurm_partition"] == "gpu" and params["timeout_min"] == 120 and params["gpus_per_node"] == 8
    assert params["cpus_per_task"] == 32 and params["slurm_array_parallelism"] == 2 and params["nodes"] == 1
    assert params["slurm_additional_parameters"] == {"account": "team", "qos": "low"}
    # Names submitit takes (it refuses others only once a Slurm executor exists, which needs srun here).
    submitit = pytest.importorskip("submitit", reason="submitit is a dependency of --submit (pyproject.toml)")
    from submitit.slurm.slurm import SlurmExecutor

    slurm = {f"slurm_{name}" for name in SlurmExecutor._valid_parameters()}
    assert set(params) <= submitit.AutoExecutor._valid_parameters() | slurm, set(params) - slurm
    default = submit_options(_args("--out", "night", "--submit", "local", "--shards", "4")).executor_parameters()
    assert default["slurm_array_parallelism"] == 4 and "timeout_min" not in default and "slurm_partition" not in default


@pytest.mark.parametrize("argv, says", [
    (["--submit", "local"], "--submit local: needs --parts N"),
    (["--shards", "2"], "--parts: only with --submit local|slurm (one part of a night: --part K/N)"),
    (["--partition", "gpu"], "--partition: only with --submit"),
    (["--submit", "local", "--shards", "2", "--shard", "1/2"], "--submit: gives every task its part; drop --part 1/2"),
    (["--submit", "local", "--shards", "2", "--merge-shards"], "drop --merge-parts"),
    (["--submit", "local", "--shards", "2", "--partition", "gpu"], "--partition: only for --submit slurm"),
    (["--submit", "slurm", "--parts", "0"], "--parts: 0 must be at least 1"),
    (["--submit", "pbs", "--shards", "2"], "--submit: invalid choice: 'pbs'"),
    (["--submit", "slurm", "--shards", "2", "--slurm-param", "account"], "--slurm-param: 'account' is not KEY=VALUE"),
])
def test_bad_submit_options_are_one_line_naming_the_option(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["nightly", "--out", str(tmp_path / "night"), *argv]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "night").exists(), "nothing is submitted or written"


class _Job:
    """A submitit job as ``_wait`` reads it: its id, its log paths, and its result or error."""

    def __init__(self, job_id: str, result: int | Exception) -> None:
        self.job_id, self._result = job_id, result
        self.paths = type("Paths", (), {"stderr": Path(f"logs/{job_id}_log.err")})()

    def result(self) -> int:
        if isinstance(self._result, Exception):
            raise self._result
        return self._result


def test_a_task_that_raised_or_could_not_run_its_cases_is_a_trouble_failing_cases_are_the_merge_s(tmp_path: Path) -> None:
    args = _args("--out", str(tmp_path), "--submit", "local", "--shards", "4")
    tasks = plan_array(args, submit_options(args)).tasks
    jobs = [_Job("7_0", 0), _Job("7_1", 1), _Job("7_2", RuntimeError("Job 7_2 failed\nkilled by signal 9")), _Job("7_3", 2)]
    troubles = _wait(jobs, tasks)
    assert len(troubles) == 2
    assert troubles[0].startswith("part 3/4 (job 7_2) failed: killed by signal 9") and "7_2_log.err" in troubles[0]
    assert troubles[1].startswith("part 4/4 (job 7_3) exited with status 2")


def test_submit_local_runs_both_shards_and_merges_one_night(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("submitit", reason="submitit is a dependency of --submit (pyproject.toml)")
    # The local executor's tasks are new interpreters: they import the harness from this checkout.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    night = tmp_path / "2026-01-02"
    code = main(["nightly", "--out", str(night), "--submit", "local", "--shards", "2", "--limit", "2", *SMALL])
    err = capsys.readouterr().err
    assert code == 0, err
    merged = json.loads((night / "nightly.json").read_text())
    assert merged["merged_shards"] and merged["shards"]["merged"] == ["1-of-2", "2-of-2"]
    assert merged["shards"]["problems"] == [] and merged["exit_code"] == 0
    assert merged["cases"]["selected"] == 2 and sum(merged["verdicts"].values()) == 2
    summary = json.loads((night / "summary.json").read_text())
    assert summary["cases"] == 2 and (night / "matrix.md").is_file()
    for k in (1, 2):  # each task ran its own shard, told explicitly (no scheduler variables locally)
        shard = json.loads((night / "shards" / f"{k}-of-2" / "nightly.json").read_text())["shard"]
        assert (shard["index"], shard["count"]) == (k - 1, 2) and shard["selected"] == 2
        assert f"part {k}/2" in err
    assert any((night / SUBMIT_DIR).rglob("*.out")), "the tasks' logs are under OUT/submitit"
