"""Save-at-step-k, resume, finish: the training runs the checkpoint suites compare.

``uninterrupted`` trains a freshly wrapped model ``n`` steps; ``resumed`` trains another ``k`` steps,
saves model and optimizer state with one state-dict type, builds a fresh model, wrapper and
optimizer, loads, and trains to ``n``. Both return the per-step losses and the full parameters,
which must be identical (bitwise on CPU: the resumed run repeats the same arithmetic on the same
values).
"""

from __future__ import annotations

import copy
import io
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor
from torch.distributed._shard.sharded_tensor import ShardedTensor

from harness.cases.models import ZooModel, register_model, to_device, wrap_bottom_up
from harness.engines.optim import adamw, sgd
from harness.ranks.rank import new_hybrid_groups, rank_device

from engine import (
    FSDP,
    CPUOffload,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)

#: the zoo name this suite registers its model under.
CKPT_NET = "checkpoint_net"
HYBRID = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
SD_TYPES = {
    "full": StateDictType.FULL_STATE_DICT,
    "sharded": StateDictType.SHARDED_STATE_DICT,
    "local": StateDictType.LOCAL_STATE_DICT,
}


def device_for(rank: int) -> torch.device:
    """The rank's device as its pool placed it (a GPU of its own or shared, or the CPU)."""
    return rank_device()


