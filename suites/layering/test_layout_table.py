"""The Layout section of ``docs/architecture.md`` names every module of ``engine/`` and ``harness/``: a new
module gets its word there, in its layer's entry, so a reader following a case finds each one and what it is."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _layout_section() -> str:
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index("\n## Layout\n")
    return text[start : text.index("\n## ", start + 1)]


def unnamed_modules(section: str, root: Path = ROOT) -> list[str]:
    """Modules of ``engine/`` and ``harness/`` that ``section`` names neither by path nor by bare name
    (in backticks)."""
    modules = [p.relative_to(root) for pkg in ("engine", "harness") for p in sorted((root / pkg).rglob("*.py"))]
    return [str(m) for m in modules if m.stem != "__init__" and f"`{m}`" not in section and f"`{m.stem}`" not in section]


def test_the_layout_table_names_every_module() -> None:
    missing = unnamed_modules(_layout_section())
    assert not missing, f"docs/architecture.md's Layout section does not name {missing}: give each a word in its layer's entry"


def test_a_module_left_out_of_the_table_is_found(tmp_path: Path) -> None:
    for name in ("engine/unit.py", "harness/cli/run.py", "harness/new_thing.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    section = "| engine | `engine/` | `unit` |\n| front ends | `harness/cli/run.py` |"
    assert unnamed_modules(section, tmp_path) == ["harness/new_thing.py"]
