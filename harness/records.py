"""The result record: what one case produced, as the collector writes it and reports read it.

One record is one JSON object on one line of a results file (JSON Lines). The schema is plain
data so the report builder never needs torch or the harness's runtime.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

#: ``flaky``: the runs of a repeated case disagreed (``CaseRecord.outcomes`` counts each); never a pass.
Verdict = Literal["pass", "fail", "unsupported", "error", "timeout", "crash", "flaky"]
VERDICTS: tuple[str, ...] = get_args(Verdict)

#: bump when a field changes meaning; readers refuse newer majors.
SCHEMA_VERSION = 1


@dataclass
class QuantityError:
    """The worst disagreement of one compared quantity (e.g. ``loss``, ``grad:0.weight``, ``param:*``)."""

    name: str
    max_abs: float
    max_rel: float
    atol: float
    rtol: float
    passed: bool
    #: worst element of ``|actual - expected| / (atol + rtol * |expected|)``: the error relative to
    #: what ``torch.testing.assert_close`` allows; ``<= 1`` passes. Reports colour by it.
    ratio: float = 0.0


@dataclass
class RunInfo:
    """Facts about the run a record came from, the same for every case of one run."""

    run_id: str
    host: str
    torch_version: str
    #: the process-group backend(s) of the run's pools (``gloo``, ``nccl``, ``gloo,nccl``).
    backend: str
    gpu: str | None = None
    nccl_version: str | None = None
    git_rev: str | None = None
    #: where the ranks' tensors live (``cpu``, ``cuda``, ``cpu,cuda``): not the backend, gloo runs on both.
    #: Records written before it existed read as ``cpu`` where the backend is gloo.
    device: str | None = None
    #: most ranks of one pool on one GPU (1: one GPU per rank; 2+: gloo ranks sharing GPUs); None on CPU.
    ranks_per_gpu: int | None = None

    def placement_text(self) -> str:
        """``gloo on cuda, 2 ranks per GPU``: the run's placement in one phrase for headers."""
        device = self.device or ("cuda" if "nccl" in self.backend else "cpu")
        text = f"{self.backend} on {device}"
        if self.ranks_per_gpu:
            text += ", one GPU per rank" if self.ranks_per_gpu == 1 else f", {self.ranks_per_gpu} ranks per GPU"
        return text


@dataclass
class CaseRecord:
    """Everything known about one case after it ran (or failed to)."""

    #: ``CaseConfig.to_dict()`` of the case; every axis is a key.
    case: dict[str, Any]
    case_id: str
    verdict: Verdict
    #: one line: why it failed, why it is unsupported, or where it hung/crashed. Empty on pass.
    reason: str = ""
    run: RunInfo | None = None
    #: seconds since the epoch when the case finished.
    time: float = 0.0
    errors: list[QuantityError] = field(default_factory=list)
    #: None when not checked.
    deterministic: bool | None = None
    wall_s: float = 0.0
    peak_mem_bytes: int = 0
    bytes_all_gathered: int = 0
    bytes_reduce_scattered: int = 0
    #: per-rank details kept for debugging (stacks of a timeout, stderr tail of a crash ...).
    detail: dict[str, Any] = field(default_factory=dict)
    schema: int = SCHEMA_VERSION
    #: runs per verdict of a repeated case (``{"pass": 3, "fail": 2}``); None when it ran once.
    #: Optional: records written before it existed read as None.
    outcomes: dict[str, int] | None = None
    #: per-step values of both sides, per rank: ``{"loss": {"engine": [[step0, step1, ...] of rank 0,
    #: ...], "reference": [...]}, "grad_norm": {...}}``, so a report can draw how a divergence grew.
    #: None where not recorded (cases that did not finish, records written before it existed).
    curves: dict[str, dict[str, list[list[float]]]] | None = None

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"CaseRecord.verdict={self.verdict!r} is not one of {list(VERDICTS)}")

    @property
    def worst_ratio(self) -> float | None:
        """The worst error relative to its tolerance over all quantities, or None if none compared."""
        return max((e.ratio for e in self.errors), default=None)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CaseRecord":
        if d.get("schema", SCHEMA_VERSION) > SCHEMA_VERSION:
            raise ValueError(
                f"record schema {d['schema']} is newer than this reader's {SCHEMA_VERSION}: upgrade the project"
            )
        d = dict(d)
        d["errors"] = [QuantityError(**e) for e in d.get("errors", [])]
        if d.get("run") is not None:
            d["run"] = RunInfo(**d["run"])
        return cls(**d)
