"""The selection a results file was made with, stored beside it, so ``--resume`` continues exactly that.

``<results>.selection.json`` holds the options that selected the cases (every field of
``harness.run.runner.Selection`` and the world sizes: an option added to ``Selection`` is stored without an
edit here) and the selected case ids. Its ``id`` is a hash of both: an id of the selection, not of the
process that ran it, so every part of one night shares it. Reports show a nightly's banner only over
results of the same id, and a nightly diffs only against a night of the same id.

Resuming, an option given again with another value than the stored one contradicts the selection
(``contradictions``), a larger ``--limit`` too: the limit picks a sample (``harness.selection.sampling``), so
another limit is another selection. A file written before selections were stored resumes with the
options given now, and ``legacy_warning`` names the options to pass; a selection file that is there but
cannot be read (truncated, not an object) is no such file: ``read_selection`` raises
``StoredSelectionError`` naming it and what to do, so a resume never continues with today's defaults.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.cases.records import CaseRecord
    from harness.run.runner import Selection

__all__ = [
    "SELECTION_SUFFIX",
    "StoredSelection",
    "StoredSelectionError",
    "contradictions",
    "legacy_warning",
    "option_flag",
    "option_key",
    "read_selection",
    "selection_from_options",
    "selection_options",
    "selection_path",
    "write_selection",
]

SELECTION_SUFFIX = ".selection.json"

#: the command-line flag of a stored option whose flag is not ``--`` + its name with dashes.
_FLAGS = {"filters": "--filter", "world_sizes": "--world-size", "stress": "--stress"}


def option_flag(key: str) -> str:
    """The command-line flag of a stored option: ``world_sizes`` -> ``--world-size``."""
    return _FLAGS.get(key, "--" + key.replace("_", "-"))


def option_key(dest: str) -> str:
    """The stored option an argparse ``dest`` sets: ``filter`` -> ``filters``."""
    by_flag = {flag: key for key, flag in _FLAGS.items()}
    return by_flag.get("--" + dest.replace("_", "-"), dest)


class StoredSelectionError(ValueError):
    """A stored selection file is there but cannot be read; the message names it and what to do."""


@dataclass(frozen=True)
class StoredSelection:
    """What selected the cases of one results file."""

    #: ``selection_options``: the selection's fields and ``world_sizes``.
    options: dict[str, Any]
    #: the full ids of the selected cases, in selection order.
    case_ids: tuple[str, ...]
    #: the part of the selection this file holds when it is a part (``harness.run.parts``): ``index``
    #: (0-based), ``count``, ``partition`` (``Partition.id``) and its ``case_ids``; None for a whole run.
    #: Not part of ``id``: every part of one selection shares it.
    part: dict[str, Any] | None = None

    @property
    def id(self) -> str:
        """A hash of the options and the case ids (in any order): the same for the same selection."""
        text = json.dumps({"options": self.options, "cases": sorted(self.case_ids)}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "options": self.options, "case_ids": list(self.case_ids),
                **({"shard": self.part} if self.part is not None else {})}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StoredSelection":
        if not isinstance(d, Mapping) or not isinstance(d.get("options"), Mapping) or not isinstance(d.get("case_ids"), list):
            raise ValueError("not a selection: an object with options and case_ids")
        part = d.get("shard")
        return cls(dict(d["options"]), tuple(d["case_ids"]), dict(part) if isinstance(part, Mapping) else None)


def selection_options(selection: "Selection", world_sizes: Sequence[int]) -> dict[str, Any]:
    """The options to store: every field of ``selection`` and the world sizes, as JSON data."""
    return {**json.loads(json.dumps(dataclasses.asdict(selection))), "world_sizes": list(world_sizes)}


def selection_from_options(options: Mapping[str, Any]) -> tuple["Selection", list[int]]:
    """The ``Selection`` and world sizes stored options describe; a field they lack keeps its default
    and an option this version does not know is ignored."""
    from harness.run.runner import Selection

    fields = {f.name for f in dataclasses.fields(Selection)}
    return Selection(**{k: v for k, v in options.items() if k in fields}), list(options.get("world_sizes") or [2])


def contradictions(stored: Mapping[str, Any], given: Mapping[str, Any], explicit: Iterable[str]) -> list[str]:
    """``--flag VALUE (stored: VALUE)`` for every option set on the command line (``explicit``, by stored
    key) to another value than the stored selection's. A value that means what the stored one does
    (``--engines builtin,torch-fsdp,torch-fsdp2`` over a stored default) selects the same cases: no
    contradiction."""
    out = []
    for key in explicit:
        if key in stored and key in given and given[key] != stored[key] and not _same_cases(stored, key, given[key]):
            out.append(f"{option_flag(key)} {_shown(given[key])} (the file's: {_shown(stored[key])})")
    return sorted(out)


def _same_cases(stored: Mapping[str, Any], key: str, value: Any) -> bool:
    """Whether the stored options with ``key`` set to ``value`` select the same cases as they do."""
    from harness.run.runner import SelectionError, select_cases

    def ids(options: Mapping[str, Any]) -> list[str]:
        return [case.full_id for case in select_cases(*selection_from_options(options))]

    try:
        return ids({**stored, key: value}) == ids(stored)
    except (SelectionError, TypeError, ValueError):
        return False


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value)) or "none"
    return "none" if value is None else str(value)


def legacy_warning(path: Path, records: Iterable["CaseRecord"]) -> str:
    """The warning for a results file without a stored selection: what its records hold, and the
    options to pass so that ``--resume`` continues it rather than the options' defaults."""
    seen: dict[str, set[str]] = {"engines": set(), "references": set(), "models": set(), "world_sizes": set()}
    for record in records:
        case = record.case
        seen["engines"].add(str(case.get("engine", "?")).partition("=")[0])
        seen["references"].add(str(case.get("reference", "?")))
        seen["models"].add(str(case.get("model", "?")))
        seen["world_sizes"].add(str(case.get("world_size", "?")))
    held = " ".join(f"{option_flag(k)} {','.join(sorted(v))}" for k, v in seen.items() if v)
    return (f"warning: {path} was written before results files stored their selection; --resume continues it "
            f"with the options given now. Pass the options of the run that wrote it (--matrix, --engines, "
            f"--references, --models, --world-size, --filter, --limit ...); its records hold {held or 'no case'}")


def selection_path(results: os.PathLike[str] | str) -> Path:
    """Where the selection of ``results`` is stored: beside it, ``<results>.selection.json``."""
    results = Path(results)
    return results.with_name(results.name + SELECTION_SUFFIX)


def write_selection(results: os.PathLike[str] | str, stored: StoredSelection) -> None:
    """Store ``stored`` beside ``results``, atomically (a killed run keeps the previous file or none)."""
    path = selection_path(results)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(stored.to_dict(), indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_selection(results: os.PathLike[str] | str, unreadable_ok: bool = False) -> StoredSelection | None:
    """The selection stored beside ``results``; None when there is none. One that is there but cannot be
    read raises ``StoredSelectionError`` (naming the file and what to do), or is None with
    ``unreadable_ok`` (the reports: a banner is not worth refusing the results)."""
    path = selection_path(results)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        problem = exc.strerror or str(exc)
    else:
        try:
            return StoredSelection.from_dict(json.loads(text))
        except (ValueError, KeyError, TypeError) as exc:
            problem = str(exc)
    if unreadable_ok:
        return None
    raise StoredSelectionError(
        f"{path} cannot be read ({problem}): it holds the selection that --resume continues; restore it, "
        f"or delete it and resume {Path(results).name} with the options of the run that wrote it")
