"""The runner's queue (``harness.run.case_queue``): lanes keep taking the trained configuration whose
reference their pool computed last, every case is taken once, and a budgeted run keeps its order."""

from __future__ import annotations

import itertools
import random

from harness.cases.case import CaseConfig
from harness.compare.reference_cache import trained_fields
from harness.run.case_queue import CaseQueue
from harness.selection.matrix import generate


def _cases(*models: str) -> list[CaseConfig]:
    return [CaseConfig(model=m, engine=e) for m, e in zip(models, itertools.cycle(["builtin", "torch-fsdp"]))]


def test_a_lane_keeps_its_configuration_then_claims_the_next_then_shares_the_largest() -> None:
    queue = CaseQueue(_cases("nested", "nested", "nested", "transformer", "gpt"), trained_fields)
    assert [queue.take(0).model, queue.take(1).model, queue.take(0).model] == ["nested", "transformer", "nested"]
    assert queue.take(1).model == "gpt", "the next configuration no lane holds"
    assert queue.take(1).model == "nested", "none left unclaimed: a share of the one with most cases left"
    assert queue.take(0) is None and queue.take(1) is None and len(queue) == 0


def test_every_case_is_taken_once_whatever_the_lanes_interleaving() -> None:
    cases = generate("pairwise")
    queue, rng, taken = CaseQueue(cases, trained_fields), random.Random(0), []
    while (case := queue.take(rng.randrange(5))) is not None:
        taken.append(case)
    assert sorted(c.full_id for c in taken) == sorted(c.full_id for c in cases)


def test_grouping_computes_each_reference_about_once_per_configuration() -> None:
    """The default full matrix on 24 lanes taking turns: a lane's cache misses once per configuration it
    takes; in the generator's order nearly every lane takes nearly every configuration."""
    cases = generate("full")
    configurations = len({trained_fields(c) for c in cases})

    def references(queue: CaseQueue) -> int:
        seen: set[tuple[int, object]] = set()
        for lane in itertools.cycle(range(24)):
            case = queue.take(lane)
            if case is None:
                return len(seen)
            seen.add((lane, trained_fields(case)))
        raise AssertionError("unreachable")

    ungrouped, grouped = references(CaseQueue(cases, trained_fields, grouped=False)), references(CaseQueue(cases, trained_fields))
    assert ungrouped > 15 * configurations and grouped <= 2 * configurations + 24, (ungrouped, grouped, configurations)


def test_a_budgeted_run_keeps_its_order_and_a_failed_lanes_case_goes_first() -> None:
    cases = _cases("nested", "transformer", "nested", "gpt")
    queue = CaseQueue(cases, trained_fields, grouped=False)
    first = queue.take(0)
    assert first is cases[0] and queue.take(1) is cases[1]
    queue.put_back(0, first)
    assert queue.take(1) is first and queue.remaining() == cases[2:]
