"""Seed behaviours of torch's test_fsdp_use_orig_params.py, as conformance checks run against every
engine with torch FSDP1's API (``fsdp_api``: our engine and torch FSDP1), 2 ranks on the CPU and on the GPUs:
parameter groups with different hyperparameters (with and without CPU offload), different
trainability, multiple optimizers,
multiple forwards before backward, summon between two forwards, access after forward, parameter
and gradient writeback (and shape mismatch), no-reshard changes between forward and backward,
FQNs in forward, no_sync correctness and mixed-precision dtypes, non-uniform requires_grad.

DDP is the reference where the seed uses it; no_sync against the all-data reference is harness cases
(``seed_parity``). The CI lane runs a representative part of the seed's test_diff_hyperparams (6 subtests
that show every value of every axis) and of its test_fsdp_compile (FULL_SHARD, with activation
checkpointing); the slow lane (``--matrix pairwise|full``, ``SLOW_CHECKS``) runs their whole products,
10 iterations each, with the seed's init modes on CUDA ranks and inductor there. ``_train_parity`` stays (SGD and Adam family with and
without ``foreach``, per-group hyperparameters, ``set_to_none=False``, frozen parameters): the optimizer
axis (``adamw_groups``, ``two_optimizers``) does not express those.
"""

from __future__ import annotations

import itertools
import os
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from harness.conformance.engine_models import SharedTransformer
from harness.conformance.fsdp1_checks import FSDPApi, assert_match, clean as _clean, load_api
from harness.conformance.rank_sessions import api_session_tests
from harness.fsdp1_api import no_shard_offload_race
from harness.model_protocol import to_device, wrap_bottom_up
from harness.optim import sgd
from harness.rank import rank_device

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = ["session", "test_check",
           "test_hyperparam_subtests_are_the_seeds_product_and_smoke_shows_every_value"]


def _input(step: int, rank: int) -> tuple[torch.Tensor, ...]:
    """The transformer's batch of ``step`` on this rank's device."""
    return to_device(SharedTransformer.get_input(step=step, rank=rank), rank_device())


def _strategies(api: FSDPApi) -> list:
    return [api.ShardingStrategy.NO_SHARD, api.ShardingStrategy.SHARD_GRAD_OP, api.ShardingStrategy.FULL_SHARD]


def _layer_policy(api: FSDPApi) -> object:
    return api.policy("ModuleWrapPolicy")({nn.TransformerEncoderLayer})


def _linear_policy(api: FSDPApi) -> object:
    return api.policy("ModuleWrapPolicy")({nn.Linear})


def _param_groups(model: nn.Module) -> list[dict[str, Any]]:
    groups: list[dict[str, Any]] = [
        {"params": [], "weight_decay": 0.1, "lr": 1e-2},
        {"params": [], "weight_decay": 0.01, "lr": 1e-3},
        {"params": []},
    ]
    for name, p in model.named_parameters():
        groups[0 if "weight" in name else 1 if "bias" in name else 2]["params"].append(p)
    return groups


def _adam_family(groups: Any, foreach: bool, adamw: bool) -> torch.optim.Optimizer:
    """The seed's optimizers over the parameter groups: AdamW for test_diff_hyperparams, Adam for its
    CPU-offload twin and for test_diff_trainability."""
    return (torch.optim.AdamW if adamw else torch.optim.Adam)(groups, lr=5e-3, foreach=foreach)


def _fsdp_transformer(api: FSDPApi, **kwargs: Any) -> nn.Module:
    return api.wrap(SharedTransformer(rank_device()), auto_wrap_policy=_layer_policy(api), use_orig_params=True, **kwargs)


def _check_param_parity(api: FSDPApi, ddp: DDP, fsdp: nn.Module, adam_steps: int = 0, lr: float = 0.0) -> None:
    """Full parameters equal DDP's. ``adam_steps``/``lr``: see ``_key_bias_bound``."""
    with api.FSDP.summon_full_params(fsdp):
        pairs = list(zip(ddp.module.named_parameters(), fsdp.named_parameters()))
        assert len(pairs) == len(list(ddp.module.parameters()))
        for (n1, p1), (n2, p2) in pairs:
            assert n1 == _clean(n2), (n1, n2)
            # Where summoned parameters live is the engine's: torch FSDP1 leaves NO_SHARD's offloaded
            # parameters on the CPU (nothing to unshard), so values are compared on DDP's device.
            p2 = p2.to(p1.device)
            if adam_steps and n1.endswith("self_attn.in_proj_bias") and p1.device.type == "cuda":
                p1, p2 = _key_bias_bound(p1, p2, adam_steps * lr, n1)
            assert_match(f"param:{n1}", p1, p2, "against DDP")


