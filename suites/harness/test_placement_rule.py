"""The placement rule (``harness.ranks.placement.place``) over (ranks, GPUs, device, backend), every front end
asking it, and no other module choosing a backend from the GPU count. No rank processes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.pytest_plugin.cases import plan_pool
from harness.ranks.placement import Lane, PlacementError, place

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("ranks, gpus, device, backend, want", [
    # One GPU per rank where there are enough: NCCL.
    (2, 2, "auto", "auto", Lane(2, "nccl", (0, 1))),
    (2, 8, "auto", "auto", Lane(2, "nccl", (0, 1))),
    (4, 4, "cuda", "nccl", Lane(4, "nccl", (0, 1, 2, 3))),
    # Fewer GPUs than ranks: gloo, rank r on GPU r mod G.
    (2, 1, "auto", "auto", Lane(2, "gloo", (0, 0))),
    (4, 2, "auto", "auto", Lane(4, "gloo", (0, 1, 0, 1))),
    (8, 1, "cuda", "auto", Lane(8, "gloo", (0,) * 8)),
    (3, 2, "auto", "gloo", Lane(3, "gloo", (0, 1, 0))),
    # gloo asked for with enough GPUs: gloo on the GPUs, not the CPU.
    (2, 2, "auto", "gloo", Lane(2, "gloo", (0, 1))),
    # No GPU, or the CPU asked for: gloo on the CPU.
    (2, 0, "auto", "auto", Lane(2, "gloo", None)),
    (4, 0, "cpu", "gloo", Lane(4, "gloo", None)),
    (2, 8, "cpu", "auto", Lane(2, "gloo", None)),
])
def test_the_rule(ranks: int, gpus: int, device: str, backend: str, want: Lane) -> None:
    got = place(ranks, gpus, backend, device)  # type: ignore[arg-type]
    assert got == want
    assert got.device == ("cpu" if want.devices is None else "cuda")


@pytest.mark.parametrize("ranks, gpus, device, backend, option", [
    (2, 1, "auto", "nccl", "--backend nccl"),
    (2, 0, "auto", "nccl", "--backend nccl"),
    (2, 0, "cuda", "auto", "--device cuda"),
    (2, 4, "cpu", "nccl", "--backend nccl"),
    (0, 4, "auto", "auto", "--world-size"),
    (2, 4, "tpu", "auto", "--device"),
])
def test_what_cannot_run_is_one_line_naming_the_option(ranks: int, gpus: int, device: str, backend: str, option: str) -> None:
    with pytest.raises(PlacementError) as info:
        place(ranks, gpus, backend, device)  # type: ignore[arg-type]
    assert str(info.value).startswith(option) and "\n" not in str(info.value)


@given(ranks=st.integers(1, 16), gpus=st.integers(0, 16), worker=st.integers(0, 7), workers=st.integers(1, 8))
def test_every_placement_is_sound(ranks: int, gpus: int, worker: int, workers: int) -> None:
    lane = place(ranks, gpus, worker=worker % workers, n_workers=workers)
    if gpus == 0:
        assert lane == Lane(ranks, "gloo", None)
        return
    assert lane.devices is not None and len(lane.devices) == ranks and all(0 <= d < gpus for d in lane.devices)
    # NCCL exactly when every rank has a GPU of its own; the GPUs of a shared pool carry even loads.
    assert (lane.backend == "nccl") == (gpus >= ranks)
    assert (lane.ranks_per_gpu == 1) == (gpus >= ranks)
    counts = [lane.devices.count(d) for d in set(lane.devices)]
    assert max(counts) - min(counts) <= 1


def test_lanes_describe_backend_device_and_sharing() -> None:
    assert place(2, 1).describe() == "gloo on GPUs [0] (2 ranks per GPU)"
    assert place(2, 2).describe() == "nccl on GPUs [0, 1] (one per rank)"
    assert place(2, 0).describe() == "gloo on CPU"


def test_the_pytest_plugin_asks_the_rule() -> None:
    assert plan_pool(2, "auto", n_gpus=1).lane == place(2, 1)
    assert plan_pool(2, "auto", n_gpus=4, worker=1, n_workers=2).lane == place(2, 4, worker=1, n_workers=2)
    assert plan_pool(2, "auto", n_gpus=4, device="cpu").lane == Lane(2, "gloo", None)
    refused = plan_pool(4, "nccl", n_gpus=2)
    assert refused.lane is None and refused.skip_reason and refused.skip_reason.startswith("--backend nccl")


@pytest.mark.parametrize("argv", [
    ["run", "--matrix", "smoke", "--limit", "1"],
    ["nightly", "--fuzz-profile", "none", "--no-perf"],
    ["certify", "--engine", "builtin", "--quick"],
    ["bench"],
])
def test_every_front_end_refuses_nccl_without_gpus_through_the_rule(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from harness.cli import main
    from harness.ranks.placement import n_gpus

    if n_gpus() >= 2:
        # A host with GPUs enough for NCCL shows the front ends one, so the refusal is checked there too.
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        assert n_gpus() == 1
    out = ["--out", str(tmp_path / ("x.jsonl" if argv[0] == "run" else "x"))] if argv[0] != "bench" else []
    assert main([*argv, *out, "--backend", "nccl"]) == 2
    err = capsys.readouterr().err
    assert "--backend nccl" in err and ("one GPU per rank" in err or "needs a CUDA GPU" in err), err


def test_perf_asks_the_rule() -> None:
    import argparse

    from harness.cli import perf
    from harness.ranks.placement import n_gpus

    parser = argparse.ArgumentParser()
    perf.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu"])
    config = perf.config_from_args(args)
    assert config.backend == "gloo" and config.devices is None
    if n_gpus() < 2:
        with pytest.raises(PlacementError, match="--backend nccl"):
            perf.config_from_args(parser.parse_args(["--backend", "nccl"]))


def _gloo_means_cpu(tree: ast.AST) -> list[int]:
    """Decisions on a comparison with the literal ``"gloo"`` that look at no device: the backend taken to say
    where tensors live. A check of gloo itself (its limits with CUDA tensors) names the device beside it;
    assertions about what a run recorded are not decisions."""
    lines = []

    def mentions_device(node: ast.AST) -> bool:
        return any((isinstance(n, ast.Attribute) and "device" in n.attr) or (isinstance(n, ast.Name) and "device" in n.id)
                   or (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and "device" in n.func.id)
                   for n in ast.walk(node))

    def visit(node: ast.AST, condition: ast.AST | None) -> None:
        if isinstance(node, ast.Assert):
            return
        if isinstance(node, ast.BoolOp) and condition is None:
            condition = node
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.Eq, ast.NotEq)):
            if any(isinstance(o, ast.Constant) and o.value == "gloo" for o in [node.left, *node.comparators]):
                if not mentions_device(condition if condition is not None else node):
                    lines.append(node.lineno)
        for child in ast.iter_child_nodes(node):
            visit(child, condition)

    visit(tree, None)
    return lines


def test_no_module_outside_placement_reads_the_gpu_count_or_takes_gloo_for_the_cpu() -> None:
    """Only ``harness/ranks/placement.py`` reads the GPU count (``torch.cuda.device_count``); nothing in the harness
    or the suites decides "on the CPU" from ``backend == "gloo"`` (gloo runs on GPUs too): they ask the
    lane's ``device`` or ``harness.ranks.rank.rank_device``."""
    offenders = []
    for path in sorted([*(ROOT / "harness").rglob("*.py"), *(ROOT / "suites").rglob("*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("harness/ranks/placement.py", "suites/harness/test_placement_rule.py"):
            continue
        source = path.read_text()
        if "device_count()" in source:
            offenders += [f"{rel}:{i}: reads the GPU count" for i, line in enumerate(source.splitlines(), 1)
                          if "device_count()" in line and not line.lstrip().startswith("#")]
        offenders += [f"{rel}:{line}: compares a backend with 'gloo'" for line in _gloo_means_cpu(ast.parse(source))]
    assert not offenders, "\n".join(offenders)


def test_the_scan_finds_a_planted_offender() -> None:
    planted = ast.parse('if backend == "gloo":\n    device = "cpu"\n')
    assert _gloo_means_cpu(planted) == [1]
    assert _gloo_means_cpu(ast.parse('x = "cpu" if lane.backend != "gloo" else "cuda"')) == [1]
    assert _gloo_means_cpu(ast.parse('assert record.run.backend == "gloo"')) == []
    # gloo's own limits with CUDA tensors name the device beside the backend.
    assert _gloo_means_cpu(ast.parse('if ctx.device_type == "cuda" and ctx.backend == "gloo":\n    pass')) == []


def test_cuda_rank_budget_shares_gpu_and_host_memory_among_workers() -> None:
    from harness.ranks.placement import HostFacts, cuda_rank_budget

    gib = 1 << 30
    one_h100 = HostFacts(cpu_cores=16, gpu_memory_bytes=80 * gib, host_memory_bytes=120 * gib)
    assert cuda_rank_budget(one_h100, n_gpus=0) is None
    assert cuda_rank_budget(one_h100, n_gpus=1) == 20  # 80 GiB at 4 GiB a rank; host memory allows 60
    assert cuda_rank_budget(one_h100, n_gpus=1, n_workers=8) == 2
    # Host memory the tighter limit: 16 GiB at 2 GiB a CUDA rank.
    assert cuda_rank_budget(HostFacts(16, 141 * gib, 16 * gib), n_gpus=2) == 8
    assert cuda_rank_budget(HostFacts(16, 80 * gib, 1 * gib), n_gpus=1, n_workers=8) == 1


def test_xdist_auto_workers_fit_the_gpus_memory_and_the_cores() -> None:
    from harness.ranks.placement import HostFacts, xdist_auto_workers, xdist_overcommit

    gib = 1 << 30
    h200_host = HostFacts(cpu_cores=32, gpu_memory_bytes=140 * gib)
    assert xdist_auto_workers(HostFacts(cpu_cores=2)) is None  # no GPU: pytest-xdist's own default
    assert xdist_auto_workers(h200_host) == 17  # 32 workers on 2 H200s ran out of GPU memory
    assert xdist_auto_workers(HostFacts(cpu_cores=16, gpu_memory_bytes=80 * gib)) == 10
    assert xdist_auto_workers(HostFacts(cpu_cores=6, gpu_memory_bytes=80 * gib)) == 6
    assert xdist_auto_workers(HostFacts(cpu_cores=64, gpu_memory_bytes=4 * gib)) == 1
    assert xdist_overcommit(h200_host, 17) is None and xdist_overcommit(HostFacts(cpu_cores=2), 64) is None
    hint = xdist_overcommit(h200_host, 32)
    assert hint is not None and hint.startswith("-n 32:") and "-n 17 or fewer" in hint and "140 GiB" in hint


def test_dash_n_auto_asks_the_plugin_on_a_gpu_host(pytestconfig: pytest.Config,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import harness.ranks.placement as placement

    gib = 1 << 30
    hook = pytestconfig.pluginmanager.hook.pytest_xdist_auto_num_workers
    monkeypatch.setattr(placement, "n_gpus", lambda: 2)
    monkeypatch.setattr(placement, "host_facts", lambda: placement.HostFacts(cpu_cores=32, gpu_memory_bytes=140 * gib))
    assert hook(config=pytestconfig) == 17
    monkeypatch.setattr(placement, "n_gpus", lambda: 0)
    xdist_plugin = pytest.importorskip("xdist.plugin", reason="package missing: pytest-xdist")
    assert hook(config=pytestconfig) == xdist_plugin.pytest_xdist_auto_num_workers(pytestconfig)  # a worker per core


def test_a_rank_start_out_of_gpu_memory_names_the_workers_option(monkeypatch: pytest.MonkeyPatch) -> None:
    import harness.pytest_plugin.pools as pools
    import harness.ranks.placement as placement

    monkeypatch.setattr(placement, "host_facts", lambda: placement.HostFacts(cpu_cores=32, gpu_memory_bytes=140 << 30))
    monkeypatch.setattr(pools, "_n_workers", lambda: 32)
    oom = RuntimeError("RankPool: rank 0 exited during start-up\ntorch.AcceleratorError: CUDA error: out of memory")
    assert "pass -n 17 or fewer" in pools._overcommit_hint(oom)
    assert pools._overcommit_hint(RuntimeError("RankPool: rank 1 exited during start-up with code 1")) == ""
    monkeypatch.setattr(pools, "_n_workers", lambda: 8)
    assert pools._overcommit_hint(oom) == ""  # out of memory for another reason: no option to blame
