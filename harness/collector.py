"""The collector: appends one ``CaseRecord`` per finished case to a JSON Lines results file.

Durability is the point of this module. Every record is one line, written with a single
``write``, flushed and ``os.fsync``-ed before ``append`` returns, so a run that is killed (OOM,
CI timeout, a hung collective) keeps every case it finished. A line cut mid-write by such a kill
is never dropped in silence: ``read_records`` hands it back as a ``BadLine`` and the reports show it.

Under pytest-xdist every worker writes its own file (``worker_results_path``) so no two
processes ever append to one file; the controller merges them afterwards (``merge_results``).

Reading needs nothing but the standard library and ``harness.records``, so reports can read
results without importing torch; only ``run_info`` imports torch, lazily.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from harness.case import CaseConfig
from harness.records import CaseRecord, RunInfo

#: how many characters of an unreadable line a ``BadLine`` keeps: enough to recognise the case.
BAD_LINE_HEAD = 200

PathLike = str | os.PathLike[str]


@dataclass(frozen=True)
class BadLine:
    """A line of a results file that is not a readable record (cut by a kill, or corrupt)."""

    #: the results file it came from.
    path: str
    #: 1-based line number in that file.
    line: int
    #: why it could not be read (JSON error, schema error ...).
    reason: str
    #: the first ``BAD_LINE_HEAD`` characters of the line, to recognise the case it was.
    head: str

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "line": self.line, "reason": self.reason, "head": self.head}

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}: {self.head!r}"


def _new_run_id() -> str:
    # Sortable by start time; the random suffix separates runs started in the same second
    # (e.g. several CI shards).
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def _git_rev(repo_dir: Path) -> str | None:
    """HEAD of the repository holding this project, ``-dirty`` if tracked files differ; None outside git."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(repo_dir), "rev-parse", "HEAD"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout.strip()
        # Results from uncommitted code cannot be reproduced from the rev alone: say so.
        dirty = subprocess.run(
            ["git", "-C", str(repo_dir), "diff", "--quiet", "HEAD", "--"],
            capture_output=True, timeout=10,
        ).returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("-dirty" if dirty else "") if rev else None


def run_info(backend: str, run_id: str | None = None) -> RunInfo:
    """Facts about this run: host, torch version, GPU and NCCL version (on CUDA), git revision."""
    import torch  # lazily: readers of results files must not need torch

    gpu: str | None = None
    nccl: str | None = None
    if torch.cuda.is_available():
        gpu = torch.cuda.get_device_name(0)
        try:
            version = torch.cuda.nccl.version()
            nccl = ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)
        except (AttributeError, RuntimeError):
            nccl = None  # a CUDA build without NCCL
    return RunInfo(
        run_id=run_id or _new_run_id(),
        host=socket.gethostname(),
        torch_version=torch.__version__,
        backend=backend,
        gpu=gpu,
        nccl_version=nccl,
        git_rev=_git_rev(Path(__file__).resolve().parent.parent),
    )


def record_full_id(record: CaseRecord) -> str:
    """``CaseConfig.full_id`` of the case a record describes."""
    try:
        return CaseConfig.from_dict(record.case).full_id
    except (TypeError, ValueError):
        # A record from an older schema whose case no longer validates still has an identity.
        case = record.case
        return f"{str(case.get('engine', '?')).partition('=')[0]}:{case.get('reference', '?')}:{record.case_id}"


def _jsonable(value: Any) -> Any:
    # ``detail`` is free-form (paths, tuples, exceptions ...): writing its repr beats losing the
    # whole record of a case that ran for minutes.
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=repr)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return repr(value)


def _parse_line(path: str, number: int, text: str) -> CaseRecord | BadLine:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return BadLine(path, number, f"not JSON: {e.msg} (column {e.colno}); cut by a killed run?", text[:BAD_LINE_HEAD])
    if not isinstance(data, dict):
        return BadLine(path, number, f"a JSON {type(data).__name__}, not a record object", text[:BAD_LINE_HEAD])
    try:
        return CaseRecord.from_dict(data)
    except (TypeError, ValueError, KeyError) as e:
        return BadLine(path, number, f"not a CaseRecord: {e}", text[:BAD_LINE_HEAD])