def _key_bias_bound(ddp_bias: torch.Tensor, fsdp_bias: torch.Tensor, bound: float, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the key projection's bias (the middle third of ``in_proj_bias``) within Adam's step bound
    and return the query and value thirds for the exact comparison.

    Adding a constant to every key shifts each attention row's scores by one constant, which softmax
    ignores: the key bias's gradient is zero in exact arithmetic, so what trains it is rounding noise,
    and Adam scales noise to steps of up to ``lr``. On CPU ranks both sides round alike and the check
    stays exact; on CUDA ranks (measured on an H100) DDP's and both FSDP1 engines' noise differ, every
    sharding strategy alike, in this third only. It is held to the bound an Adam step allows."""
    q, k, v = ddp_bias.detach().chunk(3)
    fq, fk, fv = fsdp_bias.detach().chunk(3)
    assert_close(fk, k, rtol=0.0, atol=bound, msg=lambda m: f"{name} (key third, within lr x steps = {bound}): {m}")
    return torch.cat([q, v]), torch.cat([fq, fv])


#: the seed's training iterations per parity subtest (its ``_check_train_parity`` and test_fsdp_compile).
SEED_ITERS = 10


def _train_parity(api: FSDPApi, ddp: DDP, ddp_opt, fsdp: nn.Module, fsdp_opt, set_to_none: bool,
                  iters: int = SEED_ITERS) -> None:
    adam = isinstance(ddp_opt, torch.optim.Adam | torch.optim.AdamW)
    rank = dist.get_rank()
    for i in range(iters):
        losses = []
        for model, opt in ((ddp, ddp_opt), (fsdp, fsdp_opt)):
            if i % 2 == 0:
                opt.zero_grad(set_to_none=set_to_none)
            inputs = _input(i, rank)
            loss = SharedTransformer.get_loss(inputs, model(*inputs))
            losses.append(loss)
            if i % 2 == 1:
                # Zeroing between forward and backward must not keep the old gradient.
                opt.zero_grad(set_to_none=set_to_none)
            loss.backward()
            opt.step()
        assert_match(f"loss@{i}", losses[0].detach(), losses[1].detach(), "against DDP")
    lr = max(group["lr"] for group in ddp_opt.param_groups)
    _check_param_parity(api, ddp, fsdp, adam_steps=iters if adam else 0, lr=lr)


#: The axes of the seed's test_diff_hyperparams subtests, each with its values (the sharding strategy by its
#: member name; the init mode: ``harness.conformance.seeds.seed_parity.init_modes``).
HYPERPARAM_AXES = ("strategy", "init_mode", "optim_before_wrap", "foreach", "set_to_none", "prefetch", "skip_writeback_check")


def hyperparam_subtests(offload: bool, device: str, smoke: bool) -> list[dict[str, Any]]:
    """The seed's test_diff_hyperparams subtests: every strategy x init mode (before and after wrapping on
    CUDA ranks; before with offload, as the seed's offload twin) x optimizer built before or after wrapping x
    ``foreach`` x ``set_to_none`` x backward prefetch x writeback check skipped or not. ``smoke`` (the CI
    lane) keeps 6 of them that show every value of every axis."""
    modes = ["before", "after"] if device == "cuda" and not offload else ["before"]
    values = (["NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD"], modes, [False, True], [False, True], [False, True],
              [None, "BACKWARD_PRE", "BACKWARD_POST"], [False, True])
    if not smoke:
        return [dict(zip(HYPERPARAM_AXES, combo)) for combo in itertools.product(*values)]
    # Row i takes a value of each axis by its own turn, so that 6 rows show them all.
    turns = (lambda i: i % 3, lambda i: i, lambda i: i % 2, lambda i: i // 3, lambda i: (i // 2) % 2,
             lambda i: (i + i // 3) % 3, lambda i: ((i + 1) // 2) % 2)
    return [{axis: vals[turn(i) % len(vals)] for axis, vals, turn in zip(HYPERPARAM_AXES, values, turns)} for i in range(6)]


def _diff_hyperparams(api: FSDPApi, offload: bool, smoke: bool) -> None:
    api.require_offload(offload)
    device = rank_device()
    for sub in hyperparam_subtests(offload, device.type, smoke):
        strategy = getattr(api.ShardingStrategy, sub["strategy"])
        # torch FSDP1's NO_SHARD offload race (``harness.fsdp1_api.no_shard_offload_race``) is stress's to show.
        if no_shard_offload_race(api.name, device.type, sub["strategy"].lower(), offload, True):
            continue
        if sub["skip_writeback_check"]:
            os.environ["FSDP_SKIP_WRITEBACK_CHECK"] = "1"
        try:
            ddp = DDP(SharedTransformer(device))
            ddp_opt = _adam_family(_param_groups(ddp), sub["foreach"], adamw=not offload)
            prefetch = sub["prefetch"] and getattr(api.BackwardPrefetch, sub["prefetch"])
            kwargs = dict(sharding_strategy=strategy, backward_prefetch=prefetch, cpu_offload=api.CPUOffload(offload))
            # The seed's CUDA_AFTER: built on the CPU, wrapped there, moved to the GPU after.
            after = sub["init_mode"] == "after"
            module = SharedTransformer("cpu" if after else device)
            if sub["optim_before_wrap"]:
                fsdp_opt = _adam_family(_param_groups(module), sub["foreach"], adamw=not offload)
                fsdp = api.wrap(module, auto_wrap_policy=_layer_policy(api), use_orig_params=True, **kwargs)
            else:
                fsdp = api.wrap(module, auto_wrap_policy=_layer_policy(api), use_orig_params=True, **kwargs)
                fsdp_opt = _adam_family(_param_groups(fsdp), sub["foreach"], adamw=not offload)
            if after:
                fsdp = fsdp.to(device)
            _train_parity(api, ddp, ddp_opt, fsdp, fsdp_opt, sub["set_to_none"])
        finally:
            os.environ.pop("FSDP_SKIP_WRITEBACK_CHECK", None)


def check_diff_hyperparams(api: FSDPApi, rank: int, world_size: int) -> None:
    _diff_hyperparams(api, offload=False, smoke=True)


def check_diff_hyperparams_cpu_offload(api: FSDPApi, rank: int, world_size: int) -> None:
    _diff_hyperparams(api, offload=True, smoke=True)


def check_diff_hyperparams_every_subtest(api: FSDPApi, rank: int, world_size: int) -> None:
    _diff_hyperparams(api, offload=False, smoke=False)


def check_diff_hyperparams_cpu_offload_every_subtest(api: FSDPApi, rank: int, world_size: int) -> None:
    _diff_hyperparams(api, offload=True, smoke=False)


def check_diff_trainability(api: FSDPApi, rank: int, world_size: int) -> None:
    """The seed's: Adam over the three parameter groups, BACKWARD_PRE, the biases (one group) frozen, every
    strategy x ``foreach``."""
    for strategy, foreach in itertools.product(_strategies(api), [False, True]):
        ddp = DDP(SharedTransformer(rank_device()), find_unused_parameters=True)
        ddp_opt = _adam_family(_param_groups(ddp), foreach, adamw=False)
        fsdp = _fsdp_transformer(api, sharding_strategy=strategy, backward_prefetch=api.BackwardPrefetch.BACKWARD_PRE)
        fsdp_opt = _adam_family(_param_groups(fsdp), foreach, adamw=False)
        for model in (ddp, fsdp):
            for name, p in model.named_parameters():
                if "bias" in name:
                    p.requires_grad_(False)
        _train_parity(api, ddp, ddp_opt, fsdp, fsdp_opt, set_to_none=False)


def _grads_between_forward_and_backward(model: nn.Module) -> list[str]:
    """Per parameter: ``none`` or ``zero`` (what ``zero_grad`` left) or ``stale`` (an old gradient kept)."""
    out = []
    for p in model.parameters():
        out.append("none" if p.grad is None else "zero" if not p.grad.count_nonzero() else "stale")
    return out


def check_multiple_optimizers(api: FSDPApi, rank: int, world_size: int) -> None:
    """The seed's two optimizers: Adam (5e-3) over the weights, AdamW (1e-2) over the rest, the first
    zeroing to None and the second to zeros; at one step the first's gradients are dropped before stepping
    (Adam skips a None gradient but steps a zero one); ``.grad`` between forward and backward holds no
    stale gradient."""
    for strategy in (api.ShardingStrategy.FULL_SHARD, api.ShardingStrategy.SHARD_GRAD_OP):
        ddp = DDP(SharedTransformer(rank_device()))
        fsdp = _fsdp_transformer(api, sharding_strategy=strategy)
        opts = []
        for model in (ddp, fsdp):
            groups = _param_groups(model)
            opts.append((torch.optim.Adam(groups[:1], lr=5e-3, foreach=False),
                         torch.optim.AdamW(groups[1:], lr=1e-2, foreach=False)))
        for i in range(6):
            losses, seen = [], []
            for model, (a, b) in zip((ddp, fsdp), opts):
                if i > 0:
                    a.zero_grad(set_to_none=True)
                    b.zero_grad(set_to_none=False)
                inputs = _input(i, rank)
                loss = SharedTransformer.get_loss(inputs, model(*inputs))
                seen.append(sorted(_grads_between_forward_and_backward(model)))
                loss.backward()
                if i == 3:
                    a.zero_grad(set_to_none=True)  # a step with None gradients for the first optimizer
                a.step()
                b.step()
                losses.append(loss)
            # A sharded parameter's gradient outside its rank's shard may be None where DDP has zeros;
            # neither may keep the previous step's gradient.
            assert "stale" not in seen[0] + seen[1], f"{strategy} step {i}: .grad between forward and backward {seen}"
            assert_match(f"loss@{i}", losses[0].detach(), losses[1].detach(), str(strategy))
        _check_param_parity(api, ddp, fsdp)


def _compiled_parity(api: FSDPApi, strategy: Any, iters: int, skip_fsdp_guards: bool | None = None) -> None:
    """The wrapped transformer (layers as units, original parameters, BACKWARD_PRE) under ``torch.compile``
    trains as the same engine's eager model, losses compared every iteration, and Dynamo compiles graphs
    (inductor on GPUs; ``aot_eager`` on CPU ranks, where inductor takes about a minute per graph on two
    cores). The compiled model checkpoints activations inside its units: without that Dynamo skips the
    FSDP1 modules' forward whole (both engines; measured with torch 2.13) and compiles no graph, so the
    seed's check would compare eager with eager. ``skip_fsdp_guards``: Dynamo's ``skip_fsdp_guards`` for
    the run (None keeps the default)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from harness.compiling import backend_for, check_compiled, compiled_counts

    kwargs = dict(auto_wrap_policy=_layer_policy(api), use_orig_params=True, sharding_strategy=strategy,
                  backward_prefetch=api.BackwardPrefetch.BACKWARD_PRE)
    ref = api.wrap(SharedTransformer(rank_device()), **kwargs)
    model = api.wrap(SharedTransformer(rank_device()), **kwargs)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.TransformerEncoderLayer))
    torch._dynamo.reset()
    counters.clear()
    guards = {} if skip_fsdp_guards is None else {"skip_fsdp_guards": skip_fsdp_guards}
    with torch._dynamo.config.patch(**guards):
        compiled = torch.compile(model, backend=backend_for(rank_device().type))
        ref_opt, opt = torch.optim.Adam(ref.parameters(), lr=1e-2), torch.optim.Adam(model.parameters(), lr=1e-2)
        for i in range(iters):
            losses = []
            inputs = _input(i, dist.get_rank())
            for m, o in ((ref, ref_opt), (compiled, opt)):
                o.zero_grad()
                loss = SharedTransformer.get_loss(inputs, m(*inputs))
                loss.backward()
                o.step()
                losses.append(loss.detach())
            where = f"compiled against eager, {strategy}, skip_fsdp_guards={skip_fsdp_guards}"
            assert_match(f"loss@{i}", losses[1], losses[0], where)
    check_compiled(compiled_counts())


