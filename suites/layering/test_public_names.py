"""The names plug-in authors use (``harness.EngineAdapter``, ``ParamSlice``, ``canonical_name``, the registry's
functions...) import from the ``harness`` package itself, whichever stage defines them (docs/engines.md, "The
public names"), and ``import harness`` alone loads neither torch nor a stage."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import harness

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(harness.PUBLIC))
def test_public_name_is_the_defining_modules_object(name: str) -> None:
    assert getattr(harness, name) is getattr(importlib.import_module(harness.PUBLIC[name]), name)


def test_the_documented_names_are_public() -> None:
    for name in ("EngineAdapter", "FSDP1Adapter", "ParamSlice", "canonical_name", "register", "resolve", "Rule",
                 "register_model", "OwnedStep"):
        assert name in harness.__all__, name
    text = (ROOT / "docs" / "engines.md").read_text()
    assert not [name for name in harness.PUBLIC if f"`{name}`" not in text], "docs/engines.md names every public name"


def test_an_unknown_name_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        harness.no_such_name  # noqa: B018


def test_importing_harness_loads_no_stage() -> None:
    code = "import sys, harness; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('harness.')))"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
