"""The peak of live tensors on CPU ranks (``harness.perf.memory_peak``), from tensors of known sizes."""

from __future__ import annotations

import torch

from harness.perf.memory_peak import BEFORE, LiveStorages, largest, memory_lines

MIB = 2 ** 20


def _floats(mib: int) -> torch.Tensor:
    return torch.ones(mib * MIB // 4)


def test_the_peak_is_the_most_alive_at_once_labelled_by_phase_operator_and_caller() -> None:
    kept = _floats(1)
    with LiveStorages() as live:
        assert live.before_bytes >= MIB
        live.phase = "forward"
        a = _floats(4)
        b = a * 2
        del a  # freed: the next phase's allocations do not add to it
        live.phase = "backward"
        c = _floats(2)
        del b, c
    assert live.peak_phase == "forward"
    assert live.before_bytes + 8 * MIB <= live.peak_bytes < live.before_bytes + 9 * MIB
    top = largest(live.at_peak, 2)
    assert [(label.split(" (")[0], nbytes, count) for label, nbytes, count in top] == [
        ("forward: ones.default", 4 * MIB, 1), ("forward: mul.Tensor", 4 * MIB, 1)]
    assert all("test_memory_peak.py" in label for label, _, _ in top), top
    assert kept.numel()


def test_a_storage_resized_to_nothing_stops_counting_and_counts_again_when_regrown() -> None:
    # How FSDP frees and regathers an unsharded parameter: the storage stays, its bytes go.
    flat = _floats(4)
    with LiveStorages() as live:
        before = live.before_bytes
        live.phase = "forward"
        flat.untyped_storage().resize_(0)
        _floats(2)  # made and freed while the flat storage is empty
        live.phase = "backward"
        extra = _floats(1)
        flat.untyped_storage().resize_(4 * MIB)
        flat.zero_()  # an operator, so the regrown storage is summed
    assert before >= 4 * MIB and live.peak_phase == "backward" and live.peak_bytes == before + MIB
    assert extra.numel()
    assert any(label.startswith(BEFORE) and nbytes == 4 * MIB for nbytes, label in live.at_peak)


def test_largest_groups_by_label_and_the_lines_say_the_peak() -> None:
    at_peak = [(5 * MIB, "backward: add"), (MIB, "forward: mm"), (2 * MIB, "forward: mm"), (0, "optimizer: empty")]
    assert largest(at_peak) == [("backward: add", 5 * MIB, 1), ("forward: mm", 3 * MIB, 2)]
    report = {"peak_bytes": 8 * MIB, "peak_phase": "backward", "before_bytes": MIB, "largest": largest(at_peak)}
    lines = memory_lines("gpt-builtin-full_shard-rank0", report)
    assert lines[0] == ("gpt-builtin-full_shard-rank0: peak of live tensors 8.00 MiB in backward (1.00 MiB alive "
                        "before the steps); largest then:")
    assert lines[2].split() == ["3.00", "MiB", "x2", "forward:", "mm"]
