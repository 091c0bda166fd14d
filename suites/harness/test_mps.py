"""CUDA MPS for ranks that share a GPU (``harness.ranks.mps``): when a run wants it, and the daemon's life.

The daemon's command is a stand-in here (a script keeping the daemon's state in a file of its pipe
directory and logging every call), so the start, the sharing between runs and the stop are checked on any
host; the GPU tier's nightly checks a real daemon (``suites/nightly/test_nightly.py``).
"""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest

from harness.ranks import mps
from harness.ranks.mps import LOG_ENV, PIPE_ENV, MpsDaemon, MpsError, gpu_processes, mps_wanted
from harness.ranks.placement import Lane

CPU = Lane(2, "gloo", None)
NCCL_01, NCCL_23 = Lane(2, "nccl", (0, 1)), Lane(2, "nccl", (2, 3))
SHARED = Lane(2, "gloo", (0, 0))

FAKE_CONTROL = '''#!{python}
import os, sys, pathlib
pipe = pathlib.Path(os.environ["CUDA_MPS_PIPE_DIRECTORY"])
alive = pipe / "alive"
command = " ".join(sys.argv[1:]) or sys.stdin.read().strip()
with open(pipe.parent.parent / "calls.txt", "a") as log:
    log.write(command + (" CVD=" + os.environ["CUDA_VISIBLE_DEVICES"] if "CUDA_VISIBLE_DEVICES" in os.environ else "") + "\\n")
if command == "-d":
    sys.exit({start_status} or alive.touch())
if not alive.exists():
    sys.exit("Cannot find MPS control daemon process")
if command == "quit":
    alive.unlink()
'''


def _control(tmp_path: Path, start_status: int = 0) -> str:
    path = tmp_path / "bin" / "nvidia-cuda-mps-control"
    path.parent.mkdir(exist_ok=True)
    path.write_text(FAKE_CONTROL.format(python=sys.executable, start_status=start_status))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def _calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "calls.txt"
    return log.read_text().split("\n")[:-1] if log.exists() else []


