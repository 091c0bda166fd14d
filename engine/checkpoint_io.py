"""Reading and writing checkpoint files, with errors that name the file and what to do.

``torch.load`` on a truncated file says "PytorchStreamReader failed reading zip archive" and
``torch.distributed.checkpoint`` reports a missing or damaged directory per rank; neither names
the path. These wrappers raise :class:`CheckpointError` with the path and the cause, and write
``torch.save`` files atomically (a temporary file renamed into place), so an interrupted save never
leaves a truncated checkpoint under the final name.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

__all__ = ["CheckpointError", "dcp_load", "dcp_save", "load", "save"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be read or written; the message names the path."""


def save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save(obj)`` to ``path`` through a temporary file in the same directory."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, Exception):
            raise CheckpointError(f"cannot write checkpoint {path}: {e}") from e
        raise


def load(path: str | os.PathLike[str], map_location: Any = None, weights_only: bool = True) -> Any:
    """``torch.load(path)``; a missing, truncated or corrupt file raises :class:`CheckpointError`.

    ``weights_only=False`` is needed for sharded values (``DTensor``, ``ShardedTensor``).
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist: check the path (and that the save finished)")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as e:  # torch.load raises RuntimeError, EOFError, UnpicklingError, ...
        raise CheckpointError(
            f"cannot read checkpoint {path} ({os.path.getsize(path)} bytes): {type(e).__name__}: {e}. "
            "The file is truncated or not a torch.save file: save it again"
        ) from e


def _cause(e: BaseException) -> str:
    """One line per failing rank for DCP's exception (its own message is every rank's traceback)."""
    failures = getattr(e, "failures", None)
    if not failures:
        return f"{type(e).__name__}: {e}"
    parts = []
    for rank, failure in sorted(failures.items()):
        # A (exception, traceback) pair in torch 2.11 to 2.13.
        exc = failure[0] if isinstance(failure, tuple) and failure else getattr(failure, "exception", failure)
        first = str(exc).splitlines()[0] if str(exc) else ""
        parts.append(f"rank {rank}: {type(exc).__name__}: {first}")
    return "; ".join(parts)


def dcp_save(state_dict: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """``torch.distributed.checkpoint.save`` into the directory ``path`` (every rank calls it)."""
    path = os.fspath(path)
    try:
        dcp.save(state_dict, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"cannot write distributed checkpoint {path}: {_cause(e)}") from e


def dcp_load(state_dict: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """``torch.distributed.checkpoint.load`` from ``path`` into ``state_dict`` (in place; every rank)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"distributed checkpoint {path} is not a directory: check the path")
    try:
        dcp.load(state_dict, checkpoint_id=path)
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(
            f"cannot read distributed checkpoint {path}: {_cause(e)}. Its files are missing, "
            "truncated or from another model: save it again"
        ) from e
