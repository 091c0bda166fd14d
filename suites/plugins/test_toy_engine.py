"""The worked example: ``examples/toy_engine`` installed outside the repository, driven with no edit of it.

The package is installed the offline way an installer would leave it: its code next to a
``.dist-info`` whose ``entry_points.txt`` is written from the example's own pyproject.toml, on a
``PYTHONPATH`` of its own. Then:

- ``python -m harness run --engines mine=fsdp1:toy_engine`` and ``pytest ... --engine mine=fsdp1:toy_engine``
  run it (the spec form: nothing registered anywhere);
- its entry points ``toy`` and ``toy-buggy`` resolve by name;
- ``python -m harness certify --quick`` passes the clean engine and fails, on the copy with the planted bug
  (gradients reduced in the parameter dtype), exactly the families that see it: ``knobs``, where the
  reductions' dtype is checked, and at two ranks ``parity-local`` too (``broken_by_the_bug``). Every other
  family gives the buggy engine the clean engine's verdict.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cases.case import PRECISIONS
from harness.compare.tolerance import budget_source
from harness.pytest_plugin.xdist_groups import one_worker

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "toy_engine"
SPEC = "mine=fsdp1:toy_engine"


def _entry_points_txt(pyproject: Path) -> str:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli", reason="package missing: tomli (reads pyproject.toml on Python 3.10)")
    groups = tomllib.loads(pyproject.read_text())["project"]["entry-points"]
    lines = []
    for group, entries in groups.items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in entries.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def toy_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("site-packages")
    shutil.copytree(EXAMPLE / "toy_engine", site / "toy_engine", ignore=shutil.ignore_patterns("__pycache__"))
    info = site / "toy_engine-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-engine\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(_entry_points_txt(EXAMPLE / "pyproject.toml"))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(site)])}


def _run(args: list[str], env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_entry_points_register_both_toy_engines(toy_env: dict[str, str]) -> None:
    code = ("from harness.engines.registry import resolve, registered_names; "
            "print(registered_names()); print(resolve('toy').fsdp1_module, resolve('toy-buggy').fsdp1_module)")
    proc = _run(["-c", code], toy_env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "'toy'" in proc.stdout and "'toy-buggy'" in proc.stdout
    assert "toy_engine toy_engine.buggy" in proc.stdout


def test_harness_run_drives_a_package_outside_the_repo(toy_env: dict[str, str], tmp_path: Path) -> None:
    out = tmp_path / "run.jsonl"
    proc = _run(["-m", "harness", "run", "--engines", SPEC, "--matrix", "smoke", "--models", "nested", "--steps", "2",
                 "--references", "local", "--limit", "2", "--out", str(out), "--no-progress"], toy_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    records = [json.loads(line) for line in out.read_text().splitlines() if '"case"' in line]
    assert len(records) == 2 and {r["case"]["engine"] for r in records} == {SPEC}
    assert {r["verdict"] for r in records} == {"pass"}


def test_pytest_drives_a_package_outside_the_repo(toy_env: dict[str, str]) -> None:
    # gloo: the plug-in path is what is tested; on a host with fewer GPUs than ranks the auto backend
    # would skip the case.
    proc = _run(["-m", "pytest", "suites/parity/test_core_parity.py", "--engine", SPEC, "--reference", "ddp",
                 "--backend", "gloo", "-k", "full_shard-fp32-bwd_none-nested", "-p", "no:cacheprovider", "-q"], toy_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout


@pytest.fixture(scope="module")
@one_worker
def certificates(toy_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, dict]]:
    """``certify --quick`` of the clean engine (by spec) and of the buggy one (by entry point), side by side:
    two independent processes with their own out directories (and pools), so the wait is the longer one."""
    started = {}
    for label, engine in (("clean", SPEC), ("buggy", "toy-buggy")):
        out = tmp_path_factory.mktemp(label)
        started[label] = (out, subprocess.Popen(
            [sys.executable, "-m", "harness", "certify", "--engine", engine, "--quick", "--out", str(out), "--no-progress"],
            cwd=REPO, env=toy_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    found = {}
    try:
        for label, (out, proc) in started.items():
            _, stderr = proc.communicate(timeout=1200)
            assert (out / "certificate.md").exists() and (out / "certificate.html").exists(), stderr[-3000:]
            found[label] = (proc.returncode, json.loads((out / "certificate.json").read_text()))
    finally:
        for _, proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return found


def _statuses(cert: dict) -> dict[str, str]:
    return {f["name"]: f["status"] for f in cert["families"]}


def test_certify_passes_the_clean_engine(certificates: dict[str, tuple[int, dict]]) -> None:
    status, cert = certificates["clean"]
    families = _statuses(cert)
    assert status == 0 and cert["ok"], families
    for name in ("seeds", "parity-ddp", "parity-local", "knobs", "flat-param"):
        assert families[name] == "pass", (name, cert)
    assert cert["engine"] == "mine" and cert["version"] == "0.1.0"
    assert {"torch", "backend", "devices", "git_rev"} <= set(cert["environment"])


def broken_by_the_bug(world_size: int) -> list[str]:
    """The families a gradient reduced in the parameter dtype despite ``reduce_dtype`` breaks at ``world_size``
    ranks: the collective's dtype (knobs) everywhere. The values against the local reference only where the
    tolerance policy budgets by ablation (``harness.compare.tolerance.budget_source``: up to
    ``ORDER_FREE_WORLD_SIZE`` ranks), where a dropped reduce cast must fail on values alone; past it the
    order of a low-precision sum moves the values as much as the cast, and the knob check alone sees it
    (a certificate of a 4-GPU node runs 4 ranks). Against DDP (full precision) the mixed-precision cases are
    unsupported where the values fail, so the failure is not counted twice."""
    values = ["parity-local"] if budget_source(PRECISIONS["reduce_only"], world_size) == "ablation" else []
    return [*values, "knobs"]


def test_the_bug_breaks_the_values_only_where_the_ablation_rule_budgets() -> None:
    assert broken_by_the_bug(2) == ["parity-local", "knobs"]
    assert broken_by_the_bug(4) == ["knobs"]


def test_certify_fails_exactly_the_families_the_bug_breaks(certificates: dict[str, tuple[int, dict]]) -> None:
    status, cert = certificates["buggy"]
    families = _statuses(cert)
    broken = broken_by_the_bug(cert["environment"]["world_size"])
    assert status == 1 and not cert["ok"]
    assert [name for name, s in families.items() if s == "fail"] == broken
    clean = _statuses(certificates["clean"][1])
    assert {n: s for n, s in families.items() if n not in broken} == {n: s for n, s in clean.items() if n not in broken}
    assert all(clean[n] == "pass" for n in broken)
    by_name = {f["name"]: f for f in cert["families"]}
    knobs = by_name["knobs"]
    assert knobs["failures"] and all(f["worst_quantity"] == "precision" for f in knobs["failures"])
    # Only the cases that reduce in another dtype than they compute in can show the bug.
    for name in broken:
        assert by_name[name]["failures"] and all("reduce_only" in f["case"] for f in by_name[name]["failures"]), name
        # Every failing case links to its page in the certification's report.
        assert {f["case"] for f in by_name[name]["failures"]} <= set(cert["pages"]), name
    # Against DDP the mixed-precision cases are unsupported where the local reference ablates the casts
    # (``unsupported_here``), and judged by the emulation's budgets past that: the bug fails neither way.
    ablates = "parity-local" in broken
    assert by_name["parity-ddp"]["status"] == "pass"
    assert (by_name["parity-ddp"]["unsupported"] > 0) == ablates, by_name["parity-ddp"]


def test_installing_the_example_leaves_nothing_beside_it(tmp_path: Path) -> None:
    """``pip install examples/toy_engine`` builds into the checkout's ignored ``build/``, not beside the
    example (a copy of the checkout's layout, so the real one is untouched)."""
    example = tmp_path / "checkout" / "examples" / "toy_engine"
    shutil.copytree(EXAMPLE, example, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    before = sorted(p.relative_to(example) for p in example.rglob("*"))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(tmp_path / "site"), str(example)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.relative_to(example) for p in example.rglob("*")) == before
    assert (tmp_path / "site" / "toy_engine").is_dir() and (tmp_path / "checkout" / "build" / "toy_engine").is_dir()
