"""What one nightly runs and where it writes (``NightlyConfig``), and what a resumed nightly takes back.

``--resume`` continues the nightly already in ``--out``: its selection comes from the results file's
stored selection (``harness.run.stored_selection``; options given again with other values are refused by
name) and its time budget from the earlier attempt's ``nightly.json``, unless given again.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from harness.ranks.placement import BackendChoice, DeviceChoice
from harness.run.runner import Selection, SelectionError
from harness.run.parts import PartSpec

FuzzProfile = Literal["nightly", "ci", "dev", "none"]


@dataclass
class NightlyConfig:
    """What one nightly runs and where it writes."""

    #: the nightly's directory; every product is written here.
    out: Path
    #: which cases: the full matrix unless told otherwise; a resumed nightly's is the stored selection of its
    #: results file (``resumed_config``).
    selection: Selection = field(default_factory=lambda: Selection(matrix="full"))
    #: ranks per case (None: the matrix's world sizes that fit the local GPUs; 2 on CPU).
    world_sizes: list[int] | None = None
    #: Hypothesis profile of the fuzz campaign; ``none`` skips the campaign.
    fuzz_profile: FuzzProfile = "nightly"
    #: examples per fuzz property, overriding the profile's.
    fuzz_max_examples: int | None = None
    #: no case is launched once this many seconds have passed since the start (None: no budget).
    time_budget_s: float | None = None
    #: continue the nightly already in ``out`` (its recorded cases are skipped, a finished fuzz too).
    resume: bool = False
    #: the nightly (report directory or results file) to diff against; None: the newest earlier sibling.
    previous: Path | None = None
    #: ``auto``: NCCL with one GPU per rank where there are enough GPUs, gloo with ranks sharing the GPUs
    #: where there are fewer, gloo on CPU without GPUs (``harness.ranks.placement.place``).
    backend: BackendChoice = "auto"
    #: ``auto``: the GPUs where there are any; ``cpu`` keeps gloo ranks on the CPU of a GPU host.
    device: DeviceChoice = "auto"
    #: seconds per case before it is recorded as a timeout.
    case_timeout_s: float = 300.0
    #: show the progress bar.
    progress: bool = True
    #: check determinism on a sample (one case per engine, strategy and world size).
    determinism_sample: bool = True
    #: runs of every case, and extra runs of one that did not pass (``harness.run.repeats``).
    repeat: int = 1
    repeat_failures: int = 0
    #: pools side by side per group of GPUs (None: ``harness.ranks.placement.pools_per_group``).
    pools_per_gpu: int | None = None
    #: CUDA MPS for ranks that share a GPU (``harness.ranks.mps``): auto, on, off.
    mps: str = "auto"
    #: measure the performance section (``harness.perf.perf_section``).
    perf: bool = True
    #: run only this part of the selection (``harness.run.parts``; ``--part``, ``auto`` resolved by ``main``),
    #: into ``out/shards/K-of-N``; None: all of it.
    part: PartSpec | None = None
    #: results whose wall times balance the parts (``--part-costs``); None: estimates.
    part_costs: Path | None = None
    #: the argparse dests the command line set (``harness.cli.options.given_options``): what a resume
    #: must not silently replace.
    given_options: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        self.previous = Path(self.previous) if self.previous is not None else None
        if self.fuzz_max_examples is not None and self.fuzz_max_examples < 1:
            raise ValueError(f"NightlyConfig.fuzz_max_examples={self.fuzz_max_examples} must be at least 1")
        if self.time_budget_s is not None and self.time_budget_s < 0:
            raise ValueError(f"NightlyConfig.time_budget_s={self.time_budget_s} must not be negative")
        if self.repeat < 1 or self.repeat_failures < 0:
            raise ValueError(f"NightlyConfig.repeat={self.repeat} must be >= 1 and repeat_failures={self.repeat_failures} >= 0")
        if self.pools_per_gpu is not None and self.pools_per_gpu < 1:
            raise ValueError(f"NightlyConfig.pools_per_gpu={self.pools_per_gpu} must be at least 1")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "NightlyConfig":
        from harness.cli.options import selection_options

        options = selection_options(args)
        return cls(
            out=args.out, selection=options.selection(),
            world_sizes=list(options.world_sizes) if options.world_sizes else None,
            fuzz_profile=args.fuzz_profile, fuzz_max_examples=args.fuzz_max_examples,
            time_budget_s=args.time_budget_s, resume=args.resume, previous=args.previous,
            backend=options.backend, device=options.device, case_timeout_s=options.case_timeout_s,
            progress=not args.no_progress,
            determinism_sample=not args.no_determinism_sample, repeat=args.repeat,
            repeat_failures=args.repeat_failures, pools_per_gpu=args.pools_per_gpu, mps=args.mps,
            perf=not args.no_perf, given_options=frozenset(getattr(args, "given_options", ())),
            part=args.part, part_costs=args.part_costs,
        )

    def resume_line(self) -> str:
        """The command that continues this nightly (its part), shell-quoted."""
        from harness.cli.signals import resume_command

        part = ("--part", str(self.part)) if self.part is not None else ()
        return resume_command("python", "-m", "harness", "nightly", "--out", self.out, *part, "--resume")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["out"] = str(self.out)
        d["previous"] = str(self.previous) if self.previous is not None else None
        d["given_options"] = sorted(self.given_options)
        # Stored under the names of earlier nights ("shard", "shard_costs"), which their readers know.
        del d["part"], d["part_costs"]
        d["shard"] = str(self.part) if self.part is not None else None
        d["shard_costs"] = str(self.part_costs) if self.part_costs is not None else None
        return d


#: ``NightlyConfig`` fields a resumed nightly takes from its earlier attempt unless the command line
#: sets them again, with the argparse dest that sets each.
RESUMED_FIELDS: dict[str, str] = {
    "time_budget_s": "time_budget_s", "fuzz_profile": "fuzz_profile", "fuzz_max_examples": "fuzz_max_examples",
    "perf": "no_perf", "determinism_sample": "no_determinism_sample", "repeat": "repeat",
    "repeat_failures": "repeat_failures", "case_timeout_s": "case_timeout_s", "previous": "previous",
}


def resumed_config(config: NightlyConfig, stored_options: Mapping[str, Any] | None, earlier: Mapping[str, Any],
                   explicit: Iterable[str]) -> NightlyConfig:
    """``config`` with the stored selection (``stored_options``, None for a nightly from before they were
    stored: ``config``'s own) and ``RESUMED_FIELDS`` of the earlier attempt's ``nightly.json`` config
    ``earlier``, where the command line (``explicit``: argparse dests) does not set them.

    Raises ``SelectionError`` naming every option given with another value than the stored one.
    """
    from harness.run.stored_selection import contradictions, option_key, selection_from_options, selection_options

    explicit = set(explicit)
    keys = {option_key(d) for d in explicit}
    changes: dict[str, Any] = {f: earlier[f] for f, dest in RESUMED_FIELDS.items() if f in earlier and dest not in explicit}
    if stored_options is not None:
        given = selection_options(config.selection, config.world_sizes or stored_options.get("world_sizes") or [])
        clash = contradictions(stored_options, given, keys)
        if clash:
            raise SelectionError(f"--resume: {'; '.join(clash)} contradict the selection of the nightly in "
                                 f"{config.out}; drop them to continue it (a larger --limit too: the limit picks "
                                 "the sample), or choose a new --out")
        selection, world_sizes = selection_from_options(stored_options)
        changes.update(selection=selection, world_sizes=world_sizes)
    return dataclasses.replace(config, **changes)