def check_fsdp_compile(api: FSDPApi, rank: int, world_size: int) -> None:
    """The seed's test_fsdp_compile in the CI lane: FULL_SHARD, 3 iterations (the seed's product:
    ``check_fsdp_compile_every_subtest``; the parity matrix's ``compile`` axis has the rest)."""
    _compiled_parity(api, api.ShardingStrategy.FULL_SHARD, iters=3)


def check_fsdp_compile_every_subtest(api: FSDPApi, rank: int, world_size: int) -> None:
    """The seed's test_fsdp_compile: every strategy x Dynamo's ``skip_fsdp_guards``, 10 iterations each."""
    for strategy, skip_guards in itertools.product(_strategies(api), (True, False)):
        _compiled_parity(api, strategy, iters=SEED_ITERS, skip_fsdp_guards=skip_guards)


def _orig_and_flat_models(api: FSDPApi, strategy: Any, offload: bool):
    models = []
    for orig in (False, True):
        model = wrap_bottom_up(SharedTransformer(rank_device()), 
            api.wrap, sharding_strategy=strategy, cpu_offload=api.CPUOffload(offload), use_orig_params=orig
        )
        models.append((model, torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)))
    return models


def _fsdp_params_equal(api: FSDPApi, a: nn.Module, b: nn.Module) -> None:
    with api.FSDP.summon_full_params(a), api.FSDP.summon_full_params(b):
        for (n1, p1), (n2, p2) in zip(a.named_parameters(), b.named_parameters()):
            assert n1 == n2
            assert_close(p1, p2)


