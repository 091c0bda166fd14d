"""The nightly's performance section: step time and peak memory per engine and strategy, the ratio to
torch FSDP1 measured in the same run, and its comparison with the previous night.

On a host with GPUs the section trains the anchors' GPT (``harness.perf.benchmark``, size ``1b``) with our
engine and torch FSDP1 at FULL_SHARD and SHARD_GRAD_OP; a night's ratio (ours over torch FSDP1's,
same run) that is more than ``RATIO_TOLERANCE`` worse than the previous night's on the same device is
a regression. On CPU it trains the tiny GPT once as a smoke check (the code path runs, the numbers
mean nothing): such a section is labelled ``smoke`` and never compared, and its numbers sit under
their own key so a history chart never puts CPU and GPU numbers in one column.

The section as kept in ``nightly.json`` under ``perf`` (``reports.history`` charts its numbers)::

    {"kind": "gpu" | "smoke", "device": str, "backend": str, "world_size": int, "model": str,
     "rows" | "smoke": {"<engine>/<strategy>": {"step_ms", "p10_ms", "p90_ms", "peak_gib",
                                                "reserved_gib", "tokens_per_s", "ratio"}},
     "not_ok": {"<engine>/<strategy>": "<status>: <reason>"}}
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.perf.benchmark import CPU_MODEL, SIZES, GPTConfig, count_params
from harness.perf.perf_rows import BASELINE, PerfRow
from harness.perf.perf_run import PerfConfig, run
from harness.ranks.placement import place

#: a ratio more than this much worse (relative) than the previous night's is a regression.
RATIO_TOLERANCE = 0.05
#: what the section measures on GPUs.
GPU_ENGINES = ["builtin", BASELINE]
GPU_STRATEGIES = ["full_shard", "shard_grad_op"]
#: the numbers kept per row.
METRICS = ("step_ms", "p10_ms", "p90_ms", "peak_gib", "reserved_gib", "tokens_per_s", "ratio")


def section_config(n_gpus: int, timeout_s: float = 600.0) -> PerfConfig:
    """The section's run: the ``1b`` GPT on two GPUs with NCCL when there is one per rank, else the tiny GPT
    on CPU. Ranks sharing a GPU through gloo time the host staging of every collective, not the
    engines' overlap of NCCL with compute, so one GPU gets the CPU smoke check too."""
    lane = place(2, n_gpus)
    if lane.backend == "nccl":
        return PerfConfig(model=SIZES["1b"], engines=list(GPU_ENGINES), strategies=list(GPU_STRATEGIES),
                          warmup=3, steps=10, world_size=2, backend="nccl", devices=lane.devices, timeout_s=timeout_s)
    return PerfConfig(model=CPU_MODEL, engines=list(GPU_ENGINES), strategies=["full_shard"], warmup=1, steps=3,
                      world_size=2, backend="gloo", timeout_s=timeout_s)


def _kind(config: PerfConfig) -> str:
    """``gpu`` for a section measured with one GPU per rank, ``smoke`` otherwise (never compared)."""
    return "gpu" if config.devices is not None and config.backend == "nccl" else "smoke"


def _key(row: PerfRow) -> str:
    return f"{row.engine}/{row.strategy or 'ddp'}"


def _describe(model: GPTConfig) -> str:
    return f"GPT {count_params(model) / 1e6:.1f}M, d {model.d_model}, {model.layers} layers, batch {model.batch} x {model.seq}"


def build_section(rows: Sequence[PerfRow], config: PerfConfig, device: str) -> dict[str, Any]:
    """The ``perf`` section of ``nightly.json`` from a run's rows (see the module docstring)."""
    smoke = _kind(config) == "smoke"
    measured = {_key(r): {m: getattr(r, m) for m in METRICS} for r in rows if r.status == "ok"}
    return {
        "kind": "smoke" if smoke else "gpu", "device": device, "backend": config.backend,
        "world_size": config.world_size, "model": _describe(config.model),
        ("smoke" if smoke else "rows"): measured,
        "not_ok": {_key(r): f"{r.status}: {r.reason}" for r in rows if r.status != "ok"},
    }


def run_section(n_gpus: int) -> dict[str, Any]:
    """Measure the section on this host (``n_gpus`` visible GPUs); a failure to start is recorded in it."""
    from harness.ranks.pool import PoolStartError

    config = section_config(n_gpus)
    try:
        rows, device = run(config)
    except (PoolStartError, ValueError) as exc:
        return {"kind": _kind(config), "error": str(exc)}
    return build_section(rows, config, device)