@pytest.fixture(autouse=True)
def _no_machine_daemon(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Whatever this host runs, the tests see no daemon of the machine's and no user's.
    monkeypatch.setattr(mps, "SYSTEM_PIPE_DIR", tmp_path / "no-system-daemon")
    monkeypatch.delenv(PIPE_ENV, raising=False)


@pytest.mark.parametrize(("choice", "groups", "wanted", "why"), [
    ("auto", [[CPU, CPU]], False, "no rank of this run is on a GPU"),
    ("auto", [[NCCL_01, NCCL_23]], False, "one rank process per GPU"),
    ("auto", [[NCCL_01, NCCL_23, NCCL_01]], True, "2 rank processes on a GPU"),
    ("auto", [[SHARED]], True, "2 rank processes on a GPU"),
    # World sizes run one after the other: their pools never share a GPU at once.
    ("auto", [[NCCL_01], [Lane(4, "nccl", (0, 1, 2, 3))]], False, "one rank process per GPU"),
    ("on", [[NCCL_01, NCCL_23]], True, "one rank process per GPU"),
    ("off", [[SHARED, SHARED]], False, "--mps off"),
])
def test_when_a_run_wants_mps(choice: str, groups: list[list[Lane]], wanted: bool, why: str) -> None:
    got, text = mps_wanted(choice, groups)
    assert got is wanted and why in text


def test_gpu_processes_counts_pools_and_shared_ranks() -> None:
    assert gpu_processes([NCCL_01, SHARED, NCCL_23]) == {0: 3, 1: 1, 2: 1, 3: 1}
    assert gpu_processes([CPU]) == {}
    with pytest.raises(ValueError, match="--mps: 'yes'"):
        mps_wanted("yes", [[SHARED]])


def test_the_harness_daemon_starts_for_the_ranks_and_stops_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    environ: dict[str, str] = {"KEEP": "1"}
    with MpsDaemon("auto", [[SHARED]], environ=environ, root=tmp_path, control=_control(tmp_path)) as state:
        assert state.active and state.wanted and "the harness's daemon" in state.how
        # The ranks start with the daemon's directories, which are the harness's own.
        home = tmp_path / next(p.name for p in tmp_path.iterdir() if p.name.startswith("fsdp-parity-mps-"))
        assert environ == {"KEEP": "1", PIPE_ENV: str(home / "pipe"), LOG_ENV: str(home / "log")}
        assert (home / "pipe" / "alive").exists()
    assert environ == {"KEEP": "1"}
    assert not (home / "pipe" / "alive").exists()
    # Asked whether one runs, started, checked, and quit; the daemon sees every GPU, not this process's.
    assert _calls(tmp_path) == ["get_server_list", "-d", "get_server_list", "quit"]


def test_runs_side_by_side_share_one_daemon_and_the_last_stops_it(tmp_path: Path) -> None:
    control = _control(tmp_path)
    first, second = {}, {}  # type: ignore[var-annotated]
    a = MpsDaemon("auto", [[SHARED]], environ=first, root=tmp_path, control=control)
    b = MpsDaemon("auto", [[SHARED]], environ=second, root=tmp_path, control=control)
    assert a.__enter__().active and b.__enter__().active
    assert first == second and _calls(tmp_path).count("-d") == 1
    a.__exit__(None, None, None)
    assert "quit" not in _calls(tmp_path) and first == {}
    b.__exit__(None, None, None)
    assert _calls(tmp_path)[-1] == "quit"
    # A later run starts it again.
    with MpsDaemon("on", [[NCCL_01]], environ={}, root=tmp_path, control=control) as state:
        assert state.active
    assert _calls(tmp_path).count("-d") == 2


def test_a_daemon_the_user_runs_is_used_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {PIPE_ENV: "/users/pipes"}
    with MpsDaemon("auto", [[SHARED]], environ=environ, root=tmp_path, control=_control(tmp_path)) as state:
        assert state.active and f"{PIPE_ENV}=/users/pipes" in state.how
    machine = tmp_path / "machine"
    machine.mkdir()
    (machine / "control").touch()
    monkeypatch.setattr(mps, "SYSTEM_PIPE_DIR", machine)
    with MpsDaemon("on", [[SHARED]], environ={}, root=tmp_path, control=_control(tmp_path)) as state:
        assert state.active and "the machine's daemon" in state.how
    assert environ == {PIPE_ENV: "/users/pipes"} and _calls(tmp_path) == []


def test_auto_runs_without_mps_where_it_cannot_start_and_on_refuses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with MpsDaemon("auto", [[SHARED]], environ={}, root=tmp_path) as state:
        assert not state.active and state.wanted and "nvidia-cuda-mps-control is not on PATH" in state.how
    with pytest.raises(MpsError, match="--mps on: nvidia-cuda-mps-control is not on PATH"):
        MpsDaemon("on", [[SHARED]], environ={}, root=tmp_path).__enter__()
    failing = _control(tmp_path, start_status=3)
    environ: dict[str, str] = {}
    with MpsDaemon("auto", [[SHARED]], environ=environ, root=tmp_path, control=failing) as state:
        assert not state.active and "did not start a daemon" in state.how and environ == {}
    with pytest.raises(MpsError, match="--mps on: .* did not start a daemon"):
        MpsDaemon("on", [[SHARED]], environ={}, root=tmp_path, control=failing).__enter__()
    with pytest.raises(MpsError, match="--mps on: no rank of this run is on a GPU"):
        MpsDaemon("on", [[CPU]], environ={}, root=tmp_path, control=failing).__enter__()
    with MpsDaemon("off", [[SHARED]], environ={}, root=tmp_path, control=failing) as state:
        assert not state.active and not state.wanted


def test_pytest_plans_mps_over_every_workers_pools(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from harness.pytest_plugin import _planned_lanes
    from harness.ranks import placement

    monkeypatch.setattr(placement, "n_gpus", lambda: 2)
    options = SimpleNamespace(world_sizes=(2,), backend="auto", device="auto")

    def wanted(workers: int | None) -> bool:
        config = SimpleNamespace(option=SimpleNamespace(numprocesses=workers))
        return mps_wanted("auto", [_planned_lanes(config, options)])[0]  # type: ignore[arg-type]

    # One pytest process: one pool on the two GPUs. Four workers: four pools on them.
    assert not wanted(None) and not wanted(1) and wanted(4)


def test_pytest_refuses_mps_on_without_a_gpu(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    from harness.ranks import placement

    monkeypatch.setattr(placement, "n_gpus", lambda: 0)
    pytester.makeconftest("pytest_plugins = ['harness.pytest_plugin']\n")
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    done = pytester.runpytest_inprocess("-p", "no:cacheprovider", "--mps", "on")
    assert done.ret == pytest.ExitCode.USAGE_ERROR
    assert "--mps on: no rank of this run is on a GPU" in done.stderr.str()
    assert pytester.runpytest_inprocess("-p", "no:cacheprovider", "--mps", "auto").ret == pytest.ExitCode.OK