def _as_paths(paths: PathLike | Iterable[PathLike]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        return [Path(paths)]
    return [Path(p) for p in paths]


def read_records(paths: PathLike | Iterable[PathLike]) -> tuple[list[CaseRecord], list[BadLine]]:
    """Every record of the given results files, in file order, and every line that is not one.

    Blank lines are skipped; any other unreadable line (a record cut by a kill, a newer schema,
    garbage) comes back as a ``BadLine`` so callers can show it.
    """
    records: list[CaseRecord] = []
    bad: list[BadLine] = []
    for path in _as_paths(paths):
        # errors="replace": a kill can cut a multi-byte character too; that line becomes a
        # BadLine instead of making the whole file unreadable.
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, start=1):
                text = line.rstrip("\n")
                if not text.strip():
                    continue
                parsed = _parse_line(str(path), number, text)
                (bad if isinstance(parsed, BadLine) else records).append(parsed)
    return records, bad


class ResultWriter:
    """Appends records to one results file, durably, one JSON line per case.

    Use as a context manager. With ``resume=True`` an existing file is continued (its cases are in
    ``recorded_ids()`` so a runner can skip them); without it an existing non-empty file is an
    error rather than silently mixed with or replaced by a new run.
    """

    def __init__(self, path: PathLike, run: RunInfo, resume: bool = False) -> None:
        self.path = Path(path)
        self.run = run
        #: full ids of the cases in the file, read at open and kept up to date by ``append``.
        self._ids: set[str] = set()
        #: bad lines found in the file being resumed, for the caller to report.
        self.bad_lines: list[BadLine] = []
        # A watchdog thread may record a timeout while the main thread records a result.
        self._lock = threading.Lock()

        exists = self.path.exists() and self.path.stat().st_size > 0
        if exists and not resume:
            raise FileExistsError(
                f"ResultWriter: {self.path} already holds results; pass resume=True to continue it, "
                "or choose a new path"
            )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if exists:
            records, self.bad_lines = read_records(self.path)
            self._ids = {record_full_id(r) for r in records}
        self._file = open(self.path, "a", encoding="utf-8")
        if exists and not self._ends_with_newline():
            # The previous run was killed mid-line: end that line so it stays one BadLine instead
            # of swallowing the first record of this run.
            self._write_durably("\n")

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _write_durably(self, text: str) -> None:
        self._file.write(text)
        self._file.flush()
        os.fsync(self._file.fileno())

    def append(self, record: CaseRecord) -> None:
        """Write one record as one line and make it durable before returning.

        Fills ``record.run`` with this writer's run and ``record.time`` with now if they are unset.
        """
        if record.run is None:
            record.run = self.run
        if not record.time:
            record.time = time.time()
        line = json.dumps(record.to_dict(), default=_jsonable, ensure_ascii=False) + "\n"
        with self._lock:
            if self._file.closed:
                raise ValueError(f"ResultWriter: {self.path} is closed; append inside the `with` block")
            self._write_durably(line)
            self._ids.add(record_full_id(record))

    def recorded_ids(self) -> set[str]:
        """``CaseConfig.full_id`` of every case in the file, resumed ones and appended ones."""
        with self._lock:
            return set(self._ids)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> "ResultWriter":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def worker_results_path(base: PathLike) -> Path:
    """This process's results file: ``base`` itself, or ``results.gw3.jsonl`` on xdist worker gw3.

    Each pytest-xdist worker appends to its own file, so writes of two workers never interleave.
    """
    base = Path(base)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return base
    return base.with_name(f"{base.stem}.{worker}{base.suffix}")


def worker_results_files(base: PathLike) -> list[Path]:
    """The per-worker files ``worker_results_path`` made for ``base``, sorted by worker number."""
    base = Path(base)

    def worker_number(p: Path) -> tuple[int, str]:
        tag = p.name[len(base.stem) + 3 : len(p.name) - len(base.suffix)]
        return (int(tag) if tag.isdigit() else 1 << 30, p.name)

    return sorted(base.parent.glob(f"{base.stem}.gw*{base.suffix}"), key=worker_number)


def merge_results(paths: PathLike | Iterable[PathLike], out: PathLike) -> int:
    """Concatenate results files into ``out`` (replaced atomically); returns the records merged.

    Lines are copied verbatim, bad ones included, so a cut record stays visible to the reports of
    the merged file instead of vanishing in the merge.
    """
    sources = _as_paths(paths)
    out = Path(out)
    if any(p.resolve() == out.resolve() for p in sources if p.exists()):
        raise ValueError(f"merge_results: out={out} is also an input; write the merge to a new path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    merged = 0
    with open(tmp, "w", encoding="utf-8") as dst:
        for path in sources:
            with open(path, encoding="utf-8", errors="replace") as src:
                for number, line in enumerate(src, start=1):
                    text = line.rstrip("\n")
                    if not text.strip():
                        continue
                    if isinstance(_parse_line(str(path), number, text), CaseRecord):
                        merged += 1
                    dst.write(text + "\n")
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, out)
    return merged
