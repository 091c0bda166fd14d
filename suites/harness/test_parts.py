"""Parts of a run (``harness.run.parts``, ``--part K/N``, alias ``--shard``): the parts of a selection are disjoint
and cover it, balanced by cost, the same on every call; ``--part auto`` reads Slurm, Kubernetes and CI variables; a
part records its partition, and a killed part resumes without touching the others. In-process, with
``run_case`` replaced where cases run (no ranks start)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from harness.cases.records import CaseRecord, RunInfo
from harness.compare.reference_cache import trained_fields
from harness.cli import main
from harness.collect.collector import ResultWriter, read_records, record_full_id
from harness.run.runner import Selection, select_cases
from harness.run.parts import (
    COUNT_VARIABLE,
    EARLIER_VARIABLES,
    INDEX_VARIABLE,
    PartError,
    PartSpec,
    case_costs,
    estimate_s,
    parse_part,
    partition,
    read_costs,
    part_from_env,
    units,
)
from harness.run.stored_selection import read_selection

#: the pairwise matrix at both world sizes: cases of different costs.
PAIRWISE = ["--matrix", "pairwise", "--world-size", "2,4"]


def _listed(capsys: pytest.CaptureFixture[str], *args: str) -> list[str]:
    capsys.readouterr()
    assert main(["list", *args]) == 0
    return capsys.readouterr().out.split()


def test_four_shards_of_the_pairwise_matrix_are_exactly_the_one_shot_selection(capsys: pytest.CaptureFixture[str]) -> None:
    whole = _listed(capsys, *PAIRWISE)
    parts = [_listed(capsys, *PAIRWISE, "--part", f"{k}/4") for k in range(1, 5)]
    union = [i for part in parts for i in part]
    assert len(union) == len(set(union)) == len(whole), "a case lost or listed by two shards"
    assert set(union) == set(whole)
    assert all(parts), "every shard gets cases"
    # Each part keeps the selection's order (a budget's sample order stays meaningful within a shard).
    for part in parts:
        assert part == [i for i in whole if i in set(part)]
    # The same on every call: a scheduler's N processes cut the same partition.
    assert _listed(capsys, *PAIRWISE, "--part", "3/4") == parts[2]
    # The old spellings are aliases: the same selection.
    assert _listed(capsys, *PAIRWISE, "--shard", "3/4") == parts[2]


def test_parts_are_balanced_by_cost_within_the_greedy_bound() -> None:
    rng = random.Random(7)
    ids = [f"case{i}" for i in range(200)]
    costs = {i: rng.choice([0.4, 0.8, 1.6, 8.0]) * rng.uniform(0.5, 1.5) for i in ids}
    for n in (2, 3, 4, 7):
        part = partition(ids, n, costs, "sel")
        loads = part.loads()
        assert sorted(i for p in part.parts for i in p) == sorted(ids)
        # Longest processing time first: no part exceeds the mean by more than the costliest case.
        assert max(loads) <= sum(loads) / n + max(costs.values())
        assert max(loads) / (sum(loads) / n) < 1.1, loads
    # The estimate alone balances the pairwise matrix too: world size 4 costs twice world size 2.
    cases = select_cases(Selection(matrix="pairwise"), [2, 4])
    est = {c.full_id: estimate_s(c.to_dict()) for c in cases}
    part = partition([c.full_id for c in cases], 4, est, "sel")
    assert max(part.loads()) <= sum(part.loads()) / 4 + max(est.values())


def test_the_partition_is_deterministic_and_its_id_names_n_selection_and_costs() -> None:
    ids = [f"c{i}" for i in range(10)]
    equal = dict.fromkeys(ids, 1.0)
    a, b = partition(ids, 3, equal, "sel"), partition(list(ids), 3, dict(equal), "sel")
    assert a.parts == b.parts and a.id == b.id
    # Ties go to the earlier case and the lower part: round robin over equal costs.
    assert a.parts == (("c0", "c3", "c6", "c9"), ("c1", "c4", "c7"), ("c2", "c5", "c8"))
    assert len({a.id, partition(ids, 4, equal, "sel").id, partition(ids, 3, equal, "other").id,
                partition(ids, 3, {**equal, "c0": 2.0}, "sel").id}) == 4
    # More parts than cases: the rest are empty, none lost.
    assert partition(["x"], 3, {"x": 1.0}, "sel").parts == (("x",), (), ())
    with pytest.raises(ValueError, match="twice"):
        partition(["x", "x"], 2, {"x": 1.0}, "sel")


def test_cases_of_one_group_go_to_one_part_and_a_large_group_is_cut_into_runs() -> None:
    ids = [f"c{i}" for i in range(12)]
    costs = dict.fromkeys(ids, 1.0)
    groups = {i: int(i[1:]) % 4 for i in ids}  # four groups of three, interleaved in the selection
    cut = partition(ids, 2, costs, "sel", groups)
    assert {frozenset(groups[i] for i in part) for part in cut.parts} == {frozenset({0, 2}), frozenset({1, 3})}
    assert cut.loads() == [6.0, 6.0] and cut.id != partition(ids, 2, costs, "sel").id, "the id names the grouping"
    # A group over half a part's fair share (12 / 4 / 2 = 1.5) is cut into runs of consecutive cases.
    assert units(ids, costs, 4, dict.fromkeys(ids, "one")) == [tuple(ids[k:k + 1]) for k in range(12)]
    assert units(ids, costs, 2, dict.fromkeys(ids, "one")) == [tuple(ids[k:k + 3]) for k in range(0, 12, 3)]
    assert units(ids, costs, 2, None) == [(i,) for i in ids]


def test_a_part_keeps_every_trained_configuration_whole(capsys: pytest.CaptureFixture[str]) -> None:
    """Its references and the prefetch baselines of its configurations are computed in one part's ranks only."""
    cases = {c.full_id: c for c in select_cases(Selection(matrix="pairwise"), [2, 4])}
    parts = [_listed(capsys, *PAIRWISE, "--part", f"{k}/3") for k in range(1, 4)]
    owner = {trained_fields(cases[i]): k for k, part in enumerate(parts) for i in part}
    assert all(owner[trained_fields(cases[i])] == k for k, part in enumerate(parts) for i in part)
    assert len(set(owner.values())) == 3
    # The default nightly's 29,120 cases in three parts: 56 configurations, none cut, the parts within 5 %.
    full = select_cases(Selection(matrix="full"), [2, 4])
    costs = {c.full_id: estimate_s(c.to_dict()) for c in full}
    cut = partition(list(costs), 3, costs, "sel", {c.full_id: trained_fields(c) for c in full})
    assert len(cut.units) == 56 and max(cut.loads()) / (sum(cut.loads()) / 3) < 1.05, cut.loads()