@register_model(CKPT_NET, "Linear, BatchNorm, a parameterless block unit of two units, Linear: uneven checkpoint shards")
class CkptNet(ZooModel):
    """Linear -> BatchNorm (buffers) -> block of two units (the block unit owns no parameter) -> Linear.

    Sizes are uneven so shards split parameters and, at 4 ranks, some rank holds nothing of a parameter.
    Built under seed 0 whatever the zoo passes: every checkpoint test compares runs of this one model.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        # Initialised on the CPU's generator, then moved: the same values whatever the device (a CUDA
        # generator under the same seed draws others).
        torch.manual_seed(0)
        self.inp = nn.Linear(7, 11)
        self.norm = nn.BatchNorm1d(11)
        self.block = nn.Sequential(nn.Linear(11, 13), nn.ReLU(), nn.Linear(13, 11))
        self.out = nn.Linear(11, 3)
        self.to(device)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(self.block(torch.relu(self.norm(self.inp(x))))))

    def wrap_units(self) -> list[nn.Module]:
        return [self.block[0], self.block[2], self.block, self.out]

    def get_input(self, *, seed: int, step: int, rank: int) -> tuple[Tensor, ...]:
        g = torch.Generator().manual_seed(seed + 1000 * step + rank)
        return (torch.randn(6, 7, generator=g),)

    def get_loss(self, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        return (output**2).mean()


def wrapped(device: torch.device | str | None = None, **kwargs: Any) -> FSDP:
    """A fresh ``CkptNet`` wrapped by our engine, unit by unit (``wrap_bottom_up``), with ``kwargs``; built
    on ``device`` (default: the rank's own, ``harness.ranks.rank.rank_device``)."""
    return wrap_bottom_up(CkptNet(device if device is not None else rank_device()), FSDP, **kwargs)


_GROUPS: dict[int, tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def hybrid_groups(world_size: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard, replicate) groups: shard over pairs of ranks, replicate across pairs (built once)."""
    if world_size not in _GROUPS:
        _GROUPS[world_size] = new_hybrid_groups(dist.get_rank(), world_size, 2 if world_size % 2 == 0 else 1)
    return _GROUPS[world_size]


@dataclass(frozen=True)
class Setup:
    strategy: ShardingStrategy
    use_orig_params: bool
    optimizer: str = "adamw"
    offload: bool = False
    mixed_precision: bool = False

    def label(self) -> str:
        parts = [self.strategy.name.lower().strip("_"), "orig" if self.use_orig_params else "flat", self.optimizer]
        parts += ["offload"] * self.offload + ["bf16"] * self.mixed_precision
        return "-".join(parts)

    def build(self, rank: int, world_size: int) -> tuple[FSDP, torch.optim.Optimizer]:
        device = device_for(rank)
        kwargs: dict[str, Any] = {"sharding_strategy": self.strategy, "use_orig_params": self.use_orig_params}
        if device.type == "cuda":
            kwargs["device_id"] = device
        if self.strategy in HYBRID:
            kwargs["process_group"] = hybrid_groups(world_size)
        if self.offload:
            kwargs["cpu_offload"] = CPUOffload(offload_params=True)
        if self.mixed_precision:
            kwargs["mixed_precision"] = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16)
        model = wrapped(device, **kwargs)
        return model, make_optimizer(self.optimizer, model.parameters())


def make_optimizer(name: str, params: Any) -> torch.optim.Optimizer:
    if name == "sgd":
        return sgd(params, lr=0.05, momentum=0.9)
    if name == "adamw":
        # torch's betas and eps with weight decay 0.01: the harness's AdamW.
        return adamw(params, lr=0.01)
    raise ValueError(f"optimizer {name!r}: use 'sgd' or 'adamw'")


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range, rank: int) -> list[float]:
    device = device_for(rank)
    # The zoo model under the wrapper (FSDP1's ``module``), or the model itself when not wrapped.
    net: CkptNet = getattr(model, "module", model)
    losses = []
    for step in steps:
        optim.zero_grad(set_to_none=True)
        inputs = to_device(net.get_input(seed=0, step=step, rank=rank), device)
        loss = net.get_loss(inputs, model(*inputs))
        loss.backward()
        optim.step()
        losses.append(loss.item())
    return losses


def full_state(model: FSDP) -> dict[str, Tensor]:
    """Every parameter and buffer, unsharded, by clean name, on CPU (every rank)."""
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def snapshot(obj: Any) -> Any:
    """A copy detached from the live model (a state dict may view its storage), as a file would be.

    Through ``torch.save``, except for ``ShardedTensor``s over a subgroup, which unpickle only onto
    the default group's ranks: those are deep-copied.
    """
    if _has_subgroup_sharded_tensor(obj):
        return copy.deepcopy(obj)
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _has_subgroup_sharded_tensor(obj: Any) -> bool:
    if isinstance(obj, ShardedTensor):
        return dist.get_world_size(obj._process_group) != dist.get_world_size()
    if isinstance(obj, dict):
        return any(_has_subgroup_sharded_tensor(v) for v in obj.values())
    return False


@dataclass
class Run:
    losses: list[float]
    state: dict[str, Tensor]
    extra: dict[str, Any] = field(default_factory=dict)


def uninterrupted(setup: Setup, rank: int, world_size: int, n: int) -> Run:
    model, optim = setup.build(rank, world_size)
    losses = train(model, optim, range(n), rank)
    return Run(losses, full_state(model))


def resumed(
    setup: Setup,
    sd_type: StateDictType,
    rank: int,
    world_size: int,
    k: int,
    n: int,
    transport: Callable[[Any], Any] = snapshot,
) -> Run:
    model, optim = setup.build(rank, world_size)
    losses = train(model, optim, range(k), rank)
    with FSDP.state_dict_type(model, sd_type):
        saved = transport({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)})
    del model, optim
    model, optim = setup.build(rank, world_size)
    with FSDP.state_dict_type(model, sd_type):
        model.load_state_dict(saved["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, saved["optim"]))
    losses += train(model, optim, range(k, n), rank)
    return Run(losses, full_state(model))


def assert_same_run(got: Run, want: Run, context: str, exact: bool) -> None:
    tol = {"rtol": 0.0, "atol": 0.0} if exact else {}
    torch.testing.assert_close(
        torch.tensor(got.losses), torch.tensor(want.losses), **tol, msg=lambda m: f"{context}: losses differ: {m}"
    )
    assert set(got.state) == set(want.state), f"{context}: keys {sorted(got.state)} vs {sorted(want.state)}"
    for key, value in want.state.items():
        torch.testing.assert_close(got.state[key], value, **tol, msg=lambda m, key=key: f"{context}: {key}: {m}")
