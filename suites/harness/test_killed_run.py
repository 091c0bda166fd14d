"""A real ``python -m harness run`` stopped by SIGTERM or SIGHUP (as Ctrl-C: the resume hint, nothing left
behind) or killed with SIGKILL (no clean-up runs, so the next run removes what it left)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.collect.collector import read_records

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--matrix", "smoke", "--models", "nested", "--steps", "1", "--no-progress"]


def _start_run(tmp: Path, out: Path, *also: str) -> tuple[subprocess.Popen[str], Path]:
    """A real run in a child with ``tmp`` as its temporary directory, returned once its pool's directory and
    ``also`` exist."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.Popen([sys.executable, "-m", "harness", "run", *TINY, "--limit", "1", "--out", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not all(list(tmp.glob(p.format(pid=proc.pid))) for p in ("harness-pool-{pid}-*", *also)):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run made no pool directory within 120 s"
        time.sleep(0.05)
    return proc, tmp


@pytest.mark.parametrize("signame, status, name", [("SIGTERM", 143, "r.jsonl"), ("SIGHUP", 129, "it's mine/r.jsonl")])
def test_sigterm_and_sighup_stop_like_ctrl_c_with_the_resume_hint_and_leave_nothing(
    tmp_path: Path, run_tmp: Path, signame: str, status: int, name: str
) -> None:
    import shlex
    import signal

    out = tmp_path / name
    out.parent.mkdir(exist_ok=True)
    proc, tmp = _start_run(run_tmp, out)
    proc.send_signal(getattr(signal, signame))
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == status, stderr
    hint = stderr.rpartition("Continue with: ")[2].strip()
    assert shlex.split(hint) == ["--out", str(out), "--resume"] and "Traceback" not in stderr
    # torch's own compile cache (torchinductor_<user>) may appear there too, as in any torch process.
    assert not list(tmp.glob("harness-pool-*")), "the pool's directory is removed"
    assert read_records(out) == ([], []) and not Path(f"{out}.lock").exists()


def test_the_next_run_removes_what_a_killed_run_left(tmp_path: Path, run_tmp: Path) -> None:
    from harness.ranks import forkserver, pool

    marked_server_dir = ("pymp-*/harness-owner-{pid}",) if forkserver.start_method(None) == "forkserver" else ()
    proc, tmp = _start_run(run_tmp, tmp_path / "r.jsonl", *marked_server_dir)
    proc.kill()
    proc.communicate(timeout=60)
    left = sorted([*tmp.glob(f"harness-pool-{proc.pid}-*"), *(m.parent for m in tmp.glob(f"pymp-*/*-{proc.pid}"))])
    assert left, "kill -9 runs no clean-up"
    (mine := tmp / f"harness-pool-{os.getpid()}-live").mkdir()
    assert sorted(pool.remove_stale_pool_dirs(tmp)) == left
    assert list(tmp.iterdir()) == [mine], "a live run's directory is kept"