def _multiple_forward(api: FSDPApi, offload: bool) -> None:
    api.require_offload(offload)
    rank = dist.get_rank()
    for strategy in _strategies(api):
        (m1, o1), (m2, o2) = _orig_and_flat_models(api, strategy, offload)
        for i in range(3):
            inp1 = _input(i, rank)
            inp2 = _input(i + 100, rank)
            results = []
            for model, opt in ((m1, o1), (m2, o2)):
                opt.zero_grad()
                l1, l2 = SharedTransformer.get_loss(inp1, model(*inp1)), SharedTransformer.get_loss(inp2, model(*inp2))
                (l1 + l2).backward()
                opt.step()
                results.append((l1, l2))
            assert_close(results[0], results[1], msg=lambda m: f"{strategy} offload={offload}: {m}")
        _fsdp_params_equal(api, m1, m2)


def check_multiple_forward(api: FSDPApi, rank: int, world_size: int) -> None:
    _multiple_forward(api, offload=False)


def check_multiple_forward_cpu_offload(api: FSDPApi, rank: int, world_size: int) -> None:
    _multiple_forward(api, offload=True)


def _summon_between_two_forwards(api: FSDPApi, offload: bool) -> None:
    api.require_offload(offload)
    rank = dist.get_rank()
    for strategy in _strategies(api):
        (m1, o1), (m2, o2) = _orig_and_flat_models(api, strategy, offload)
        for i in range(3):
            o1.zero_grad()
            o2.zero_grad()
            inp1 = _input(i, rank)
            a1, b1 = SharedTransformer.get_loss(inp1, m1(*inp1)), SharedTransformer.get_loss(inp1, m2(*inp1))
            assert_close(a1, b1)
            _fsdp_params_equal(api, m1, m2)
            inp2 = _input(i + 100, rank)
            a2, b2 = SharedTransformer.get_loss(inp2, m1(*inp2)), SharedTransformer.get_loss(inp2, m2(*inp2))
            assert_close(a2, b2)
            (a1 + a2).backward()
            (b1 + b2).backward()
            o1.step()
            o2.step()
        _fsdp_params_equal(api, m1, m2)


