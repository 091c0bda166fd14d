"""The package installed from its wheel, without the repository: what it runs without ``suites/``.

The nightly's fuzz campaign and ``certify``'s pytest families (``seeds``, ``flat-param``) ship in the
package (``harness.conformance``) and run there, from a directory where no ``suites`` can be imported.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.cli.certify import (FLAT_PARAM_TESTS, FULL_PORTED, PORTED_MODULES, QUICK_PORTED, QUICK_TORCH_COMMON_TESTS,
                                 REPO, TORCH_COMMON_TESTS, PytestSelection, pytest_selection)
from harness.cli.fuzz import parse_fuzz_totals
from harness.pytest_plugin.xdist_groups import one_worker

#: the suites that collect the ``seeds`` family's tests from the package by import.
PORTED_SUITES = ("suites/seeds", "suites/mixed_precision", "suites/wrap")
#: what the wheel is built from: the project's metadata and its three packages (never ``suites/``).
BUILT_FROM = ("pyproject.toml", "README.md", "engine", "harness", "reports")


@pytest.fixture(scope="module")
@one_worker
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


def _env(site: Path) -> dict[str, str]:
    # The installed copy first on the path, from a directory outside the checkout: nothing of the
    # repository can be found (an editable install of it comes after PYTHONPATH).
    return {**os.environ, "PYTHONPATH": str(site), "CUDA_VISIBLE_DEVICES": ""}


def _run(site: Path, cwd: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=cwd, env=_env(site), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
@one_worker
def certified(site: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """``certify --engine builtin --families seeds,flat-param --quick`` run from the installed package, and
    its out directory."""
    cwd = tmp_path_factory.mktemp("certify")
    proc = _run(site, cwd, "-m", "harness", "certify", "--engine", "builtin", "--families", "seeds,flat-param",
                "--quick", "--out", str(cwd / "c"), "--no-progress")
    return proc, cwd / "c"


def test_the_fuzz_campaign_runs_from_the_installed_package(site: Path, tmp_path: Path) -> None:
    where = _run(site, tmp_path, "-c", "import harness.conformance.fuzz_campaign as m; print(m.__file__)")
    assert where.stdout.strip().startswith(str(site)), where.stdout + where.stderr
    proc = _run(site, tmp_path, "-m", "harness.conformance.fuzz_campaign", "--profile", "dev", "--max-examples", "3")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "6 passed" in proc.stdout
    totals = parse_fuzz_totals(proc.stdout)
    assert totals is not None and totals["examples"] >= 6 * 3, proc.stdout[-3000:]


def test_certify_runs_the_shipped_families_from_the_installed_package_in_one_pytest(
        site: Path, tmp_path: Path, certified: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    # What certify's pytest child sees (this environment, its path first): the installed package, no suites.
    found = _run(site, tmp_path, "-c", "import importlib.util as u, harness; print(u.find_spec('suites'), harness.__file__)")
    assert found.stdout.split() == ["None", str(site / "harness" / "__init__.py")], found.stdout + found.stderr
    proc, out = certified
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    families = {f["name"]: f for f in json.loads((out / "certificate.json").read_text())["families"]}
    # --quick keeps the core parity checks of the seeds' modules, and leaves flat-param's test alone.
    assert families["seeds"]["status"] == "pass" and families["seeds"]["passed"] == 4, families["seeds"]
    assert families["flat-param"]["status"] == "pass" and families["flat-param"]["passed"] == 1, families["flat-param"]
    # One child ran both families' tests (one start-up a certificate, not one a family).
    modules = {case.get("classname") for case in ET.parse(out / "tests.xml").getroot().iter("testcase")}
    assert modules == {"harness.conformance.seeds.seed_parity", "harness.conformance.engine_layout"}, modules
    assert sorted(p.name for p in out.glob("*.xml")) == ["tests.xml"]
    assert not list(site.rglob(".hypothesis")), "Hypothesis wrote its database into the installed package"


def test_one_pytest_child_narrows_each_family_to_its_own_tests() -> None:
    """The child's ``-k`` keeps a family's chosen tests of its own modules and every test of the others, and
    each family counts only its modules' test cases."""
    # A --quick certificate on CUDA ranks: the three families of test modules.
    args, timeout_s = pytest_selection([QUICK_PORTED, FLAT_PARAM_TESTS, QUICK_TORCH_COMMON_TESTS])
    assert args == ["--pyargs", "harness.conformance.seeds.seed_parity", "harness.conformance.engine_layout",
                    "harness.conformance.torch_common_fsdp",
                    "-k", "(not (seed_parity.py) or (check_parity_nested_wrapped_model or check_parity_transformer))"]
    assert timeout_s == 3 * 900
    # Without --quick the seeds' modules hold torch_common_fsdp too: it runs once, and both families count it.
    args, _ = pytest_selection([FULL_PORTED, TORCH_COMMON_TESTS])
    assert args == ["--pyargs", *PORTED_MODULES] and TORCH_COMMON_TESTS.modules[0] in PORTED_MODULES
    assert FULL_PORTED.owns("harness.conformance.torch_common_fsdp.TestTorchParityMachinery")
    two = PytestSelection(("a.b.one", "a.two"), keyword="x or y")
    assert two.narrowing() == "(not (one.py or two.py) or (x or y))"
    assert two.owns("a.b.one") and two.owns("a.two.TestClass") and not two.owns("a.b.one_more") and not two.owns("a.b")


