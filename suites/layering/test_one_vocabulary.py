"""One vocabulary: the verdict groups and their severity are defined once, in ``harness.cases.records``, and every
other module imports them (issue #37). A module of harness/ or reports/ that binds a name to its own
literal group of verdicts (a tuple, list, set or dict keyed by them) is a second definition that can drift."""

from __future__ import annotations

import ast
from pathlib import Path

from harness.cases.records import ABORTED, ERRORED, FAILING, SEVERITY, VERDICTS

ROOT = Path(__file__).resolve().parents[2]
#: where the verdict groups live.
HOME = "harness/cases/records.py"
#: ``(path, name)`` of module-level literals that spell other vocabularies with the same words.
OTHER_VOCABULARIES = frozenset({
    ("reports/certificate.py", "_COLOURS"),  # a certified family's status (pass, fail, unsupported)
})


def _verdict_literal(node: ast.expr) -> list[str] | None:
    """The strings of a literal made of two or more verdicts only (a dict: its keys), else None."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        items = node.elts
    elif isinstance(node, ast.Dict):
        items = [k for k in node.keys if k is not None]
    else:
        return None
    words = [i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)]
    return words if len(words) >= 2 and len(words) == len(items) and set(words) <= set(VERDICTS) else None


def verdict_groups(root: Path, packages: tuple[str, ...]) -> dict[tuple[str, str], list[str]]:
    """``{(path, name): verdicts}`` of every module-level name of ``packages`` bound to a verdict literal."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
                words = _verdict_literal(node.value) if getattr(node, "value", None) is not None else None
                for target in targets:
                    if words and isinstance(target, ast.Name):
                        found[(path.relative_to(root).as_posix(), target.id)] = words
    return found


def test_a_second_definition_is_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "m.py").write_text(
        'BAD = ("fail", "error")\nRANK: dict = {"crash": 0, "pass": 1}\nMIXED = ("fail", "ok")\nONE = ("fail",)\n'
        'def f():\n    LOCAL = ("fail", "error")\n'
    )
    assert verdict_groups(tmp_path, ("pkg",)) == {("pkg/m.py", "BAD"): ["fail", "error"], ("pkg/m.py", "RANK"): ["crash", "pass"]}


def test_verdict_groups_are_defined_once_in_the_records_module() -> None:
    found = {k: v for k, v in verdict_groups(ROOT, ("harness", "reports")).items() if k[0] != HOME}
    assert not set(found) - OTHER_VOCABULARIES, (
        f"verdict groups defined outside {HOME} (import them from harness.cases.records): {sorted(set(found) - OTHER_VOCABULARIES)}")
    assert not OTHER_VOCABULARIES - set(found), f"gone: drop from OTHER_VOCABULARIES: {sorted(OTHER_VOCABULARIES - set(found))}"


def test_the_groups_and_the_severity_agree() -> None:
    assert set(SEVERITY) == set(VERDICTS), "every verdict has a severity"
    assert set(ABORTED) <= set(ERRORED) <= set(FAILING) <= set(VERDICTS)
    assert set(VERDICTS) - set(FAILING) == {"pass", "unsupported"}
    # Worst first: anything failing is worse than unsupported, which is worse than a pass.
    assert max(SEVERITY[v] for v in FAILING) < SEVERITY["unsupported"] < SEVERITY["pass"]
    assert max(SEVERITY[v] for v in ERRORED) < SEVERITY["fail"] == SEVERITY["flaky"]
