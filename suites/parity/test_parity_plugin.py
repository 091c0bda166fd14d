"""The pytest plugin end to end: a generated suite in a scratch directory, run by a real ``pytest``
(a subprocess, so options, hooks and xdist behave as for a user). Small cases on 2 gloo CPU ranks."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.collect.collector import read_records

REPO = Path(__file__).resolve().parents[2]

CONFTEST = '''
pytest_plugins = ["harness.pytest_plugin"]


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA GPUs")
    config.addinivalue_line("markers", "slow: long-running")
'''

#: torch FSDP1 only, 2 steps: a pass, an unsupported case (CPU offload on CPU), a failing one (a
#: perturbed gradient) and a hang (a skipped collective; its own short timeout makes it a timeout).
SUITE = '''
import pytest
from harness.pytest_plugin.cases import SuiteMatrix

OK = SuiteMatrix("ok", axes={"cpu_offload": [False, True]}, fixed={"steps": 2})
PERTURBED = SuiteMatrix("perturbed", axes={}, fixed={"steps": 2, "extras": (("fault", "perturb_grad_rank1"),)})
HANG = SuiteMatrix("hang", axes={}, fixed={"steps": 2, "extras": (("fault", "skip_collective_on_rank1"),)})
# The hang never ends, so a short limit decides it whatever the load; the healthy cases get
# --case-timeout, long enough for a cold pool's first case on a busy two-core machine.
HANG_TIMEOUT_S = 3.0


@pytest.mark.parity_matrix(OK)
def test_ok(parity_case, parity_runner):
    parity_runner.run(parity_case)


@pytest.mark.parity_matrix(PERTURBED)
def test_perturbed(parity_case, parity_runner):
    parity_runner.run(parity_case)


@pytest.mark.parity_matrix(HANG)
def test_hang(parity_case, parity_runner):
    parity_runner.run(parity_case, timeout_s=HANG_TIMEOUT_S)


def test_ported_engines(fsdp_api):
    assert fsdp_api in ("builtin", "torch-fsdp")


@pytest.mark.gpu
def test_gpu_only():
    raise AssertionError("must not run without CUDA")
'''


def pytest_in(tmp_path: Path, *args: str, timeout: float = 900.0, suite: str = SUITE) -> subprocess.CompletedProcess[str]:
    # ``timeout`` only guards against a run that never ends: two xdist workers and their ranks each
    # import torch, which on a loaded two-core machine alone takes minutes.
    (tmp_path / "conftest.py").write_text(textwrap.dedent(CONFTEST))
    (tmp_path / "test_generated.py").write_text(textwrap.dedent(suite))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_XDIST_WORKER_COUNT", None)
    # The expected verdicts are those of 2 gloo ranks per worker (offload unsupported without an
    # accelerator, the GPU-only test skipped); hide GPUs so a CUDA host checks the same thing.
    env["CUDA_VISIBLE_DEVICES"] = ""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout,
    )


def outcomes(stdout: str) -> dict[str, str]:
    """Test name -> PASSED / SKIPPED / FAILED, from the ``-v`` progress lines of an xdist run."""
    return {
        nodeid.split("::")[-1]: status
        for status, nodeid in re.findall(r"\] (PASSED|FAILED|SKIPPED|ERROR) (\S+::\S+)", stdout)
    }


def collect(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    """Collect the scratch suite in this process (no ranks start at collection)."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_generated=SUITE)
    return pytester.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider", *args)


def test_ids_are_full_ids_and_the_options_choose_the_cases(pytester: pytest.Pytester) -> None:
    done = collect(pytester, "--engine", "torch-fsdp,torch-fsdp2", "--reference", "ddp")
    assert done.ret == 0, done.stdout.str()
    ids = [line.split("::")[-1] for line in done.stdout.lines if "::" in line]
    assert "test_ok[torch-fsdp:ddp:full_shard-fp32-bwd_none-nested-steps2]" in ids
    assert "test_ok[torch-fsdp2:ddp:full_shard-fp32-bwd_pre-orig-nested-steps2]" in ids, "FSDP2 at its own baseline"
    assert "test_ported_engines[torch-fsdp]" in ids and "test_ported_engines[builtin]" not in ids


