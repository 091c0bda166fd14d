"""The config file an API kind's spec names (``NAME=deepspeed:PATH.json``, ``NAME=megatron-fsdp:PATH.json``):
one JSON object whose keys override the adapter's defaults.

Read when the adapter is built, so a bad file stops the run before anything runs
(``harness.engines.registry.resolve``), with one line naming the file and the fix. A path with a comma is
refused: ``--engines`` is a comma list, so the path could not travel in it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_json_object"]


def read_json_object(path: str, kind: str) -> dict[str, Any]:
    """The JSON object in ``path``, the config file of a ``NAME=KIND:PATH.json`` spec; ``ValueError`` naming
    the file and what to change when it has a comma, is missing, is not JSON or holds no object."""
    if "," in path:
        raise ValueError(f"{kind} config {path!r}: a path with a comma cannot travel in a comma list of engines; "
                         "move or rename the file")
    try:
        config = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{kind} config {path!r} does not exist; give NAME={kind}:PATH.json an existing file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{kind} config {path!r} is not JSON ({exc}); fix the file") from None
    if not isinstance(config, dict):
        raise ValueError(f"{kind} config {path!r} must hold a JSON object, not {type(config).__name__}")
    return config