@dataclass(frozen=True)
class RatioChange:
    """One row's ratio tonight against the previous night's."""

    key: str
    previous: float
    current: float

    @property
    def change(self) -> float:
        """Relative change of the ratio; positive is slower against torch."""
        return self.current / self.previous - 1


@dataclass
class PerfComparison:
    """The section compared with the previous night's."""

    #: whether the two were compared at all; ``reason`` says why not.
    compared: bool
    reason: str = ""
    regressions: list[RatioChange] = field(default_factory=list)
    improvements: list[RatioChange] = field(default_factory=list)
    unchanged: list[RatioChange] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"compared": self.compared, "reason": self.reason}
        for name in ("regressions", "improvements", "unchanged"):
            out[name] = [{**asdict(c), "change": c.change} for c in getattr(self, name)]
        return out


def compare_sections(previous: Mapping[str, Any] | None, current: Mapping[str, Any] | None,
                     tolerance: float = RATIO_TOLERANCE) -> PerfComparison:
    """Tonight's ratios against the previous night's: one that grew by more than ``tolerance``
    (relative) is a regression, one that shrank by more an improvement. Smoke sections, sections of
    different devices or models, and missing sections are not compared (the reason says which)."""
    if not current or not previous:
        return PerfComparison(False, "no performance section " + ("tonight" if not current else "in the previous nightly"))
    for name, section in (("tonight's", current), ("the previous", previous)):
        if section.get("kind") != "gpu":
            return PerfComparison(False, f"{name} section is a {section.get('kind', 'unknown')} check, never compared")
    for what in ("device", "model", "world_size"):
        if previous.get(what) != current.get(what):
            return PerfComparison(False, f"{what} changed: {previous.get(what)!r} -> {current.get(what)!r}")
    result = PerfComparison(True)
    old_rows, new_rows = previous.get("rows") or {}, current.get("rows") or {}
    for key in sorted(set(old_rows) & set(new_rows)):
        before, now = old_rows[key].get("ratio"), new_rows[key].get("ratio")
        if before is None or now is None or before <= 0:
            continue
        change = RatioChange(key, float(before), float(now))
        if change.change > tolerance:
            result.regressions.append(change)
        elif change.change < -tolerance:
            result.improvements.append(change)
        else:
            result.unchanged.append(change)
    return result


def previous_section(previous: Path | None) -> dict[str, Any] | None:
    """The ``perf`` section of the nightly at ``previous`` (its directory or a file in it), if any."""
    if previous is None:
        return None
    directory = previous if previous.is_dir() else previous.parent
    try:
        data = json.loads((directory / "nightly.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    section = data.get("perf") if isinstance(data, dict) else None
    return section if isinstance(section, dict) else None


def summary_lines(section: Mapping[str, Any] | None, comparison: Mapping[str, Any] | None = None) -> list[str]:
    """The section as a small table for the nightly's summary, with the comparison's verdict."""
    from tabulate import tabulate

    if not section:
        return ["perf: not measured"]
    if section.get("skipped"):
        return [f"perf: skipped ({section['skipped']})"]
    if section.get("error"):
        return [f"perf: could not start ({section['error']})"]
    smoke = section.get("kind") == "smoke"
    rows = section.get("smoke" if smoke else "rows") or {}
    label = "perf (smoke check on CPU: the code path runs, the numbers are not compared)" if smoke else "perf"
    lines = [f"{label}: {section.get('model')} on {section.get('world_size')} x {section.get('device')}"]
    body = [(key, _num(r.get("step_ms"), ".1f"), _num(r.get("peak_gib"), ".1f"), _num(r.get("ratio"), ".3f"))
            for key, r in rows.items()]
    body += [(key, why, "-", "-") for key, why in (section.get("not_ok") or {}).items()]
    lines.append(tabulate(body, headers=("engine/strategy", "step ms", "peak GiB", f"x {BASELINE}"), disable_numparse=True))
    if comparison:
        if not comparison.get("compared"):
            lines.append(f"perf diff: not compared ({comparison.get('reason')})")
        else:
            worse = ", ".join(f"{c['key']} {c['previous']:.3f} -> {c['current']:.3f}" for c in comparison["regressions"])
            lines.append(f"perf diff: {len(comparison['regressions'])} ratio regression(s)" + (f": {worse}" if worse else ""))
    return lines


def _num(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)