def test_unmeasured_cases_are_estimated_in_the_measured_seconds() -> None:
    cases = {"a": {"world_size": 2, "steps": 5}, "b": {"world_size": 4, "steps": 5}, "c": {"world_size": 2, "steps": 10}}
    assert case_costs(cases, {}) == {i: estimate_s(c) for i, c in cases.items()}
    # "a" ran 10 times slower than estimated: the others are scaled alike, and "a" keeps its measurement.
    costs = case_costs(cases, {"a": estimate_s(cases["a"]) * 10})
    assert costs["a"] == pytest.approx(estimate_s(cases["a"]) * 10)
    assert costs["b"] == pytest.approx(estimate_s(cases["b"]) * 10) and costs["b"] == pytest.approx(2 * costs["a"])


@pytest.mark.parametrize("env, shard", [
    ({"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "4"}, PartSpec(0, 4)),  # --array=1-4
    ({"SLURM_ARRAY_TASK_ID": "4", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "4"}, PartSpec(3, 4)),
    ({"SLURM_ARRAY_TASK_ID": "0", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "2"}, PartSpec(0, 2)),  # --array=0-1
    ({"JOB_COMPLETION_INDEX": "2", COUNT_VARIABLE: "3"}, PartSpec(2, 3)),  # a Kubernetes Indexed Job
    ({INDEX_VARIABLE: "0", COUNT_VARIABLE: "1"}, PartSpec(0, 1)),  # a CI matrix
    # Explicit variables win over the scheduler's (a CI job inside an allocation).
    ({INDEX_VARIABLE: "1", COUNT_VARIABLE: "2", "SLURM_ARRAY_TASK_ID": "7"}, PartSpec(1, 2)),
    # The earlier names, FSDP_PARITY_SHARD_INDEX and _COUNT, still read; alone, mixed or agreeing with the new.
    ({"FSDP_PARITY_SHARD_INDEX": "1", "FSDP_PARITY_SHARD_COUNT": "3"}, PartSpec(1, 3)),
    ({"JOB_COMPLETION_INDEX": "2", "FSDP_PARITY_SHARD_COUNT": "3"}, PartSpec(2, 3)),
    ({INDEX_VARIABLE: "2", "FSDP_PARITY_SHARD_COUNT": "3"}, PartSpec(2, 3)),
    ({INDEX_VARIABLE: "0", "FSDP_PARITY_SHARD_INDEX": "0", COUNT_VARIABLE: "2", "FSDP_PARITY_SHARD_COUNT": "2"},
     PartSpec(0, 2)),
])
def test_auto_reads_the_scheduler_s_variables(env: dict[str, str], shard: PartSpec) -> None:
    assert part_from_env(env) == shard == parse_part("auto", env)


@pytest.mark.parametrize("env, says", [
    ({}, "no scheduler variables set"),
    ({"JOB_COMPLETION_INDEX": "0"}, f"{COUNT_VARIABLE} is not"),  # Kubernetes gives no count
    ({"SLURM_ARRAY_TASK_ID": "1"}, "SLURM_ARRAY_TASK_MIN and SLURM_ARRAY_TASK_COUNT not"),
    ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "4"}, "name no part"),
    ({"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_MIN": "0", "SLURM_ARRAY_TASK_COUNT": "2",
      "SLURM_ARRAY_TASK_STEP": "2"}, "SLURM_ARRAY_TASK_STEP=2"),
    ({INDEX_VARIABLE: "2", COUNT_VARIABLE: "2"}, "name no part"),
    ({INDEX_VARIABLE: "one", COUNT_VARIABLE: "2"}, "is not an integer"),
    ({"FSDP_PARITY_SHARD_INDEX": "0"}, f"{COUNT_VARIABLE} is not"),
    ({"FSDP_PARITY_SHARD_INDEX": "one", "FSDP_PARITY_SHARD_COUNT": "2"}, "FSDP_PARITY_SHARD_INDEX='one' is not"),
    # Both names set and different: which one the scheduler meant is not guessed; the error names both.
    ({INDEX_VARIABLE: "1", "FSDP_PARITY_SHARD_INDEX": "2", COUNT_VARIABLE: "3"},
     "FSDP_PARITY_PART_INDEX='1' and FSDP_PARITY_SHARD_INDEX='2' disagree"),
    ({"JOB_COMPLETION_INDEX": "0", COUNT_VARIABLE: "3", "FSDP_PARITY_SHARD_COUNT": "4"},
     "FSDP_PARITY_PART_COUNT='3' and FSDP_PARITY_SHARD_COUNT='4' disagree"),
])
def test_auto_refuses_a_missing_or_inconsistent_environment(env: dict[str, str], says: str) -> None:
    with pytest.raises(PartError, match="--part auto") as info:
        part_from_env(env)
    assert says in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("args, says", [
    (["--part", "0/4"], "K must be between 1 and N"),
    (["--part", "5/4"], "K must be between 1 and N"),
    (["--part", "2"], "give K/N"),
    (["--part", "a/b"], "give K/N"),
    (["--part-costs", "x.jsonl"], "--part-costs: only balances parts"),
])
def test_bad_shard_options_are_one_line_naming_the_option(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(["list", *args]))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert says in err and "--part" in err and len(err.splitlines()) == 1
    # auto outside any scheduler: exit 2, one line.
    for name in ("SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX", INDEX_VARIABLE, COUNT_VARIABLE, *EARLIER_VARIABLES.values()):
        monkeypatch.delenv(name, raising=False)
    assert main(["list", "--shard", "auto"]) == 2
    assert "no scheduler variables set" in capsys.readouterr().err