def test_k_selects_by_case_id(pytester: pytest.Pytester) -> None:
    done = collect(pytester, "--engine", "torch-fsdp", "-k", "offload and local")
    assert done.ret == 0, done.stdout.str()
    assert [line for line in done.stdout.lines if "::" in line] == [
        "test_generated.py::test_ok[torch-fsdp:local:full_shard-fp32-bwd_none-offload-nested-steps2]"
    ]


def test_larger_tiers_are_marked_slow(pytester: pytest.Pytester) -> None:
    done = collect(pytester, "--matrix", "pairwise", "--engine", "builtin", "-m", "not slow")
    assert done.ret == 0, done.stdout.str()
    assert "test_ported_engines[builtin]" in done.stdout.str()
    assert "test_ok[" not in done.stdout.str(), "cases of the pairwise and full tiers are marked slow"


def test_loop_axes_deselects_the_generated_suites_without_a_training_loop_axis(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_generated=SUITE + textwrap.dedent('''
        LOOP = SuiteMatrix("loop", axes={"clip_grad": ["none", "norm"]}, fixed={"steps": 2})


        @pytest.mark.parity_matrix(LOOP)
        def test_loop(parity_case, parity_runner):
            parity_runner.run(parity_case)
    '''))
    done = pytester.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider", "--engine", "torch-fsdp",
                                        "--loop-axes")
    assert done.ret == 0, done.stdout.str()
    ids = [line.split("::")[-1] for line in done.stdout.lines if "::" in line]
    generated = [i for i in ids if i.startswith(("test_ok[", "test_perturbed[", "test_hang[", "test_loop["))]
    assert generated and all(i.startswith("test_loop[") for i in generated), ids
    assert "test_ported_engines[torch-fsdp]" in ids, "tests that are not generated cases stay"
    assert re.search(r"\d+ deselected", done.stdout.str()), done.stdout.str()


def test_bad_option_is_a_usage_error(pytester: pytest.Pytester) -> None:
    done = collect(pytester, "--engine=fsdp3")
    assert done.ret == pytest.ExitCode.USAGE_ERROR
    assert "--engine: engine 'fsdp3' is not registered" in done.stderr.str()
    done = collect(pytester, "--gpu-slots", "many")
    assert done.ret == pytest.ExitCode.USAGE_ERROR and "whole number of NCCL ranks per GPU" in done.stderr.str()


def test_an_engine_spec_runs_the_ported_checks_and_the_cases_under_its_name(pytester: pytest.Pytester) -> None:
    done = collect(pytester, "--engine", "mine=fsdp1:engine,torch-fsdp2", "--reference", "ddp")
    assert done.ret == 0, done.stdout.str()
    ids = [line.split("::")[-1] for line in done.stdout.lines if "::" in line]
    assert "test_ok[mine:ddp:full_shard-fp32-bwd_none-nested-steps2]" in ids
    assert [i for i in ids if i.startswith("test_ported_engines")] == ["test_ported_engines[mine]"], "FSDP1-API engines only"