def _imported_from(path: Path) -> dict[str, set[str]]:
    """``module -> names`` a suite module imports from ``harness.conformance``."""
    found: dict[str, set[str]] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("harness.conformance."):
            names = {a.name for a in node.names}
            if "*" in names:  # a star import takes the module's ``__all__``
                names = (names - {"*"}) | _all_of(REPO / (node.module.replace(".", "/") + ".py"))
            found.setdefault(node.module, set()).update(names)
    return found


def _all_of(path: Path) -> set[str]:
    """The names a module's literal ``__all__`` lists (none without one)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return {e.value for e in node.value.elts if isinstance(e, ast.Constant)}
    return set()


def _tests_of(path: Path) -> set[str]:
    """The names pytest collects tests from in a module: ``test_*`` functions (defined or assigned, as
    ``rank_check_tests`` returns them) and ``Test*`` classes."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {e.id for t in node.targets for e in ast.walk(t) if isinstance(e, ast.Name)}
    return {n for n in names if n.startswith(("test_", "Test"))}


def test_the_seeds_family_runs_what_the_ported_suites_collect() -> None:
    """Every test module of the ported suites collects a module of ``PORTED_MODULES`` (certify's ``seeds``),
    every test of it, and every module of the package's ported-suite folders that holds tests is one of them: a
    test added on either side runs on both."""
    collected: dict[str, set[str]] = {}
    for suite in PORTED_SUITES:
        for path in sorted((REPO / suite).glob("test_*.py")):
            shipped = {m: names for m, names in _imported_from(path).items() if m in PORTED_MODULES}
            assert len(shipped) == 1, f"{path.name} collects no module of certify's PORTED_MODULES (or several)"
            collected.update(shipped)
    for name in PORTED_MODULES:
        tests = _tests_of(REPO / (name.replace(".", "/") + ".py"))
        assert tests and tests <= collected.get(name, set()), f"{name}: not collected by a suite: {tests - collected.get(name, set())}"
    holding_tests = {f"harness.conformance.{p.parent.name}.{p.stem}"
                     for folder in ("seeds", "mixed_precision", "wrap")
                     for p in (REPO / "harness" / "conformance" / folder).glob("*.py") if _tests_of(p)}
    assert holding_tests <= set(PORTED_MODULES), f"test modules certify's seeds family leaves out: {holding_tests - set(PORTED_MODULES)}"
