"""The run behind this example: 48 cases on 2 gloo ranks (CPU), with faults injected on purpose.

Every ``no_shard & offload & orig`` case gets ``perturb_grad_rank1`` (0.01 added to one gradient
element on rank 1 after every backward: a stand-in for an engine bug), and one case gets
``skip_collective_on_rank1`` (a hang, recorded as a timeout after 20 s). The report shows what the
attribution, the grid and the case pages make of them (``reports/examples/planted-fault-cpu/``, the
report this writes: a generator sits here, its output under ``reports/``). Run from the repository root:

    PYTHONPATH=. python3 examples/planted-fault-cpu/make.py results.jsonl
    PYTHONPATH=. python3 -m reports build results.jsonl --out reports/examples/planted-fault-cpu

The cases run through ``harness.run.runner.CaseRunner``, the loop of ``harness run``: the command line has
no option to plant a fault in some cases only, so the case list is built here.
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

from harness.cases.case import CaseConfig
from harness.collect.collector import ResultWriter, run_info
from harness.ranks.placement import Lane
from harness.run.runner import CaseRunner, Progress

HANG = ("builtin", "full_shard", "pre", False, False)


def cases() -> list[CaseConfig]:
    out = []
    for engine, prefetch, strategy, offload, orig in itertools.product(
        ("builtin", "torch-fsdp"), ("none", "pre"), ("full_shard", "shard_grad_op", "no_shard"), (False, True), (False, True)
    ):
        extras: tuple[tuple[str, str], ...] = ()
        if strategy == "no_shard" and offload and orig:
            extras = (("fault", "perturb_grad_rank1"),)
        elif (engine, strategy, prefetch, offload, orig) == HANG:
            extras = (("fault", "skip_collective_on_rank1"),)
        out.append(CaseConfig(engine=engine, reference="ddp", model="nested", sharding_strategy=strategy, precision="fp64",
                              backward_prefetch=prefetch, cpu_offload=offload, use_orig_params=orig, extras=extras))
    return out


def main(path: str) -> None:
    lane = Lane(2, "gloo", None)
    todo = cases()
    with ResultWriter(Path(path), run_info([lane])) as writer:
        progress = Progress(len(todo), enabled=True)
        runner = CaseRunner(writer, progress, deadline=None, case_timeout_s=20.0)
        left = runner.run([lane], todo)
        progress.close()
    if left or runner.lane_errors:
        sys.exit(f"{len(left)} cases not run: {'; '.join(runner.lane_errors)}")


if __name__ == "__main__":
    main(sys.argv[1])
