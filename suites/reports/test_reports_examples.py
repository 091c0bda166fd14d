"""The example reports under ``reports/examples/`` are outputs only: no generator lives there (generators
are in ``examples/``), and no generated file names the machine it was made on by an absolute path."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "reports" / "examples"
#: the start of an absolute path into a machine's own directories (a home, a scratch or work directory).
MACHINE_PATH = re.compile(r"(?<![\w.])/(?:home|root|work|tmp|Users|scratch|mnt)/")
TEXT = {".csv", ".html", ".json", ".jsonl", ".md", ".txt"}


def machine_paths(root: Path) -> list[str]:
    """``file:line: path`` for every absolute machine path in the text files under ``root``."""
    found = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in TEXT):
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for match in MACHINE_PATH.finditer(line):
                found.append(f"{path.relative_to(root)}:{number}: {line[match.start():match.start() + 60]}")
    return found


def test_no_generator_lives_among_the_examples() -> None:
    scripts = sorted(str(p.relative_to(ROOT)) for p in EXAMPLES.rglob("*.py"))
    assert not scripts, f"{scripts}: a generator belongs in examples/, its output in reports/examples/"


def test_no_example_names_the_machine_it_was_made_on() -> None:
    found = machine_paths(EXAMPLES)
    assert not found, "absolute machine paths in reports/examples (write them relative to the run): " + "; ".join(found[:10])


def test_a_machine_path_is_found(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"stack": "File \\"/home/me/fsdp/harness/pool.py\\", line 3"}\n{"x": "harness/ranks/pool.py"}\n')
    (tmp_path / "b.md").write_text("see <stdlib>/threading.py and https://example.org/tmp/x\n")
    assert machine_paths(tmp_path) == ['a.jsonl:1: /home/me/fsdp/harness/pool.py\\", line 3"}']