def _results(path: Path, walls: dict[str, float]) -> Path:
    cases = {c.full_id: c for c in select_cases(Selection(matrix="pairwise"), [2])}
    with ResultWriter(path, RunInfo("earlier", "host", torch.__version__, "gloo")) as writer:
        for full_id, wall in walls.items():
            case = cases[full_id]
            writer.append(CaseRecord(case.to_dict(), case.case_id, "pass", wall_s=wall))
    return path


def test_a_cost_file_balances_by_measured_wall_times(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    ids = _listed(capsys, "--matrix", "pairwise")
    # One case measured as slow as all the others together: it gets a shard of its own.
    walls = {i: 1.0 for i in ids[1:]} | {ids[0]: float(len(ids) - 1)}
    costs_file = _results(tmp_path / "night" / "results.jsonl", walls)
    assert read_costs(costs_file) == read_costs(costs_file.parent) == walls
    parts = [_listed(capsys, "--matrix", "pairwise", "--part", f"{k}/2", "--part-costs", str(costs_file)) for k in (1, 2)]
    assert parts[0] == [ids[0]] and sorted(parts[1]) == sorted(ids[1:])
    # The old spellings are aliases: the same parts.
    assert parts == [_listed(capsys, "--matrix", "pairwise", "--shard", f"{k}/2", "--shard-costs", str(costs_file)) for k in (1, 2)]
    empty = _results(tmp_path / "empty.jsonl", {})
    assert main(["list", "--matrix", "pairwise", "--shard", "1/2", "--shard-costs", str(empty)]) == 2
    assert "--part-costs" in capsys.readouterr().err


def _ids(path: Path) -> list[str]:
    records, bad = read_records(path)
    assert not bad
    return [record_full_id(r) for r in records]


def test_a_killed_shard_resumes_its_own_part_without_touching_the_others(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str]
) -> None:
    run = ["run", "--matrix", "pairwise", "--engines", "builtin,torch-fsdp", "--no-progress"]
    outs = [tmp_path / f"shard{k}.jsonl" for k in (1, 2, 3)]
    for k, out in enumerate(outs, 1):
        assert main([*run, "--shard", f"{k}/3", "--out", str(out)]) == 0
    whole = [c.full_id for c in select_cases(Selection(matrix="pairwise", engines=["builtin", "torch-fsdp"]), [2])]
    stored = [read_selection(out) for out in outs]
    assert all(s is not None and s.part is not None for s in stored)
    assert len({s.id for s in stored}) == 1, "every shard shares the selection's id"  # type: ignore[union-attr]
    assert len({s.part["partition"] for s in stored}) == 1  # type: ignore[union-attr,index]
    assert sorted(i for out in outs for i in _ids(out)) == sorted(whole)
    # Shard 2 is killed after its first case (its last line cut mid-write).
    lines = outs[1].read_text().splitlines(keepends=True)
    assert len(lines) >= 2
    outs[1].write_text(lines[0] + lines[1][: len(lines[1]) // 2])
    others = {out: out.read_text() for out in (outs[0], outs[2])}
    fake_run_case.clear()
    # Resumed as a requeued task would be: the same command line, with --resume.
    assert main([*run, "--shard", "2/3", "--out", str(outs[1]), "--resume"]) == 0
    assert sorted(fake_run_case) == sorted(set(stored[1].part["case_ids"]) - {_ids_first(lines[0])})  # type: ignore[union-attr,index]
    assert all(out.read_text() == text for out, text in others.items())
    assert sorted({i for out in outs for i in _latest_ids(out)}) == sorted(whole)
    # Resuming with another shard is refused, naming the options.
    assert main(["run", "--out", str(outs[1]), "--resume", "--shard", "1/3"]) == 2
    assert "--part 1/3 is another part than the file's (part 2/3" in capsys.readouterr().err


def _ids_first(line: str) -> str:
    from harness.collect.collector import _parse_line

    record = _parse_line("x", 1, line)
    assert isinstance(record, CaseRecord)
    return record_full_id(record)


def _latest_ids(path: Path) -> set[str]:
    records, _ = read_records(path)
    return {record_full_id(r) for r in records}


def test_a_whole_run_resumed_with_a_shard_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                     fake_run_case: list[str]) -> None:
    out = tmp_path / "r.jsonl"
    assert main(["run", "--matrix", "smoke", "--engines", "builtin", "--no-progress", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["run", "--out", str(out), "--resume", "--shard", "1/2"]) == 2
    err = capsys.readouterr().err
    assert "holds a whole run" in err and len(err.strip().splitlines()) == 1
    assert json.loads(Path(str(out) + ".selection.json").read_text()).get("shard") is None


def test_a_resumed_shard_keeps_its_part_when_the_cost_file_changed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, fake_run_case: list[str]
) -> None:
    ids = _listed(capsys, "--matrix", "pairwise")
    costs = _results(tmp_path / "costs.jsonl", {i: 1.0 for i in ids})
    out = tmp_path / "shard.jsonl"
    command = ["run", "--matrix", "pairwise", "--no-progress", "--shard", "1/2", "--shard-costs", str(costs), "--out", str(out)]
    assert main(command) == 0
    part = read_selection(out).part  # type: ignore[union-attr]
    lines = out.read_text().splitlines(keepends=True)
    out.write_text(lines[0])
    # Last night's costs, read again on a requeue, now say otherwise: the part stays the stored one.
    costs.unlink()
    _results(costs, {i: 1.0 for i in ids} | {ids[0]: 50.0})
    assert _listed(capsys, "--matrix", "pairwise", "--shard", "1/2", "--shard-costs", str(costs)) != part["case_ids"]  # type: ignore[index]
    fake_run_case.clear()
    assert main([*command, "--resume"]) == 0
    assert sorted(fake_run_case) == sorted(set(part["case_ids"]) - {_ids_first(lines[0])})  # type: ignore[index]
    assert read_selection(out).part == part  # type: ignore[union-attr]
    assert sorted(_latest_ids(out)) == sorted(part["case_ids"])  # type: ignore[index]
