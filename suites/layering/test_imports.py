"""Layering: no import circle among the modules of engine/, harness/ and reports/ (imports anywhere
in a module count), imports pointing down the layers only (engine < harness library < reports <
front ends < suites), inside the harness library imports pointing back along the stages only (cases <
ranks < engines < selection < compare < collect < run < perf, every library module in its stage), every
engine module imports alone, from a clean start, nothing in harness/ (but the conformance checks of
the engine's own internals) or reports/ imports the engine, and the front ends' imports leave DTensors to the
ranks.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from suites.layering.imports import (
    LAYERS,
    STAGES,
    backward_stage_imports,
    find_cycles,
    import_graph,
    layer_of,
    stage_of,
    unstaged_library_modules,
    upward_imports,
)

ROOT = Path(__file__).resolve().parents[2]

#: ``(importer, imported)`` pairs allowed to run up the layers. Empty: every import of the tree
#: points down. An entry here is a known debt to pay, never a way to make the test pass.
ALLOWED_UPWARD: frozenset[tuple[str, str]] = frozenset()


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_circle_through_type_checking_and_function_bodies_is_found(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
            "pkg/b.py": "def f():\n    from . import c\n",
            "pkg/c.py": "import pkg.a\n",
            "pkg/d.py": "from pkg import a, b\nimport torch\n",
        },
    )
    graph = import_graph(root, ["pkg"])
    assert graph["pkg.d"] == {"pkg.a", "pkg.b"}
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]


def test_one_way_imports_have_no_circle(tmp_path: Path) -> None:
    root = _tree(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/base.py": "import math\n",
            "high/__init__.py": "from high.top import run\n",
            "high/top.py": "from low.base import math\nfrom low import base\n",
        },
    )
    graph = import_graph(root, ["low", "high"])
    assert graph["high.top"] == {"low.base"} and graph["high"] == {"high.top"}
    assert find_cycles(graph) == []


def test_layer_of_knows_front_ends_from_the_library() -> None:
    names = [name for name, _ in LAYERS]
    assert names[layer_of("engine.unit")] == "engine"
    assert names[layer_of("harness.run.runner")] == "harness library"
    assert names[layer_of("harness")] == "harness library"
    assert names[layer_of("harness.cli.run")] == "front ends"
    assert names[layer_of("harness.pytest_plugin")] == "front ends"
    assert names[layer_of("harness.conformance.fuzz_campaign")] == "front ends"
    assert names[layer_of("harness.__main__")] == "front ends"
    assert names[layer_of("reports.diff")] == "reports"
    assert names[layer_of("suites.layering.imports")] == "suites"
    assert layer_of("harnessing") is None and layer_of("examples.toy") is None


def test_planted_upward_import_is_found(tmp_path: Path) -> None:
    files = {
        "engine/__init__.py": "",
        "engine/unit.py": "import torch\n",
        "harness/__init__.py": "",
        "harness/run/runner.py": "from engine import unit\n",
        "harness/cli/__init__.py": "",
        "harness/cli/run.py": "from harness.run import runner\nimport reports.page\n",
        "reports/__init__.py": "",
        "reports/page.py": "from harness.run.runner import x\n",
        "suites/__init__.py": "",
        "suites/test_x.py": "import harness.cli.run\nimport reports.page\n",
    }
    root = _tree(tmp_path, files)
    clean = import_graph(root, ["engine", "harness", "reports", "suites"])
    assert upward_imports(clean) == []
    # One import up from each layer: the engine into the library, the library into the reports,
    # the reports into a front end, a front end into the suites.
    planted = {
        "engine/unit.py": "def f():\n    from harness.run import runner\n",
        "harness/run/runner.py": "from reports.page import render\n",
        "reports/page.py": "from harness.cli import run\n",
        "harness/cli/run.py": "import suites.test_x\n",
    }
    root = _tree(tmp_path, planted)
    found = upward_imports(import_graph(root, ["engine", "harness", "reports", "suites"]))
    assert found == [
        ("engine.unit", "harness.run.runner"),
        ("harness.cli.run", "suites.test_x"),
        ("harness.run.runner", "reports.page"),
        ("reports.page", "harness.cli.run"),
    ]


def test_imports_point_down_the_layers() -> None:
    graph = import_graph(ROOT, ["engine", "harness", "reports", "suites"])
    found = set(upward_imports(graph))
    assert not found - ALLOWED_UPWARD, f"imports up the layers (engine < harness library < reports < front ends < suites): {sorted(found - ALLOWED_UPWARD)}"
    assert not ALLOWED_UPWARD - found, f"allowed upward imports that no longer exist: drop them from ALLOWED_UPWARD: {sorted(ALLOWED_UPWARD - found)}"


def test_stage_of_knows_the_stages() -> None:
    assert [STAGES[stage_of(f"harness.{s}.x")] for s in STAGES] == list(STAGES)
    assert STAGES[stage_of("harness.run")] == "run" and STAGES[stage_of("harness.compare.compare")] == "compare"
    assert stage_of("harness") is None and stage_of("harness.cli.run") is None and stage_of("reports.run") is None


def test_planted_stage_imports_are_found(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "harness/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from harness.engines.adapters import A\n",
        "harness/cases/__init__.py": "",
        "harness/cases/case.py": "def f():\n    from harness.engines import adapters\n",
        "harness/engines/__init__.py": "",
        "harness/engines/adapters.py": "from harness.cases.case import CaseConfig\nfrom harness import A\n",
        "harness/run/__init__.py": "",
        "harness/run/runner.py": "import harness.engines.adapters\nfrom harness.cases import case\n",
        "harness/cli/__init__.py": "",
        "harness/cli/run.py": "from harness.run import runner\n",
        "harness/stray.py": "",
        "harness/misc/__init__.py": "",
    })
    graph = import_graph(root, ["harness"])
    # Back along the stages is the rule; forward, or into the facade, is found; front ends are not stages.
    assert backward_stage_imports(graph) == [("harness.cases.case", "harness.engines.adapters"),
                                             ("harness.engines.adapters", "harness")]
    assert unstaged_library_modules(root) == ["harness/misc", "harness/stray.py"]


def test_stages_import_only_earlier_stages() -> None:
    found = backward_stage_imports(import_graph(ROOT, ["engine", "harness", "reports"]))
    assert not found, f"imports forward along the stages ({' < '.join(STAGES)}) or into the harness facade: {found}"


def test_every_library_module_sits_in_a_stage() -> None:
    found = unstaged_library_modules(ROOT)
    assert not found, f"harness/ holds modules outside its stages ({', '.join(STAGES)}): move each into its stage: {found}"


def test_engine_has_no_import_circle() -> None:
    circles = find_cycles(import_graph(ROOT, ["engine"]))
    assert not circles, f"import circles in engine/: {circles}"


def test_no_import_circle_in_engine_harness_and_reports() -> None:
    circles = find_cycles(import_graph(ROOT, ["engine", "harness", "reports"]))
    assert not circles, f"import circles: {circles}"


def test_every_engine_module_imports_alone() -> None:
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for p in (ROOT / "engine").rglob("*.py")
    )
    # One interpreter, and before each module every engine module is forgotten: each is imported
    # first, as a user importing only it would.
    code = textwrap.dedent(
        f"""
        import importlib, sys, traceback
        failed = []
        for name in {modules!r}:
            for loaded in [m for m in sys.modules if m == "engine" or m.startswith("engine.")]:
                del sys.modules[loaded]
            try:
                importlib.import_module(name)
            except Exception:
                failed.append(name + ": " + traceback.format_exc(limit=3))
        assert not failed, "\\n".join(failed)
        print(len({modules!r}))
        """
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(len(modules))


#: the modules of harness/ that check the engine's own internals (its flat-parameter handle, wrap policies,
#: precision rules, hook registration) and so import ``engine``. Nothing else in harness/ or reports/ may:
#: the reference side never runs the engine under test's code (the engine is loaded by its spec, as any
#: other engine is; what both sides need is the harness's own, e.g. ``harness.engines.dtensors``).
ENGINE_INTERNAL_CHECKS: frozenset[str] = frozenset({
    "harness.conformance.flat_handles",
    "harness.conformance.flat_param_properties",
    "harness.conformance.mixed_precision.mixed_precision",
    "harness.conformance.mixed_precision.precision_logic",
    "harness.conformance.seeds.fsdp_core",
    "harness.conformance.wrap.wrap_models",
    "harness.conformance.wrap.wrap_oracle",
    "harness.conformance.wrap.wrap_policies",
})


def engine_importers(graph: dict[str, set[str]]) -> set[str]:
    """The modules of harness/ and reports/ in ``graph`` that import ``engine`` or a module of it."""
    return {module for module, targets in graph.items() if module.split(".")[0] in ("harness", "reports")
            and any(t == "engine" or t.startswith("engine.") for t in targets)}


def test_planted_engine_import_is_found(tmp_path: Path) -> None:
    root = _tree(tmp_path, {
        "engine/__init__.py": "",
        "engine/dtensors.py": "",
        "harness/__init__.py": "",
        "harness/engines/checkpoint.py": "def f():\n    from engine.dtensors import full_tensor\n",
        "harness/engines/registry.py": "BUILTIN = 'engine'\n",
        "reports/__init__.py": "",
        "reports/page.py": "import engine\n",
    })
    assert engine_importers(import_graph(root, ["engine", "harness", "reports"])) == {"harness.engines.checkpoint", "reports.page"}


def test_the_reference_side_never_imports_the_engine() -> None:
    found = engine_importers(import_graph(ROOT, ["engine", "harness", "reports"]))
    assert not found - ENGINE_INTERNAL_CHECKS, (
        f"modules of harness/ or reports/ importing engine (use the harness's own helpers, e.g. harness.engines.dtensors): "
        f"{sorted(found - ENGINE_INTERNAL_CHECKS)}")
    assert not ENGINE_INTERNAL_CHECKS - found, (
        f"no longer import engine: drop them from ENGINE_INTERNAL_CHECKS: {sorted(ENGINE_INTERNAL_CHECKS - found)}")


def test_the_front_ends_imports_leave_dtensors_to_the_ranks() -> None:
    """``torch.distributed.tensor`` costs most of a second to import (sympy, the op registrations): every
    command line and every pytest (a certificate's child, a worker) would pay it for nothing. The ranks'
    forkserver preloads it instead."""
    from harness.ranks.forkserver import FORKSERVER_PRELOAD

    front_ends = ["harness.pytest_plugin", "harness.cli.run", "harness.cli.nightly", "harness.cli.certify",
                  "harness.cli.bench", "harness.cli.perf", "reports.api"]
    code = f"import sys\nfor name in {front_ends!r}: __import__(name)\nprint('torch.distributed.tensor' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.stdout.split() == ["False"], result.stdout + result.stderr[-2000:]
    assert "torch.distributed.tensor" in FORKSERVER_PRELOAD
