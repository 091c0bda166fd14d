"""CPU offload placement of our engine and torch FSDP1 side by side on 2 GPUs (NCCL).

For every strategy and ``use_orig_params``, on the nested model and the transformer with a tied
weight, both engines run one offloaded training step recorded by ``harness.compare.param_devices`` (after
construction, in forward and backward, after forward, backward and ``optimizer.step()``, inside and
after ``summon_full_params`` with and without ``offload_to_cpu``, inside and after ``no_sync``);
every parameter and gradient must be on the same device in both, and where offload promises it.
A module wrapped with offload and then moved to the GPU must fail at its first forward in both.

Run on a machine with GPUs::

    PYTHONPATH=. python3 -m pytest suites/engine/test_gpu_placement.py -m gpu -q

With 2 GPUs or more the ranks are 2; with one GPU they are 1, where both engines run every strategy
as NO_SHARD (FSDP1 switches on one rank), so one GPU checks the unsharded placement only.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from harness.cases.model_protocol import to_device, wrap_bottom_up
from harness.compare.param_devices import PlacementLog, offload_violations
from harness.conformance.engine_models import NestedWrapped
from harness.conformance.fsdp1_checks import load_api
from harness.pytest_plugin.rank_checks import rank_check_tests
from harness.pytest_plugin import needs_gpus
from harness.ranks.placement import n_gpus
from suites.engine.placement import configurations, offload_step

pytestmark = [pytest.mark.gpu, needs_gpus(1)]

#: ranks of the rank checks: 2 where there are 2 GPUs, else 1 (see the module docstring).
WORLD = 2 if n_gpus() >= 2 else 1

#: (point, use_orig_params) where the engines keep a gradient in different places by design: inside
#: ``no_sync`` with ``use_orig_params=False`` torch FSDP1 leaves the unsharded accumulated gradient
#: on its flat parameter's ``.grad`` (swapping the parameter's data between shard and unsharded
#: buffer); ours keeps it on the unsharded compute buffer until the synchronized backward reduces
#: it. Parameter devices are compared there too.
GRADIENT_DIFFERENCES = {("in_no_sync", False)}

#: (point, use_orig_params, ours, torch): a gradient one engine has and the other has not, by design.
#: Between the first forward and its backward, with offload and ``use_orig_params``, torch FSDP1
#: exposes its preallocated pinned CPU gradient buffer (zeros, no backward has run) as the original
#: parameters' ``.grad``; ours exposes a gradient only once backward produced one. Both agree on the
#: CPU as soon as a gradient exists.
GRADIENT_ONLY_IN_TORCH = {("after_forward", True, None, "cpu")}


#: On one rank torch FSDP1 runs the hybrid strategies as NO_SHARD too (its shard group has one rank,
#: and it would then skip the replicate group's all-reduce); ours keeps hybrid semantics, so
#: _HYBRID_SHARD_ZERO2 keeps its unsharded parameters on the GPU from forward to backward there, as
#: SHARD_GRAD_OP does on two ranks. Each engine is still held to what offload promises.
ONE_RANK_HYBRID_DIFFERS = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _differences(ours: PlacementLog, theirs: PlacementLog, use_orig_params: bool) -> list[str]:
    out = []
    for point in sorted(set(ours) | set(theirs)):
        if point not in ours or point not in theirs:
            out.append(f"{point}: recorded only for {'ours' if point in ours else 'torch'}")
            continue
        a, b = ours[point], theirs[point]
        for name in sorted(set(a) | set(b)):
            if name not in a or name not in b:
                out.append(f"{point} {name}: present only for {'ours' if name in a else 'torch'}")
                continue
            (pa, ga), (pb, gb) = a[name], b[name]
            if pa != pb:
                out.append(f"{point} {name}: parameter on {pa} (ours) vs {pb} (torch)")
            by_design = (point, use_orig_params) in GRADIENT_DIFFERENCES or (
                (point, use_orig_params, ga, gb) in GRADIENT_ONLY_IN_TORCH
            )
            if ga != gb and not by_design:
                out.append(f"{point} {name}: gradient on {ga} (ours) vs {gb} (torch)")
    return out


def check_offload_placement_matches_torch(rank: int, world_size: int) -> None:
    ours, theirs = load_api("builtin"), load_api("torch-fsdp")
    problems: list[str] = []
    for model_name, strategy, orig in configurations():
        where = f"{model_name} {strategy} use_orig_params={orig}"
        log_ours = offload_step(ours, model_name, strategy, orig, _device())
        log_torch = offload_step(theirs, model_name, strategy, orig, _device())
        if not (world_size == 1 and strategy in ONE_RANK_HYBRID_DIFFERS):
            problems += [f"{where}: {d}" for d in _differences(log_ours, log_torch, orig)]
        problems += [f"{where}: ours: {v}" for v in offload_violations(log_ours, "cuda")]
        problems += [f"{where}: torch: {v}" for v in offload_violations(log_torch, "cuda")]
    assert not problems, "\n".join(problems)


def check_module_moved_to_gpu_after_offload_wrapping(rank: int, world_size: int) -> None:
    msg = "An FSDP-managed module with parameter CPU offloading enabled has parameters on cuda"
    outcomes = {}
    for api in (load_api("builtin"), load_api("torch-fsdp")):
        for orig in (False, True):
            model = wrap_bottom_up(
                NestedWrapped(_device()), api.wrap, cpu_offload=api.CPUOffload(offload_params=True), use_orig_params=orig
            )
            model.to(_device())
            try:
                inputs = to_device(NestedWrapped.get_input(step=0, rank=rank), _device())
                NestedWrapped.get_loss(inputs, model(*inputs)).backward()
            except RuntimeError as e:
                assert msg in str(e), (api.name, orig, str(e))
                if not api.is_torch:
                    assert "NestedWrapped" in str(e), str(e)
                outcomes[api.name, orig] = "refused"
                continue
            # Accepted: the parameters must be back where offload keeps them.
            bad = [n for n, p in model.named_parameters() if p.device.type != "cpu"]
            assert not bad, (api.name, orig, bad)
            outcomes[api.name, orig] = "accepted"
        dist.barrier()
    for orig in (False, True):
        assert outcomes["builtin", orig] == outcomes["torch-fsdp", orig], outcomes
    # With use_orig_params=False the flat parameter itself moves: both must refuse.
    assert outcomes["builtin", False] == "refused", outcomes


CHECKS = [check_offload_placement_matches_torch, check_module_moved_to_gpu_after_offload_wrapping]
rank_checks, test_check = rank_check_tests(CHECKS, world_size=WORLD, device="cuda", timeout_s=540)
