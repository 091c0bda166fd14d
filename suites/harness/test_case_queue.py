"""The runner's queue (``harness.run.case_queue``): lanes keep taking the trained configuration whose
reference their pool computed last, every case is taken once, and a budgeted run keeps its order."""

from __future__ import annotations

import functools
import itertools
import random

from harness.cases.case import CaseConfig
from harness.compare.reference_cache import trained_fields
from harness.run.case_queue import CaseQueue
from harness.selection.matrix import generate


@functools.cache
def _full() -> list[CaseConfig]:
    return generate("full")


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


def test_each_lane_computes_each_reference_about_once_grouped_or_in_sampled_order() -> None:
    """The default full matrix on 24 lanes taking turns: a lane's cache misses once per configuration it
    takes; in the generator's or a sampled order nearly every lane takes nearly every configuration."""
    cases = _full()
    configurations = len({trained_fields(c) for c in cases})
    sampled = random.Random(0).sample(cases, len(cases))

    def references(queue: CaseQueue) -> int:
        seen: set[tuple[int, object]] = set()
        for lane in itertools.cycle(range(24)):
            case = queue.take(lane)
            if case is None:
                return len(seen)
            seen.add((lane, trained_fields(case)))
        raise AssertionError("unreachable")

    in_order = references(CaseQueue(cases, trained_fields, grouped=False))
    grouped = references(CaseQueue(cases, trained_fields))
    looking_ahead = references(CaseQueue(sampled, trained_fields, grouped=False, window=8 * 24))
    assert in_order > 15 * configurations, in_order
    assert grouped <= 2 * configurations + 24 and looking_ahead <= 3 * configurations, (grouped, looking_ahead)


def test_looking_ahead_takes_no_case_more_than_the_window_early() -> None:
    cases = random.Random(1).sample(_full(), 300)
    queue, taken = CaseQueue(cases, trained_fields, grouped=False, window=16), []
    while (case := queue.take(len(taken) % 3)) is not None:
        taken.append(case)
    assert sorted(c.full_id for c in taken) == sorted(c.full_id for c in cases)
    assert all(cases.index(case) < at + 16 for at, case in enumerate(taken))


def test_a_budgeted_run_keeps_its_order_and_a_failed_lanes_case_goes_first() -> None:
    cases = _cases("nested", "transformer", "nested", "gpt")
    queue = CaseQueue(cases, trained_fields, grouped=False)
    first = queue.take(0)
    assert first is cases[0] and queue.take(1) is cases[1]
    queue.put_back(0, first)
    assert queue.take(1) is first and queue.remaining() == cases[2:]
