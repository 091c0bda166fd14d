"""The use_orig_params ported test's training against DDP (test_fsdp_use_orig_params.py's
TestFSDPUseOrigParamsMultipleParamGroups), checks of ``fsdp_use_orig_params``'s session kept apart: the
transformer and its parameter groups, the ported test's training loop (10 iterations, ``zero_grad`` before
forward or between forward and backward, losses and then full parameters against DDP), and its
subtests: different hyperparameters per group (with and without CPU offload), different trainability,
multiple optimizers, ``torch.compile``. ``_train_parity`` stays (SGD and Adam family with and without
``foreach``, per-group hyperparameters, ``set_to_none=False``, frozen parameters): the optimizer axis
(``adamw_groups``, ``two_optimizers``) does not express those.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing import assert_close

from harness.cases.model_protocol import to_device
from harness.conformance.engine_models import SharedTransformer
from harness.conformance.fsdp1_checks import FSDPApi, assert_match, clean as _clean
from harness.engines.fsdp1_api import no_shard_offload_race
from harness.ranks.rank import rank_device


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
    """The ported test's optimizers over the parameter groups: AdamW for test_diff_hyperparams, Adam for its
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


#: the ported test's training iterations per parity subtest (its ``_check_train_parity`` and test_fsdp_compile).
TORCH_TEST_ITERS = 10


def _train_parity(api: FSDPApi, ddp: DDP, ddp_opt, fsdp: nn.Module, fsdp_opt, set_to_none: bool,
                  iters: int = TORCH_TEST_ITERS) -> None:
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


#: The axes of the ported test_diff_hyperparams subtests, each with its values (the sharding strategy by its
#: member name; the init mode: ``harness.conformance.seeds.seed_parity.init_modes``).
HYPERPARAM_AXES = ("strategy", "init_mode", "optim_before_wrap", "foreach", "set_to_none", "prefetch", "skip_writeback_check")


def hyperparam_subtests(offload: bool, device: str, smoke: bool) -> list[dict[str, Any]]:
    """The ported test_diff_hyperparams subtests: every strategy x init mode (before and after wrapping on
    CUDA ranks; before with offload, as the ported test's offload twin) x optimizer built before or after wrapping x
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
        # torch FSDP1's NO_SHARD offload race (``harness.engines.fsdp1_api.no_shard_offload_race``) is stress's to show.
        if no_shard_offload_race(api.name, device.type, sub["strategy"].lower(), offload, True):
            continue
        if sub["skip_writeback_check"]:
            os.environ["FSDP_SKIP_WRITEBACK_CHECK"] = "1"
        try:
            ddp = DDP(SharedTransformer(device))
            ddp_opt = _adam_family(_param_groups(ddp), sub["foreach"], adamw=not offload)
            prefetch = sub["prefetch"] and getattr(api.BackwardPrefetch, sub["prefetch"])
            kwargs = dict(sharding_strategy=strategy, backward_prefetch=prefetch, cpu_offload=api.CPUOffload(offload))
            # The ported test's CUDA_AFTER: built on the CPU, wrapped there, moved to the GPU after.
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
    """The ported test's: Adam over the three parameter groups, BACKWARD_PRE, the biases (one group) frozen, every
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
    """The ported test's two optimizers: Adam (5e-3) over the weights, AdamW (1e-2) over the rest, the first
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
    ported test's check would compare eager with eager. ``skip_fsdp_guards``: Dynamo's ``skip_fsdp_guards`` for
    the run (None keeps the default)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from harness.compare.compiling import backend_for, check_compiled, compiled_counts

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
    """The ported test_fsdp_compile in the CI tier: FULL_SHARD, 3 iterations (the ported test's product:
    ``check_fsdp_compile_every_subtest``; the parity matrix's ``compile`` axis has the rest)."""
    _compiled_parity(api, api.ShardingStrategy.FULL_SHARD, iters=3)


def check_fsdp_compile_every_subtest(api: FSDPApi, rank: int, world_size: int) -> None:
    """The ported test_fsdp_compile: every strategy x Dynamo's ``skip_fsdp_guards``, 10 iterations each."""
    for strategy, skip_guards in itertools.product(_strategies(api), (True, False)):
        _compiled_parity(api, strategy, iters=TORCH_TEST_ITERS, skip_fsdp_guards=skip_guards)
