"""No Python module of the project is over 600 lines: a longer one holds more than one concept and
is split along them (the tree's own modules, the suites and the examples alike)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the most lines a module may have.
MAX_LINES = 600
#: every directory of the tree that holds Python source.
PACKAGES = ("engine", "harness", "reports", "suites", "examples")


def oversized_modules(root: Path, packages: tuple[str, ...], limit: int) -> dict[str, int]:
    """``{path relative to root: lines}`` of every ``.py`` file under ``root/<package>`` over ``limit`` lines."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            lines = len(path.read_text().splitlines())
            if lines > limit:
                found[path.relative_to(root).as_posix()] = lines
    return found


def test_oversized_module_is_found(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    (tmp_path / "pkg" / "short.py").write_text("x = 1\n" * 3)
    (tmp_path / "pkg" / "sub" / "long.py").write_text("x = 1\n" * 4)
    assert oversized_modules(tmp_path, ("pkg",), 3) == {"pkg/sub/long.py": 4}


def test_no_module_over_the_limit() -> None:
    found = oversized_modules(ROOT, PACKAGES, MAX_LINES)
    assert not found, f"modules over {MAX_LINES} lines (split each along its concepts): {found}"
