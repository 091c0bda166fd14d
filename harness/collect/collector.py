"""The collector: appends one ``CaseRecord`` per finished case to a JSON Lines results file.

Durability is the point of this module. Every record is one line, written with a single
``write``, flushed and ``os.fsync``-ed before ``append`` returns, so a run that is killed (OOM,
CI timeout, a hung collective) keeps every case it finished. A line cut mid-write by such a kill
is never dropped in silence: ``read_records`` hands it back as a ``BadLine`` and the reports show it.

Under pytest-xdist every worker writes its own file (``worker_results_path``) so no two
processes ever append to one file; the controller merges them afterwards (``merge_results``).

One run writes a results file at a time: ``ResultWriter`` holds an advisory ``flock`` on it (the
kernel drops it when the process dies, even by ``kill -9``) and names its owner, pid and start time,
in a ``<file>.lock`` note beside it, so a second run on the same file refuses instead of recording
every case twice. A write that fails (disk full) raises ``ResultWriteError`` naming the file; every
line written before it was already flushed and synced. A file deleted or replaced while the run writes
it (its lines would go to a file no path names) raises ``ResultsFileGone`` at the next record and at
``check_present``, which a run calls at its end.

Control characters (a NUL byte written by a dying process, say) are escaped where lines are read
(``printable``), so nothing downstream copies them raw into a report. A UTF-8 byte order mark at the
start of a file (an editor's) is skipped; a line longer than ``MAX_LINE_CHARS`` (``/dev/zero``, a file
that is no results file) is one unreadable line, read in bounded pieces, never held whole.

Reading needs nothing but the standard library and ``harness.cases.records``, so reports can read
results without importing torch; only ``run_info`` imports torch, lazily.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import secrets
import socket
import subprocess
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from harness.cases.case import CaseConfig
from harness.cases.records import CaseRecord, RunInfo

if TYPE_CHECKING:
    from harness.ranks.placement import Lane

#: how many characters of an unreadable line a ``BadLine`` keeps: enough to recognise the case.
BAD_LINE_HEAD = 200

#: the longest line read as a record (a record's tracebacks and stacks are far shorter); a longer line
#: is unreadable, and its rest is skipped in pieces of this size, so no input grows memory without bound.
MAX_LINE_CHARS = 16 * 1024 * 1024

PathLike = str | os.PathLike[str]

#: file systems that hold no results: writing there fails, or means something else than a file.
VIRTUAL_ROOTS = ("/proc", "/sys")

# C0 controls but tab and newline, DEL and the C1 controls: unreadable in a report, and a NUL cuts
# a C string short.
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every control character but tab and newline written as an escape (``\\x00``)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m[0]):02x}", text)


def _printable_tree(value: Any) -> Any:
    if isinstance(value, str):
        return printable(value)
    if isinstance(value, dict):
        return {printable(k) if isinstance(k, str) else k: _printable_tree(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_printable_tree(v) for v in value]
    return value


class ResultWriteError(OSError):
    """Writing the results file failed (disk full, file system gone); the message names the file."""

    #: whether the records written before the error are still in the file (a resume goes on from them).
    records_kept = True


class ResultsFileGone(ResultWriteError):
    """The results file was deleted or replaced while a run wrote it: what it wrote is not in the file
    its path names now."""

    records_kept = False


class ResultsLocked(RuntimeError):
    """Another live run is writing the results file."""


def out_path_problem(path: PathLike) -> str | None:
    """Why ``path`` cannot be a results file, or None when it can (checked before any case runs).

    A path under ``/proc`` or ``/sys``, a directory, or a path below a file is refused; a special
    file that accepts writes (``/dev/null``, ``/dev/full``) is allowed, its write errors surface
    from ``ResultWriter.append``.
    """
    path = Path(path)
    resolved = Path(os.path.abspath(path))
    for root in VIRTUAL_ROOTS:
        if resolved == Path(root) or Path(root) in resolved.parents:
            return f"{path} is under {root}, a virtual file system that holds no files; choose a path on disk"
    if path.is_dir():
        return f"{path} is a directory; name a file in it, e.g. {path / 'results.jsonl'}"
    for parent in resolved.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"{parent} is a file, so {path} cannot be created below it; choose another path"
            if not os.access(parent, os.W_OK | os.X_OK) and not path.exists():
                return f"cannot create files in {parent} (permission denied); choose another path"
            break
    if path.exists() and not os.access(path, os.W_OK):
        return f"{path} is not writable (permission denied); choose another path"
    return None


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


def latest_records(records: Iterable[CaseRecord]) -> dict[str, CaseRecord]:
    """The latest record of every case, by full id: the record with the greatest ``time`` wins, and
    among equal times the later one in file order (the rule of ``reports.matrix.latest``)."""
    ordered = sorted(enumerate(records), key=lambda item: (item[1].time, item[0]))
    return {record_full_id(record): record for _, record in ordered}


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


def run_info(lanes: "Sequence[Lane] | str", run_id: str | None = None) -> RunInfo:
    """Facts about this run: where its pools run (backend, device, ranks per GPU of ``lanes``; a plain
    backend name means CPU ranks), host, torch version, GPU and NCCL version (on CUDA), git revision."""
    import torch  # lazily: readers of results files must not need torch

    from harness.ranks.placement import Lane

    if isinstance(lanes, str):
        lanes = [Lane(1, name, None) for name in lanes.split(",")]
    backend = ",".join(sorted({lane.backend for lane in lanes})) or "gloo"
    device = ",".join(sorted({lane.device for lane in lanes})) or "cpu"
    per_gpu = [lane.ranks_per_gpu for lane in lanes if lane.ranks_per_gpu is not None]
    gpu: str | None = None
    nccl: str | None = None
    if torch.cuda.is_available() and "cuda" in device:
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
        git_rev=_git_rev(Path(__file__).resolve().parents[2]),
        device=device,
        ranks_per_gpu=max(per_gpu) if per_gpu else None,
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
    head = printable(text[:BAD_LINE_HEAD])
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        return BadLine(path, number, f"not JSON: {e.msg} (column {e.colno}); cut by a killed run?", head)
    if not isinstance(data, dict):
        return BadLine(path, number, f"a JSON {type(data).__name__}, not a record object", head)
    try:
        # JSON escapes (``\u0000``) decode to control characters: escape them like raw ones.
        return CaseRecord.from_dict(_printable_tree(data))
    except (TypeError, ValueError, KeyError) as e:
        return BadLine(path, number, printable(f"not a CaseRecord: {e}"), head)


def _as_paths(paths: PathLike | Iterable[PathLike]) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        return [Path(paths)]
    return [Path(p) for p in paths]


def _lines(path: Path) -> Iterator[tuple[int, str, BadLine | None]]:
    """Every line of ``path`` that is not blank: its number, its text (without the newline) and, for a
    line longer than ``MAX_LINE_CHARS``, the ``BadLine`` it is (its text then only the head). The rest
    of an over-long line is skipped in bounded pieces; in a file that is not a regular file (a device,
    ``/dev/zero``, whose line never ends) reading stops there."""
    regular = path.is_file()
    # errors="replace": a kill can cut a multi-byte character too; that line becomes a BadLine instead
    # of making the whole file unreadable. utf-8-sig: a byte order mark is no part of the first record.
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        number = 0
        while line := f.readline(MAX_LINE_CHARS + 1):
            number += 1
            if len(line) <= MAX_LINE_CHARS or line.endswith("\n"):
                text = line.rstrip("\n")
                if text.strip():
                    yield number, text, None
                continue
            head = printable(line[:BAD_LINE_HEAD])
            rest = "skipped" if regular else f"not read, nor the rest of {path} (not a regular file)"
            yield number, head, BadLine(str(path), number, f"longer than {MAX_LINE_CHARS} characters, no record; its rest {rest}", head)
            if not regular:
                return
            while (rest_piece := f.readline(MAX_LINE_CHARS)) and not rest_piece.endswith("\n"):
                pass


def read_records(paths: PathLike | Iterable[PathLike]) -> tuple[list[CaseRecord], list[BadLine]]:
    """Every record of the given results files, in file order, and every line that is not one.

    Blank lines are skipped; any other unreadable line (a record cut by a kill, a newer schema,
    garbage, a line longer than ``MAX_LINE_CHARS``) comes back as a ``BadLine`` so callers can show it.
    """
    records: list[CaseRecord] = []
    bad: list[BadLine] = []
    for path in _as_paths(paths):
        for number, text, too_long in _lines(path):
            parsed = too_long or _parse_line(str(path), number, text)
            (bad if isinstance(parsed, BadLine) else records).append(parsed)
    return records, bad


class ResultWriter:
    """Appends records to one results file, durably, one JSON line per case.

    Use as a context manager. With ``resume=True`` an existing file is continued (its cases are in
    ``recorded_ids()``, their latest verdicts in ``latest_verdicts()``, so a runner can skip or rerun
    them); without it an existing non-empty file is an error rather than silently mixed with or
    replaced by a new run. While open, the writer holds an exclusive ``flock`` on the file:
    a second writer raises ``ResultsLocked`` naming the first (see the module docstring).
    """

    def __init__(self, path: PathLike, run: RunInfo, resume: bool = False) -> None:
        self.path = Path(path)
        self.run = run
        #: full ids of the cases in the file, read at open and kept up to date by ``append``.
        self._ids: set[str] = set()
        #: the latest record of every case in the file when it was opened.
        self.resumed: dict[str, CaseRecord] = {}
        #: bad lines found in the file being resumed, for the caller to report.
        self.bad_lines: list[BadLine] = []
        # A watchdog thread may record a timeout while the main thread records a result.
        self._lock = threading.Lock()
        self._note: Path | None = None

        problem = out_path_problem(self.path)
        if problem:
            raise ValueError(f"ResultWriter: {problem}")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        #: a regular file can be deleted under the run (``check_present``); ``/dev/null`` cannot.
        self._regular = self.path.is_file()
        try:
            self._take_lock()
            exists = self.path.is_file() and self.path.stat().st_size > 0
            if exists and not resume:
                raise FileExistsError(
                    f"ResultWriter: {self.path} already holds results; pass resume=True to continue it, "
                    "or choose a new path"
                )
            if exists:
                records, self.bad_lines = read_records(self.path)
                self.resumed = latest_records(records)
                self._ids = set(self.resumed)
                if not self._ends_with_newline():
                    # The previous run was killed mid-line: end that line so it stays one BadLine
                    # instead of swallowing the first record of this run.
                    self._write_durably("\n")
        except BaseException:
            self._release()
            raise

    # -- the lock ------------------------------------------------------------------------------------

    def _note_path(self) -> Path:
        return self.path.with_name(self.path.name + ".lock")

    def _take_lock(self) -> None:
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = "another run"
            try:
                owner = self._note_path().read_text(encoding="utf-8").strip() or owner
            except OSError:
                pass
            raise ResultsLocked(
                f"{self.path} is being written by {owner}; wait for it to end, or choose another path"
            ) from None
        # The note only names the owner; the flock decides. A note left by a killed run is
        # overwritten here and never blocks. Special files (``/dev/null``) get no note beside them.
        if self.path.is_file():
            note = self._note_path()
            try:
                note.write_text(f"pid {os.getpid()} started {time.strftime('%Y-%m-%d %H:%M:%S%z')}\n", encoding="utf-8")
                self._note = note
            except OSError:
                self._note = None

    def _release(self) -> None:
        if self._note is not None:
            self._note.unlink(missing_ok=True)  # before the flock goes, so it never names a later run
            self._note = None
        try:
            self._file.close()  # closing the descriptor releases the flock
        except OSError:
            # Data left in the buffer by a failed write fails again here: it was reported then.
            # Closing the descriptor by hand releases the lock all the same.
            try:
                os.close(self._file.fileno())
            except (OSError, ValueError):
                pass

    # -- writing ---------------------------------------------------------------------------------------

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _write_durably(self, text: str) -> None:
        try:
            self._file.write(text)
            self._file.flush()
        except OSError as exc:
            raise ResultWriteError(exc.errno, f"cannot write results to {self.path}: {exc.strerror or exc}") from exc
        try:
            os.fsync(self._file.fileno())
        except OSError as exc:
            # A character device or pipe (``/dev/null``) cannot be synced: the write went through.
            if exc.errno not in (errno.EINVAL, errno.EROFS, errno.ENOTSUP):
                raise ResultWriteError(exc.errno, f"cannot sync results to {self.path}: {exc.strerror or exc}") from exc

    def check_present(self) -> None:
        """Raise ``ResultsFileGone`` when the file this writer appends to is no longer the one its path
        names (deleted, or replaced by another file)."""
        if not self._regular or self._file.closed:
            return
        try:
            named = os.stat(self.path)
        except FileNotFoundError:
            what = "deleted"
        else:
            held = os.fstat(self._file.fileno())
            if (named.st_dev, named.st_ino) == (held.st_dev, held.st_ino):
                return
            what = "replaced by another file"
        raise ResultsFileGone(f"{self.path} was {what} while this run wrote it: the records this run wrote went "
                              "with it; rerun into a path that nothing else deletes")

    def append(self, record: CaseRecord) -> None:
        """Write one record as one line and make it durable before returning.

        Fills ``record.run`` with this writer's run and ``record.time`` with now if they are unset.
        Raises ``ResultWriteError`` (naming the file) when the write fails; the records appended
        before stay in the file. Raises ``ResultsFileGone`` when the file was deleted or replaced.
        """
        if record.run is None:
            record.run = self.run
        if not record.time:
            record.time = time.time()
        line = record.to_json(default=_jsonable) + "\n"
        with self._lock:
            if self._file.closed:
                raise ValueError(f"ResultWriter: {self.path} is closed; append inside the `with` block")
            self.check_present()
            self._write_durably(line)
            self._ids.add(record_full_id(record))

    def recorded_ids(self) -> set[str]:
        """``CaseConfig.full_id`` of every case in the file, resumed ones and appended ones."""
        with self._lock:
            return set(self._ids)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._release()

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

    Lines are copied verbatim, bad ones included (of a line longer than ``MAX_LINE_CHARS``, its head),
    so a cut record stays visible to the reports of the merged file instead of vanishing in the merge.
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
            for number, text, too_long in _lines(path):  # an over-long line keeps its head: still unreadable
                if too_long is None and isinstance(_parse_line(str(path), number, text), CaseRecord):
                    merged += 1
                dst.write(text + "\n")
        dst.flush()
        os.fsync(dst.fileno())
    os.replace(tmp, out)
    return merged