def test_verdicts_map_to_pytest_and_xdist_workers_record_every_case_once(tmp_path: Path, pytester: pytest.Pytester) -> None:
    """Two xdist workers (each its own pool): pass passes, unsupported skips with the reason, a wrong
    gradient and a hang fail with their evidence; every case has one record in the merged file."""
    results = tmp_path / "out" / "results.jsonl"
    (tmp_path / "test_slots.py").write_text(textwrap.dedent('''
        from harness.ranks import gpu_slots


        def test_workers_share_one_run_s_gpu_slots():
            slots = gpu_slots.installed()
            assert slots is not None, "an xdist worker's pools would crowd the GPUs"
            assert slots.per_gpu == 3, "--gpu-slots"
    '''))
    done = pytest_in(
        tmp_path, "-n", "2", "-v", "--engine", "torch-fsdp", "--reference", "ddp", "--case-timeout", "180", "--gpu-slots", "3",
        "--results", str(results),
    )
    seen = outcomes(done.stdout)
    base = "torch-fsdp:ddp:full_shard-fp32-bwd_none-nested-steps2"
    assert seen == {
        f"test_ok[{base}]": "PASSED",
        f"test_ok[{base.replace('-nested', '-offload-nested')}]": "SKIPPED",
        f"test_perturbed[{base}]": "FAILED",
        f"test_hang[{base}]": "FAILED",
        "test_ported_engines[torch-fsdp]": "PASSED",
        "test_gpu_only": "SKIPPED",
        "test_workers_share_one_run_s_gpu_slots": "PASSED",
    }, done.stdout[-4000:] + done.stderr[-2000:]
    assert "unsupported: torch-fsdp: CPU offload pins host memory" in done.stdout
    assert re.search(r"fail: grad:\S+: max_abs", done.stdout), "the failing quantity is named"
    assert "timeout: no answer from rank(s)" in done.stdout and "--- rank " in done.stdout, "the stuck ranks' stacks"
    assert "marked gpu: needs CUDA GPUs" in done.stdout
    assert "4 generated parity cases (--matrix smoke)" in done.stdout, done.stdout[-2000:]

    records, bad = read_records(results)
    assert not bad
    assert sorted(r.verdict for r in records) == ["fail", "pass", "timeout", "unsupported"]
    assert len({r.run.run_id for r in records}) == 1 and records[0].run.run_id.startswith("pytest-"), "one run id"
    assert [p.name for p in results.parent.iterdir()] == ["results.jsonl"], "per-worker files merged away"

    again = collect(pytester, "--results", str(results))
    assert again.ret == pytest.ExitCode.USAGE_ERROR and "already hold results" in again.stderr.str(), (
        "an old results file is never mixed with a new run"
    )


EXPECTED_FAILURES = '''
from harness.collect.expectations import ExpectedFailure
from harness.pytest_plugin.cases import SuiteMatrix

PERTURB = (("fault", "perturb_grad_rank1"),)
SLICE = SuiteMatrix(
    "xf", axes={"use_orig_params": [False, True]}, fixed={"steps": 2},
    smoke_variants=({}, {"use_orig_params": True}),
    expected_failures=(ExpectedFailure("known wrong", lambda case, device: device == "cpu"),),
)


@pytest.mark.parity_matrix(SLICE)
def test_xf(parity_case, parity_runner):
    # The original-parameters case is perturbed (a failure, expected); the other passes, unexpectedly.
    parity_runner.run(parity_case.replace(extras=PERTURB) if parity_case.use_orig_params else parity_case)
'''


def test_expected_failures_are_strict_xfails_with_their_reason(tmp_path: Path) -> None:
    results = tmp_path / "results.jsonl"
    done = pytest_in(tmp_path, "-v", "-k", "test_xf", "--engine", "torch-fsdp", "--reference", "ddp", "--case-timeout", "180",
                     "--results", str(results), suite="import pytest\n" + EXPECTED_FAILURES)
    text = done.stdout
    base = "torch-fsdp:ddp:full_shard-fp32-bwd_none-nested-steps2"
    assert re.search(rf"XFAIL .*test_xf\[{re.escape(base.replace('-nested', '-orig-nested'))}\]", text), text[-3000:]
    assert re.search(rf"FAILED .*test_xf\[{re.escape(base)}\]", text) and "[XPASS(strict)] known wrong" in text, text[-3000:]
    # Both records carry the expectation, so a report tells the known failure from new breakage and shows
    # the unexpected pass.
    records, bad = read_records(results)
    assert not bad and {r.case_id: (r.verdict, r.expected_failure) for r in records} == {
        base.split(":", 2)[2].replace("-nested", "-orig-nested"): ("fail", "known wrong"),
        base.split(":", 2)[2]: ("pass", "known wrong"),
    }, records

