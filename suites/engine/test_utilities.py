"""no_sync, gradient accumulation, summon_full_params, clip_grad_norm_, attribute forwarding,
fsdp_modules and misuse errors, on 2 CPU ranks (one spawn of the ranks); accumulation parity with and
without no_sync as harness cases (``ACCUMULATION_CASES``, on the plugin's pool)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing import assert_close

from engine import FSDP, BackwardPrefetch, ShardingStrategy
from harness.cases.case import FLAT_STRATEGIES, FSDP1_STRATEGIES, CaseConfig
from harness.cases.model_protocol import wrap_bottom_up
from harness.conformance.engine_models import NESTED, TRANSFORMER, NestedWrapped
from harness.conformance.fsdp1_checks import all_data, assert_match, assert_params_match, full_params, load_api, optim
from harness.pytest_plugin.rank_checks import rank_check_tests
from harness.pytest_plugin import ParityRunner

CPU = torch.device("cpu")
STRATEGIES = [ShardingStrategy[FSDP1_STRATEGIES[s]] for s in FLAT_STRATEGIES]
BUILTIN = load_api("builtin")

#: Every strategy x use_orig_params: the nested model accumulating two micro-batches inside no_sync and
#: outside it (without zeroing gradients in between), the transformer three inside no_sync, against the
#: local reference accumulating the same micro-batches.
ACCUMULATION_CASES = [
    CaseConfig(engine="builtin", reference="local", sharding_strategy=strategy, use_orig_params=orig, **kwargs)
    for strategy, orig in itertools.product(FLAT_STRATEGIES, [False, True])
    for kwargs in (
        dict(model=NESTED, grad_accum="no_sync"),
        dict(model=TRANSFORMER, grad_accum="no_sync", extras=(("micro_batches", 3),)),
        dict(model=NESTED, grad_accum="sync"),
    )
]


@pytest.mark.parametrize("case", ACCUMULATION_CASES, ids=lambda c: c.full_id)
def test_accumulation_parity(case: CaseConfig, parity_runner: ParityRunner) -> None:
    parity_runner.run(case)


def _expect(exc: type[BaseException], match: str):
    return pytest.raises(exc, match=match)


def _trained_pair(kwargs: dict, norm_type: float, max_norm: float):
    ref = NestedWrapped()
    model = wrap_bottom_up(NestedWrapped(), FSDP, **kwargs)
    data = all_data(NestedWrapped, 0, dist.get_world_size(), CPU)
    inputs = NestedWrapped.get_input(step=0, rank=dist.get_rank())
    NestedWrapped.get_loss(inputs, model(*inputs)).backward()
    NestedWrapped.get_loss(data, ref(*data)).backward()
    total = model.clip_grad_norm_(max_norm, norm_type)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
    return model, ref, total, ref_total


def check_clip_grad_norm(rank: int, world_size: int) -> None:
    for strategy, orig, norm_type in itertools.product(STRATEGIES, [False, True], [2.0, 1.0, math.inf]):
        kwargs = dict(sharding_strategy=strategy, use_orig_params=orig)
        model, ref, total, ref_total = _trained_pair(kwargs, norm_type, max_norm=0.05)
        assert_match("clip_norm@0", total, ref_total, f"{kwargs} norm {norm_type}")
        assert ref_total > 0.05, "the test must actually clip"
        # Clipped gradients give the same step.
        opt, ref_opt = optim(model.parameters()), optim(ref.parameters())
        opt.step()
        ref_opt.step()
        assert_params_match(BUILTIN, model, ref, f"clip {kwargs} {norm_type}")


def check_clip_grad_norm_no_clip_when_small(rank: int, world_size: int) -> None:
    model, ref, total, ref_total = _trained_pair({}, 2.0, max_norm=1e6)
    assert_match("clip_norm@0", total, ref_total, "no clip")
    with FSDP.summon_full_params(model, with_grads=True):
        grads = {n: p.grad for n, p in model.named_parameters()}
    for n, p in ref.named_parameters():
        assert_match(f"grad:{n}", grads[n], p.grad, "no clip")


def check_summon_writeback(rank: int, world_size: int) -> None:
    for strategy, orig in itertools.product(STRATEGIES, [False, True]):
        model = wrap_bottom_up(NestedWrapped(), FSDP, sharding_strategy=strategy, use_orig_params=orig)
        x = NestedWrapped.get_input(step=0, rank=0)
        with FSDP.summon_full_params(model), torch.no_grad():
            model.module.inp.weight.fill_(0.5)
            model.module.out.weight.data = torch.full_like(model.module.out.weight, 0.25)
        with FSDP.summon_full_params(model, writeback=False), torch.no_grad():
            assert torch.all(model.module.inp.weight == 0.5), f"{strategy} orig={orig}: writeback lost"
            assert torch.all(model.module.out.weight == 0.25), f"{strategy} orig={orig}: .data writeback lost"
            model.module.inp.weight.fill_(3.0)
        with FSDP.summon_full_params(model), torch.no_grad():
            if strategy != ShardingStrategy.NO_SHARD:
                # NO_SHARD summons the flat parameter itself, so writes always persist (FSDP1).
                assert torch.all(model.module.inp.weight == 0.5), f"{strategy}: writeback=False persisted"
            model.module.inp.weight.fill_(0.5)
        # Forward sees the edit.
        ref = NestedWrapped()
        with torch.no_grad():
            ref.inp.weight.fill_(0.5)
            ref.out.weight.fill_(0.25)
        assert_close(model(*x), ref(*x))


def check_writeback_waits_for_each_units_first_all_gather(rank: int, world_size: int) -> None:
    """With use_orig_params each unit adopts user changes just before its own first all-gather of a forward,
    not all of them before the root's (which held back the step's first collective); a change made after
    the last step still reaches the forward (gradient writeback: the ported ``check_grad_writeback``)."""
    from engine.unit import FsdpUnit

    log: list[tuple[str, int]] = []
    writeback, unshard = FsdpUnit.writeback, FsdpUnit.unshard

    def logged_writeback(self: FsdpUnit) -> bool:
        log.append(("writeback", id(self)))
        return writeback(self)

    def logged_unshard(self: FsdpUnit, ctx) -> None:  # type: ignore[no-untyped-def]
        log.append(("unshard", id(self)))
        unshard(self, ctx)

    FsdpUnit.writeback, FsdpUnit.unshard = logged_writeback, logged_unshard  # type: ignore[method-assign]
    try:
        for strategy in STRATEGIES:
            model = wrap_bottom_up(NestedWrapped(), FSDP, sharding_strategy=strategy, use_orig_params=True,
                                   forward_prefetch=True)
            x = NestedWrapped.get_input(step=0, rank=0)
            NestedWrapped.get_loss(x, model(*x)).backward()
            model.zero_grad(set_to_none=True)
            with torch.no_grad():
                model.module.out.weight.data = torch.full_like(model.module.out.weight, 0.25)
            log.clear()
            out = model(*x)
            ref = NestedWrapped()
            with torch.no_grad():
                ref.out.weight.fill_(0.25)
            assert_close(out, ref(*x), msg=lambda m: f"{strategy}: the change before forward was lost: {m}")
            units = list(dict.fromkeys(name for op, name in log if op == "unshard"))
            assert units and log[0] == ("writeback", units[0]) and log[1] == ("unshard", units[0]), (strategy, log)
            for unit in units:  # each unit's own writeback comes before its all-gather, once per forward
                assert log.index(("writeback", unit)) < log.index(("unshard", unit)), (strategy, log)
            assert [n for op, n in log if op == "writeback"] == units, (strategy, log)
            NestedWrapped.get_loss(x, out).backward()
    finally:
        FsdpUnit.writeback, FsdpUnit.unshard = writeback, unshard  # type: ignore[method-assign]


def check_backward_keeps_the_forward_views_of_units_not_resharded(rank: int, world_size: int) -> None:
    """With use_orig_params a unit that keeps its parameters unsharded from forward to backward (SHARD_GRAD_OP)
    keeps forward's compute views through backward, as torch FSDP1 skips its pre-backward switch after skipping
    the post-forward one (``_skipped_use_sharded_views``): one view switch per unit and iteration, where making
    the views again cost a view op per parameter. FULL_SHARD shows the shard between forward and backward, so
    its pre-backward switches again; the root, resharded only in views, too."""
    from engine.flat_param import FlatParamHandle

    calls: list[int] = []
    switch = FlatParamHandle._use_unsharded_views

    def counted(self: FlatParamHandle, as_params: bool) -> None:
        calls.append(id(self))
        switch(self, as_params)

    FlatParamHandle._use_unsharded_views = counted  # type: ignore[method-assign]
    try:
        for strategy, per_unit in ((ShardingStrategy.SHARD_GRAD_OP, 1), (ShardingStrategy.FULL_SHARD, 2)):
            model = wrap_bottom_up(NestedWrapped(), FSDP, sharding_strategy=strategy, use_orig_params=True)
            units = [m for m in FSDP.fsdp_modules(model) if m._unit is not None]
            x = NestedWrapped.get_input(step=0, rank=rank)
            for _ in range(2):
                calls.clear()
                out = model(*x)
                forward_view = model.module.out.module.weight
                in_backward: list[torch.Tensor] = []
                # Runs after the units' pre-backward hooks on the same output (registered before it).
                out.register_hook(lambda grad: in_backward.append(model.module.out.module.weight))
                NestedWrapped.get_loss(x, out).backward()
                assert len(calls) == per_unit * len(units), (strategy, len(calls), len(units))
                assert (in_backward[0] is forward_view) == (per_unit == 1), strategy
                model.zero_grad(set_to_none=True)
    finally:
        FlatParamHandle._use_unsharded_views = switch  # type: ignore[method-assign]


def check_summon_options(rank: int, world_size: int) -> None:
    model = wrap_bottom_up(NestedWrapped(), FSDP, use_orig_params=True)
    ref = NestedWrapped()
    with _expect(ValueError, "rank0_only=True, writeback=True"):
        with FSDP.summon_full_params(model, rank0_only=True, writeback=True):
            pass
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
        w = model.module.inp.weight
        if rank == 0:
            assert w.shape == ref.inp.weight.shape
            assert_close(w, ref.inp.weight)
        else:
            assert w.dim() == 1, "other ranks keep their sharded view"
    with FSDP.summon_full_params(model, offload_to_cpu=True):
        assert model.module.inp.weight.device.type == "cpu"
    with FSDP.summon_full_params(model, recurse=False):
        assert model.module.inp.weight.shape == ref.inp.weight.shape, "the root's own parameters are full"
        assert model.module.out.module.weight.dim() == 1, "nested units stay sharded without recurse"
    # Clean names inside, FSDP-prefixed outside (FSDP1).
    with FSDP.summon_full_params(model):
        names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()], names
    assert all(n.startswith("_fsdp_wrapped_module.") for n, _ in model.named_parameters())


def check_summon_offload_to_cpu_with_no_shard_refused_as_torch(rank: int, world_size: int) -> None:
    # FSDP1 raises NotImplementedError for offload_to_cpu=True on a unit that does not shard, with or
    # without writeback; ours must refuse the same way (and name the unit), not summon and drop edits.
    from harness.conformance.fsdp1_checks import load_api

    for api in (load_api("builtin"), load_api("torch-fsdp")):
        for writeback in (True, False):
            model = wrap_bottom_up(NestedWrapped(), api.wrap, sharding_strategy=api.ShardingStrategy.NO_SHARD)
            before = {n: p.detach().clone() for n, p in model.named_parameters()}
            with _expect(NotImplementedError, "offload_to_cpu=True and NO_SHARD is not supported yet") as caught:
                with api.FSDP.summon_full_params(model, offload_to_cpu=True, writeback=writeback):
                    for p in model.parameters():
                        p.data.zero_()
            if not api.is_torch:
                assert "NestedWrapped" in str(caught.value) and "offload_to_cpu=False" in str(caught.value), str(caught.value)
            # Refused before anything was summoned: the parameters are untouched and training goes on.
            for n, p in model.named_parameters():
                assert_close(p, before[n], msg=lambda m: f"{api.name}: {n} changed by a refused summon: {m}")
            inputs = NestedWrapped.get_input(step=0, rank=rank)
            NestedWrapped.get_loss(inputs, model(*inputs)).backward()
    # Where every unit shards, offload_to_cpu is allowed and writeback=True lands.
    model = wrap_bottom_up(NestedWrapped(), FSDP, sharding_strategy=ShardingStrategy.FULL_SHARD)
    with FSDP.summon_full_params(model, offload_to_cpu=True, writeback=True):
        model.module.inp.weight.data.fill_(0.5)
    with FSDP.summon_full_params(model):
        assert bool((model.module.inp.weight == 0.5).all())


def check_summon_between_forward_and_backward(rank: int, world_size: int) -> None:
    for strategy, orig in itertools.product(STRATEGIES, [False, True]):
        kwargs = dict(sharding_strategy=strategy, use_orig_params=orig)
        ref = NestedWrapped()
        model = wrap_bottom_up(NestedWrapped(), FSDP, **kwargs)
        inputs = NestedWrapped.get_input(step=0, rank=rank)
        loss = NestedWrapped.get_loss(inputs, model(*inputs))
        with FSDP.summon_full_params(model, writeback=False):
            pass
        loss.backward()
        all_inputs = all_data(NestedWrapped, 0, world_size, CPU)
        NestedWrapped.get_loss(all_inputs, ref(*all_inputs)).backward()
        with FSDP.summon_full_params(model, with_grads=True):
            for (n, p), (rn, rp) in zip(model.named_parameters(), ref.named_parameters()):
                assert n == rn
                assert_match(f"grad:{n}", p.grad, rp.grad, str(kwargs))


def check_summon_inside_forward_raises(rank: int, world_size: int) -> None:
    class Summoner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.outer: nn.Module | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with FSDP.summon_full_params(self.outer):
                pass
            return self.lin(x)

    inner = Summoner()
    model = FSDP(inner)
    inner.outer = model
    with _expect(RuntimeError, "during forward or backward"):
        model(torch.randn(2, 3))


def check_forward_inside_summon_raises(rank: int, world_size: int) -> None:
    model = wrap_bottom_up(NestedWrapped(), FSDP)
    x = NestedWrapped.get_input(step=0, rank=rank)
    model(*x)
    with FSDP.summon_full_params(model):
        with _expect(RuntimeError, "forward inside summon_full_params"):
            model(*x)
    model(*x)


def check_attribute_forwarding_and_fsdp_modules(rank: int, world_size: int) -> None:
    seq = FSDP(nn.Sequential(FSDP(nn.Linear(3, 4)), nn.ReLU(), FSDP(nn.Linear(4, 2))))
    assert isinstance(seq[1], nn.ReLU)
    assert isinstance(seq[0], FSDP)
    model = wrap_bottom_up(NestedWrapped(), FSDP)
    assert model.inp is model.module.inp
    assert model.get_loss is NestedWrapped.get_loss
    assert len(FSDP.fsdp_modules(model)) == 5
    assert FSDP.fsdp_modules(model, root_only=True) == [model]
    with _expect(AttributeError, "no_such_attribute"):
        model.no_such_attribute


def check_misuse_errors(rank: int, world_size: int) -> None:
    model = wrap_bottom_up(NestedWrapped(), FSDP)
    model(*NestedWrapped.get_input(step=0, rank=rank))
    inner = model.module.out
    with _expect(RuntimeError, "root FSDP instance.*nested unit wrapping Linear"):
        with inner.no_sync():
            pass
    with _expect(RuntimeError, "root FSDP instance.*nested unit wrapping Linear"):
        inner.clip_grad_norm_(1.0)

    class Scalar(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(2.0))

    with _expect(ValueError, "scalar.*'scale'"):
        FSDP(Scalar())
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
    with _expect(ValueError, "both process_group and device_mesh"):
        FSDP(nn.Linear(2, 2), process_group=dist.group.WORLD, device_mesh=mesh)
    with _expect(ValueError, "hybrid"):
        FSDP(nn.Linear(2, 2), process_group=(dist.group.WORLD, dist.group.WORLD))


def check_divergent_forward_surfaces_as_timeout(rank: int, world_size: int) -> None:
    """A rank that skips a unit's forward leaves its peer alone in that unit's all-gather: the
    peer gets the process group's timeout error instead of hanging (runtime.py's note)."""
    from datetime import timedelta

    # The timeout is a wait (that it ends the all-gather is the check), not a measured quantity.
    group = dist.new_group(timeout=timedelta(seconds=2))

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(3, 3)
            self.second = nn.Linear(3, 3)
            self.skip_second = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.first(x)
            return x if self.skip_second else self.second(x)

    module = Branchy()
    module.second = FSDP(module.second, process_group=group)
    model = FSDP(module, process_group=group)
    module.skip_second = rank == 1
    dist.barrier(group)  # arrive together: only the divergence may time out
    if rank == 0:
        with _expect(RuntimeError, "[Tt]imed out|[Tt]imeout|closed|Connection"):
            model(torch.randn(2, 3))
    else:
        model(torch.randn(2, 3))
    dist.barrier()


def _traced_iteration(model: nn.Module, linears: list[nn.Module]) -> list[tuple[str, int]]:
    """One forward/backward, traced: ("AG"|"RS", unit index) per collective, ("F", i) per compute."""
    from unittest import mock

    trace: list[tuple[str, int]] = []
    index = {}
    for i, lin in enumerate(linears):
        n = sum(p.numel() for p in lin.parameters()) if not isinstance(lin, FSDP) else lin._flat_param.numel()
        index[n] = i
    orig_ag, orig_rs = dist.all_gather_into_tensor, dist.reduce_scatter_tensor

    def ag(out, inp, *a, **k):
        trace.append(("AG", index[inp.numel()]))
        return orig_ag(out, inp, *a, **k)

    def rs(out, inp, *a, **k):
        trace.append(("RS", index[out.numel()]))
        return orig_rs(out, inp, *a, **k)

    hooks = [lin.module.register_forward_pre_hook(lambda m, a, i=i: trace.append(("F", i))) for i, lin in enumerate(linears)]
    with mock.patch("torch.distributed.all_gather_into_tensor", ag), mock.patch("torch.distributed.reduce_scatter_tensor", rs):
        model(torch.randn(2, 4)).sum().backward()
    for h in hooks:
        h.remove()
    return trace


def check_prefetch_follows_recorded_order(rank: int, world_size: int) -> None:
    from engine.wrap import ModuleWrapPolicy

    def build(**kwargs):
        model = FSDP(
            nn.Sequential(nn.Linear(4, 5), nn.Linear(5, 6), nn.Linear(6, 7), nn.Linear(7, 8)),
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            **kwargs,
        )
        return model, list(model.module)

    model, linears = build(forward_prefetch=True, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
    first = _traced_iteration(model, linears)
    # First iteration: no order yet, so each unit gathers right before its own compute.
    for i in range(3):
        assert first.index(("F", i)) < first.index(("AG", i + 1)), first
    second = _traced_iteration(model, linears)
    for i in range(3):
        assert second.index(("AG", i + 1)) < second.index(("F", i)), f"forward prefetch missing: {second}"
    backward = second[second.index(("F", 3)) + 1 :]
    for i in range(3, 0, -1):
        assert backward.index(("AG", i - 1)) < backward.index(("RS", i)), f"BACKWARD_PRE prefetch missing: {backward}"
    model, linears = build(forward_prefetch=False, backward_prefetch=None)
    _traced_iteration(model, linears)
    plain = _traced_iteration(model, linears)
    for i in range(3):
        assert plain.index(("F", i)) < plain.index(("AG", i + 1)), f"prefetched without forward_prefetch: {plain}"


def check_device_mesh(rank: int, world_size: int) -> None:
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (world_size,))
    ref = NestedWrapped()
    model = FSDP(NestedWrapped(), device_mesh=mesh)
    x = NestedWrapped.get_input(step=0, rank=rank)
    assert_close(model(*x), ref(*x))


def check_eval_forward_after_training(rank: int, world_size: int) -> None:
    for strategy in STRATEGIES:
        model = wrap_bottom_up(NestedWrapped(), FSDP, sharding_strategy=strategy, backward_prefetch=BackwardPrefetch.BACKWARD_PRE)
        opt = optim(model.parameters())
        x = NestedWrapped.get_input(step=0, rank=rank)
        NestedWrapped.get_loss(x, model(*x)).backward()
        opt.step()
        model.eval()
        out = model(*x)
        with torch.no_grad():
            out_ng = model(*x)
        assert_close(out, out_ng)
        # A step after a forward that had no backward must be seen by the next forward.
        opt.step()
        with torch.no_grad():
            after = model(*x)
        plain = NestedWrapped()
        plain.load_state_dict(full_params(BUILTIN, model))
        with torch.no_grad():
            expected = plain(*x)
        assert_close(after, expected, msg=lambda m: f"{strategy}: stale unsharded parameters: {m}")


CHECKS = [
    check_clip_grad_norm,
    check_clip_grad_norm_no_clip_when_small,
    check_summon_writeback,
    check_writeback_waits_for_each_units_first_all_gather,
    check_backward_keeps_the_forward_views_of_units_not_resharded,
    check_summon_options,
    check_summon_offload_to_cpu_with_no_shard_refused_as_torch,
    check_summon_between_forward_and_backward,
    check_summon_inside_forward_raises,
    check_forward_inside_summon_raises,
    check_attribute_forwarding_and_fsdp_modules,
    check_misuse_errors,
    check_prefetch_follows_recorded_order,
    check_device_mesh,
    check_eval_forward_after_training,
    # Last: its peer timeout must not take other checks down with it.
    check_divergent_forward_surfaces_as_timeout,
]
rank_checks, test_check = rank_check_tests(CHECKS)
