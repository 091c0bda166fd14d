"""The package installed from its wheel, without the repository: what it runs without ``suites/``.

The nightly's fuzz campaign and ``certify``'s ``flat-param`` family ship in the package
(``harness.conformance``) and run there; the family that still runs the repository's test tree
(``seeds``) is refused with one line naming what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.cli.certify import FAMILIES, REPO, missing_suites
from harness.cli.fuzz import parse_fuzz_totals

#: what the wheel is built from: the project's metadata and its three packages (never ``suites/``).
BUILT_FROM = ("pyproject.toml", "README.md", "engine", "harness", "reports")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the package installed from its wheel (a copy of the checkout is built, so
    the real one gets no ``build/``)."""
    root = tmp_path_factory.mktemp("installed")
    source = root / "source"
    for name in BUILT_FROM:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy(REPO / name, source / name)
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(root / "dist"), str(source)], capture_output=True, text=True, timeout=300)
    assert wheel.returncode == 0, wheel.stderr[-2000:]
    (built,) = (root / "dist").glob("*.whl")
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(root / "site"),
                              str(built)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-2000:]
    assert not (root / "site" / "suites").exists()
    return root / "site"


def _run(site: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    # The installed copy first on the path, from a directory outside the checkout: nothing of the
    # repository can be found (an editable install of it comes after PYTHONPATH).
    env = {**os.environ, "PYTHONPATH": str(site), "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_fuzz_campaign_runs_from_the_installed_package(site: Path, tmp_path: Path) -> None:
    where = _run(site, tmp_path, "-c", "import harness.conformance.fuzz_campaign as m; print(m.__file__)")
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr
    proc = _run(site, tmp_path, "-m", "harness.conformance.fuzz_campaign", "--profile", "dev", "--max-examples", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "6 passed" in proc.stdout
    totals = parse_fuzz_totals(proc.stdout)
    assert totals is not None and totals["examples"] >= 6 * 3, proc.stdout[-3000:]


def test_certify_names_the_suites_an_installed_package_lacks(site: Path, tmp_path: Path) -> None:
    proc = _run(site, tmp_path, "-m", "harness", "certify", "--engine", "builtin", "--quick", "--out", str(tmp_path / "c"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("harness certify:")]
    assert "--families seeds run" in line and "suites/seeds" in line
    assert "--families parity-ddp,parity-local,knobs,checkpoints,flat-param,torch-common-fsdp" in line
    assert not (tmp_path / "c" / "results.jsonl").exists()


def test_certify_runs_the_shipped_flat_param_family_from_the_installed_package(site: Path, tmp_path: Path) -> None:
    out = tmp_path / "c"
    proc = _run(site, tmp_path, "-m", "harness", "certify", "--engine", "builtin", "--families", "flat-param",
                "--out", str(out), "--no-progress")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    families = {f["name"]: f for f in json.loads((out / "certificate.json").read_text())["families"]}
    assert families["flat-param"]["status"] == "pass" and families["flat-param"]["passed"] == 1, families["flat-param"]
    assert not list(site.rglob(".hypothesis")), "Hypothesis wrote its database into the installed package"


def test_missing_suites_of_a_checkout_and_of_an_empty_tree(tmp_path: Path) -> None:
    names = [f.name for f in FAMILIES]
    assert missing_suites(names) == {}
    assert missing_suites(names, tmp_path) == {f.name: list(f.suites) for f in FAMILIES if f.suites}
    assert missing_suites(["parity-ddp", "knobs"], tmp_path) == {}