def check_summon_between_two_forwards(api: FSDPApi, rank: int, world_size: int) -> None:
    _summon_between_two_forwards(api, offload=False)


def check_summon_between_two_forwards_cpu_offload(api: FSDPApi, rank: int, world_size: int) -> None:
    _summon_between_two_forwards(api, offload=True)


class _Lin2(nn.Module):
    """The seed's writeback model: Linear(5, 5) -> ReLU -> Linear(5, 7)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.lin1 = nn.Linear(5, 5, device=rank_device())
        self.lin2 = nn.Linear(5, 7, device=rank_device())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))

    def get_input(self) -> tuple[torch.Tensor, ...]:
        return (torch.randn((2, 5)).to(rank_device()),)


def check_access_params_after_forward(api: FSDPApi, rank: int, world_size: int) -> None:
    for strategy in _strategies(api):
        ref = _Lin2()
        model = api.wrap(_Lin2(), sharding_strategy=strategy, auto_wrap_policy=_linear_policy(api), use_orig_params=True)
        x = model.get_input()
        model(*x)
        for name in ("weight", "bias"):
            p = getattr(model.module.lin1, name)
            full = getattr(ref.lin1, name).detach().reshape(-1)
            if strategy == api.ShardingStrategy.FULL_SHARD:
                # Resharded: the sharded, flattened original parameter.
                start = rank * p.numel() if rank == 0 else full.numel() - p.numel()
                assert p.dim() == 1 and p.numel() <= full.numel()
                assert_close(p.detach(), full[start : start + p.numel()] if rank == 0 else full[full.numel() - p.numel() :])
            else:
                # Not resharded: the unsharded view used by forward.
                assert_close(p.detach(), getattr(ref.lin1, name).detach())


def check_param_writeback(api: FSDPApi, rank: int, world_size: int) -> None:
    def transform(p: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(torch.ones_like(p) * 2)

    for first, change_data in itertools.product([True, False], [True, False]):
        ddp = DDP(_Lin2())
        fsdp = api.wrap(_Lin2(), use_orig_params=True)
        for m in (ddp.module, fsdp.module):
            lin = m.lin1 if first else m.lin2
            if change_data:
                lin.weight.data = transform(lin.weight)
            else:
                lin.weight = transform(lin.weight)
        _check_param_parity(api, ddp, fsdp)


def check_grad_writeback(api: FSDPApi, rank: int, world_size: int) -> None:
    for first, change_data, set_to_none in itertools.product([False, True], [False, True], [False, True]):
        if change_data and set_to_none:
            continue

        def transform(p: nn.Parameter) -> torch.Tensor | None:
            return None if set_to_none else torch.ones_like(p) * 2

        ddp = DDP(_Lin2())
        fsdp = api.wrap(_Lin2(), use_orig_params=True)
        ddp_opt = sgd(ddp.parameters(), lr=1e-2, momentum=0.9)
        fsdp_opt = sgd(fsdp.parameters(), lr=1e-2, momentum=0.9)
        for step in range(2):
            torch.manual_seed(step + 10 * rank)
            x = fsdp.get_input()
            ddp(*x).sum().backward()
            fsdp(*x).sum().backward()
            if step == 0:
                for m in (ddp.module, fsdp.module):
                    w = (m.lin1 if first else m.lin2).weight
                    if change_data:
                        if w.grad is not None:
                            w.grad.data = transform(w)
                    else:
                        w.grad = transform(w)
            ddp_opt.step()
            fsdp_opt.step()
            _check_param_parity(api, ddp, fsdp)
            # Gradients deliberately not zeroed: the next backward accumulates onto the writeback.


def check_writeback_shape_mismatch(api: FSDPApi, rank: int, world_size: int) -> None:
    fsdp = api.wrap(_Lin2(), use_orig_params=True)
    lin = fsdp.module.lin1 if rank == 0 else fsdp.module.lin2
    shape = [d + 1 for d in lin.weight.shape]
    lin.weight = nn.Parameter(torch.randn(shape, device=rank_device()))
    lin.weight.grad = torch.randn(shape, device=rank_device())
    with pytest.raises(RuntimeError, match="Cannot writeback when the parameter shape changes"):
        with api.FSDP.summon_full_params(fsdp):
            pass
    fsdp = api.wrap(_Lin2(), use_orig_params=True)
    lin = fsdp.module.lin1 if rank == 0 else fsdp.module.lin2
    # ``.grad =`` itself refuses another shape; ``.grad.data`` does not.
    lin.weight.grad = torch.zeros_like(lin.weight)
    lin.weight.grad.data = torch.randn([d + 1 for d in lin.weight.shape], device=rank_device())
    with pytest.raises(RuntimeError, match="Cannot writeback when the gradient shape changes"):
        with api.FSDP.summon_full_params(fsdp):
            pass


def check_writeback_between_fwd_and_bwd_for_no_reshard_raises(api: FSDPApi, rank: int, world_size: int) -> None:
    kwargs = dict(sharding_strategy=api.ShardingStrategy.SHARD_GRAD_OP, auto_wrap_policy=_linear_policy(api), use_orig_params=True)
    msg = "FSDP does not support changing the parameters between forward and backward"
    fsdp = api.wrap(_Lin2(), **kwargs)
    loss = fsdp(*fsdp.get_input()).sum()
    fsdp.lin1.weight.data = fsdp.lin1.weight.clone()
    with pytest.raises(AssertionError, match=msg):
        loss.backward()
    fsdp = api.wrap(_Lin2(), **kwargs)
    loss = fsdp(*fsdp.get_input()).sum()
    fsdp.lin1._fsdp_wrapped_module.weight = nn.Parameter(fsdp.lin1.weight.clone())
    with pytest.raises(AssertionError, match=msg):
        loss.backward()
    # FSDP_SKIP_WRITEBACK_CHECK=1 turns the check off.
    os.environ["FSDP_SKIP_WRITEBACK_CHECK"] = "1"
    try:
        fsdp = api.wrap(_Lin2(), **kwargs)
        loss = fsdp(*fsdp.get_input()).sum()
        fsdp.lin1.weight.data = fsdp.lin1.weight.clone()
        loss.backward()
    finally:
        os.environ.pop("FSDP_SKIP_WRITEBACK_CHECK")


def _no_reshard_and_mixed_precision(api: FSDPApi, full_prec_in_eval: bool) -> None:
    """Compute runs in bf16 in train, and in eval unless ``FSDP_USE_FULL_PREC_IN_EVAL=1`` (read when the
    units are built); summoned parameters are in full precision, whatever the order of train/eval switches
    and summons without resharding after forward, and no writeback is falsely triggered."""
    if full_prec_in_eval:
        os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
    try:
        fsdp = api.wrap(
            _Lin2(),
            sharding_strategy=api.ShardingStrategy.SHARD_GRAD_OP,
            auto_wrap_policy=_linear_policy(api),
            mixed_precision=api.MixedPrecision(param_dtype=torch.bfloat16),
            use_orig_params=True,
        )
    finally:
        os.environ.pop("FSDP_USE_FULL_PREC_IN_EVAL", None)
    eval_dtype = torch.float32 if full_prec_in_eval else torch.bfloat16
    x = fsdp.get_input()
    assert fsdp(*x).dtype == torch.bfloat16
    with api.FSDP.summon_full_params(fsdp):
        assert {p.dtype for p in fsdp.parameters()} == {torch.float32}
    fsdp.train()
    assert fsdp(*x).dtype == torch.bfloat16
    fsdp.eval()
    assert fsdp(*x).dtype == eval_dtype
    fsdp.train()
    loss = fsdp(*x).sum()
    assert loss.dtype == torch.bfloat16 and torch.isfinite(loss)
    loss.backward()
    fsdp.eval()
    assert fsdp(*x).dtype == eval_dtype
    with api.FSDP.state_dict_type(fsdp, api.StateDictType.SHARDED_STATE_DICT):
        fsdp.load_state_dict(fsdp.state_dict())
    fsdp(*x).sum().backward()


def check_no_reshard_and_mixed_precision(api: FSDPApi, rank: int, world_size: int) -> None:
    _no_reshard_and_mixed_precision(api, full_prec_in_eval=False)


def check_no_reshard_and_mixed_precision_full_prec_in_eval(api: FSDPApi, rank: int, world_size: int) -> None:
    _no_reshard_and_mixed_precision(api, full_prec_in_eval=True)


def check_named_parameters_in_forward(api: FSDPApi, rank: int, world_size: int) -> None:
    seen: list[tuple[list[str], list[torch.Size]]] = []

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(5, 5, device=rank_device())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            named = list(self.named_parameters())
            seen.append(([_clean(n) for n, _ in named], [p.shape for _, p in named]))
            return self.lin(x)

    model = Model()
    shapes = [model.lin.weight.shape, model.lin.bias.shape]
    api.wrap(model, use_orig_params=True)(torch.randn(2, 5, device=rank_device()))
    assert seen == [(["lin.weight", "lin.bias"], shapes)], seen


def _no_sync_models(api: FSDPApi, strategy: Any):
    return [
        (m, sgd(m.parameters(), lr=1e-2, momentum=0.9))
        for m in (wrap_bottom_up(SharedTransformer(rank_device()), api.wrap, sharding_strategy=strategy, use_orig_params=o) for o in (False, True))
    ]


def check_no_sync_correctness(api: FSDPApi, rank: int, world_size: int) -> None:
    for strategy in (api.ShardingStrategy.FULL_SHARD, api.ShardingStrategy.SHARD_GRAD_OP, api.ShardingStrategy.NO_SHARD):
        pairs = _no_sync_models(api, strategy)
        for i in range(3):
            for model, opt in pairs:
                with model.no_sync():
                    inputs = _input(i, rank)
                    SharedTransformer.get_loss(inputs, model(*inputs)).backward()
                inputs = _input(i + 50, rank)
                SharedTransformer.get_loss(inputs, model(*inputs)).backward()
                opt.step()
                opt.zero_grad()
        _fsdp_params_equal(api, pairs[0][0], pairs[1][0])


def check_no_sync_mixed_precision(api: FSDPApi, rank: int, world_size: int) -> None:
    low = torch.bfloat16  # CPU kernels: bfloat16 stands in for the seed's float16
    for strategy in (api.ShardingStrategy.FULL_SHARD, api.ShardingStrategy.SHARD_GRAD_OP, api.ShardingStrategy.NO_SHARD):
        model = api.wrap(
            nn.Linear(3, 3, device=rank_device()),
            sharding_strategy=strategy,
            mixed_precision=api.MixedPrecision(param_dtype=low, reduce_dtype=torch.float32),
            use_orig_params=True,
        )
        x = torch.randn(2, 3, device=rank_device())
        with model.no_sync():
            for _ in range(2):
                model(x).sum().backward()
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                assert grads and all(g.dtype == low for g in grads), (strategy, [g.dtype for g in grads])
        model(x).sum().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        assert grads and all(g.dtype == torch.float32 for g in grads), (strategy, [g.dtype for g in grads])


def check_non_uniform_requires_grad(api: FSDPApi, rank: int, world_size: int) -> None:
    model = nn.Sequential(nn.Linear(3, 3, device=rank_device()), nn.Linear(3, 3, device=rank_device()))
    model[0].bias.requires_grad = False
    model[1].bias.requires_grad = False
    fsdp = api.wrap(model, use_orig_params=True)
    assert fsdp[0].weight.requires_grad and fsdp[1].weight.requires_grad
    assert not fsdp[0].bias.requires_grad and not fsdp[1].bias.requires_grad
    fsdp(torch.randn(2, 3, device=rank_device())).sum().backward()
    assert fsdp[0].bias.grad is None and fsdp[1].bias.grad is None


CHECKS: list[Callable[[FSDPApi, int, int], None]] = [
    check_diff_hyperparams,
    check_diff_hyperparams_cpu_offload,
    check_diff_trainability,
    check_multiple_optimizers,
    check_multiple_forward,
    check_multiple_forward_cpu_offload,
    check_summon_between_two_forwards,
    check_summon_between_two_forwards_cpu_offload,
    check_access_params_after_forward,
    check_param_writeback,
    check_grad_writeback,
    check_writeback_shape_mismatch,
    check_writeback_between_fwd_and_bwd_for_no_reshard_raises,
    check_no_reshard_and_mixed_precision,
    check_no_reshard_and_mixed_precision_full_prec_in_eval,
    check_fsdp_compile,
    check_named_parameters_in_forward,
    check_no_sync_correctness,
    check_no_sync_mixed_precision,
    check_non_uniform_requires_grad,
]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("offload", [False, True], ids=["no_offload", "offload"])
def test_hyperparam_subtests_are_the_seeds_product_and_smoke_shows_every_value(device: str, offload: bool) -> None:
    smoke, every = hyperparam_subtests(offload, device, smoke=True), hyperparam_subtests(offload, device, smoke=False)
    after = device == "cuda" and not offload
    assert len(every) == 144 * (2 if after else 1) and len(smoke) == 6 and all(sub in every for sub in smoke)
    for axis in HYPERPARAM_AXES:
        assert {sub[axis] for sub in smoke} == {sub[axis] for sub in every}, axis
    assert ("after" in {sub["init_mode"] for sub in every}) == after


#: The seed's whole products where the checks above run a representative part (``slow_checks``: the slow
#: lane, ``--matrix pairwise|full``, on GPUs too).
SLOW_CHECKS: list[Callable[[FSDPApi, int, int], None]] = [
    check_diff_hyperparams_every_subtest,
    check_diff_hyperparams_cpu_offload_every_subtest,
    check_fsdp_compile_every_subtest,
]
session, test_check = api_session_tests(CHECKS, load_api, device=("cpu", "cuda"), timeout_s=600, slow_checks=SLOW_CHECKS)
