"""Models for the mixed-precision suites (ours, shaped after what the torch test exercises).

Every model builds identically on every rank (seeded by the caller) and is small enough for two
CPU ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from harness.cases.models import ZooModel, batch_generator, register_model

#: dtype of the probe buffers: different from every parameter dtype, so a cast is visible.
BUFFER_ORIG_DTYPE = torch.float64


@dataclass
class Expectation:
    """What a :class:`PrecisionProbe` must see inside forward (travels through forward untouched:
    it is not a tensor, so no input cast reaches it).

    Only what any engine with torch FSDP1's API shows through public names is checked: the
    input, the compute weight and the buffer the probe sees, and the parameters the wrapped root
    registers (``root.parameters()``).
    """

    #: dtype of the inputs and of the weights compute sees.
    param: torch.dtype
    #: dtype of the probe's buffer during forward.
    buffer: torch.dtype
    #: dtype of every registered (flat, sharded) parameter at rest.
    full: torch.dtype
    #: the wrapped root, whose registered parameters are inspected; None skips those checks.
    root: nn.Module | None = None
    #: numel of each of ``root.parameters()`` at rest (sharded), taken before forward.
    rest_numels: tuple[int, ...] = ()
    #: the engine points a unit's registered flat parameter at the unsharded compute tensor while
    #: the unit is unsharded (torch FSDP1, ``use_orig_params=False``); False: the registered
    #: parameter stays the full-precision shard and compute uses separate storage (our engine).
    swaps_registered: bool = False
    #: with ``swaps_registered``: at least one registered parameter is swapped while a probe runs
    #: (the torch test's "active unit" check; sharded strategies, world > 1).
    expect_active_unit: bool = True


class PrecisionProbe(nn.Module):
    """A linear layer that checks, in forward, the dtypes mixed precision promises.

    Forward takes and returns ``(x, expectation)`` so probes chain in an ``nn.Sequential``.
    """

    width = 10

    def __init__(self, full_dtype: torch.dtype, buffer_name: str = "buffer", run_checks: bool = True) -> None:
        super().__init__()
        self.lin = nn.Linear(self.width, self.width, bias=False).to(full_dtype)
        # Distinct buffer names per probe: a prefix bug in buffer handling would hide behind one name.
        self.buffer_name = buffer_name
        self.register_buffer(buffer_name, torch.randn((1, 2), dtype=BUFFER_ORIG_DTYPE))
        self.run_checks = run_checks

    def forward(self, packet: tuple[Tensor, Expectation]) -> tuple[Tensor, Expectation]:
        x, expect = packet
        if self.run_checks:
            check_probe(self, x, expect)
        return self.lin(x), expect


def check_probe(probe: PrecisionProbe, x: Tensor, expect: Expectation) -> None:
    problems = []
    if x.dtype != expect.param:
        problems.append(f"input {x.dtype} != {expect.param}")
    weight = probe.lin.weight
    if weight.dtype != expect.param:
        problems.append(f"compute weight {weight.dtype} != {expect.param}")
    # The weight compute sees is the unsharded one (every engine): the unit is active.
    if tuple(weight.shape) != (probe.width, probe.width):
        problems.append(f"compute weight has shape {tuple(weight.shape)}, not the unsharded {(probe.width, probe.width)}")
    buf = getattr(probe, probe.buffer_name)
    if buf.dtype != expect.buffer:
        problems.append(f"buffer {probe.buffer_name} {buf.dtype} != {expect.buffer}")
    if expect.root is not None:
        registered = list(expect.root.parameters())
        if len(registered) != len(expect.rest_numels):
            problems.append(f"{len(registered)} registered parameters in forward, {len(expect.rest_numels)} at rest")
        swapped = 0
        for i, (p, rest) in enumerate(zip(registered, expect.rest_numels)):
            if p.dtype == expect.full and p.numel() == rest:
                continue  # the full-precision shard
            if expect.swaps_registered and p.dtype == expect.param and p.numel() >= rest:
                swapped += 1  # torch FSDP1: the flat parameter points at the unsharded compute tensor
                continue
            problems.append(f"registered parameter {i} is {p.dtype} with {p.numel()} elements (at rest: {expect.full}, {rest})")
        if expect.swaps_registered and expect.expect_active_unit and swapped == 0:
            problems.append("no unit's flat parameter is unsharded during forward")
    if problems:
        raise AssertionError(f"{probe.buffer_name}: " + "; ".join(problems))


class SaveForwardInputsModule(nn.Module):
    """Records its input; with ``cast_forward_inputs`` it casts the input to its weight's dtype itself."""

    def __init__(self, forward_inputs: dict[Any, Tensor], cast_forward_inputs: bool, width: int = 16) -> None:
        super().__init__()
        self.l = nn.Linear(width, width)
        self.forward_inputs = forward_inputs
        self.cast_forward_inputs = cast_forward_inputs

    def forward(self, x: Tensor) -> Tensor:
        self.forward_inputs[self] = x
        return self.l(x.to(self.l.weight.dtype) if self.cast_forward_inputs else x)


class SaveForwardInputsModel(nn.Module):
    """``c2(c1(x))``, recording the input of the model and of each child."""

    def __init__(self, forward_inputs: dict[Any, Tensor], cast_forward_inputs: bool, width: int = 16) -> None:
        super().__init__()
        self.c1 = SaveForwardInputsModule(forward_inputs, cast_forward_inputs, width)
        self.c2 = SaveForwardInputsModule(forward_inputs, cast_forward_inputs, width)
        self.forward_inputs = forward_inputs

    def forward(self, x: Tensor) -> Tensor:
        self.forward_inputs[self] = x
        return self.c2(self.c1(x))


class BatchNormNet(nn.Module):
    """Linear -> BatchNorm1d -> Linear -> LayerNorm -> Linear -> softmax (the torch test's batch-norm net)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 40, bias=False)
        self.bn = nn.BatchNorm1d(4)
        self.fc2 = nn.Linear(40, 4, bias=False)
        self.ln = nn.LayerNorm(4)
        self.fc3 = nn.Linear(4, 4, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.reshape(self.fc1(x), (-1, 4, 10))
        x = torch.reshape(self.bn(x), (-1, 40))
        return F.softmax(self.fc3(self.ln(self.fc2(x))), dim=1)


class IgnoredLinear(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.l = nn.Linear(width, width)
        self.register_buffer("scale", torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        return self.l(x) * self.scale


class ModelWithIgnoredModule(nn.Module):
    """``l2(ignored(l1(x)))``; ``cast_for_ignored`` makes the model cast around the ignored module."""

    def __init__(self, width: int = 32, cast_for_ignored: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(width, width)
        self.ignored = IgnoredLinear(width)
        self.l2 = nn.Linear(width, width)
        self.register_buffer("offset", torch.zeros(width))
        self.cast_for_ignored = cast_for_ignored

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x) + self.offset.to(x.dtype)
        if self.cast_for_ignored:
            return self.l2(self.ignored(h.to(self.ignored.l.weight.dtype)).to(h.dtype))
        return self.l2(self.ignored(h))


class TransformerWithEMA(nn.Module):
    """A transformer trained in train mode and an exponential moving average of it used in eval."""

    def __init__(self, d_model: int = 16) -> None:
        super().__init__()

        def make() -> nn.Transformer:
            return nn.Transformer(
                d_model=d_model, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=16, dropout=0.0
            )

        self.module = make()
        self.ema_module = AveragedModel(make(), multi_avg_fn=get_ema_multi_avg_fn(), use_buffers=True)

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.module(*args, **kwargs) if self.training else self.ema_module(*args, **kwargs)


class ParityNet(ZooModel):
    """Linear -> LayerNorm -> (Linear -> ReLU -> Linear) -> gain buffer -> Linear.

    The float buffer ``gain`` scales activations (cast to the activation dtype by the model, as
    real code does), so ``buffer_dtype`` changes the numbers, not only the dtype: dropping any one
    cast moves the result (which the harness's zoo models, whose buffers are exact in every dtype or
    crash without the cast, cannot show). Wrapped as four units: ``block[0]``, ``block[2]``,
    ``block`` and the root. Every parameter's numel is a multiple of 8, so every original parameter
    starts 16-byte aligned inside the flat parameter, as it does standalone in the reference (GPU
    GEMM libraries pick kernels by alignment). Registered in the harness's zoo as ``PARITY_NET``.
    """

    def __init__(self, width: int = 24) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.norm = nn.LayerNorm(width)
        self.block = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        self.out = nn.Linear(width, 8)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, width))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.norm(self.inp(x)))
        h = self.block(h) * self.gain.to(h.dtype)
        return self.out(h)

    def wrap_units(self) -> list[nn.Module]:
        return [self.block, self.block[0], self.block[2]]

    def get_input(self, *, seed: int, step: int, rank: int) -> tuple[Tensor, ...]:
        return (torch.randn(6, 8, generator=batch_generator(seed, step, rank)),)

    def get_loss(self, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        """Mean squared output, in at least float32 (the same user code on both sides)."""
        return output.to(torch.promote_types(output.dtype, torch.float32)).pow(2).mean()


#: ``ParityNet``'s name in the harness's zoo.
PARITY_NET = "mp_parity_net"
register_model(PARITY_NET, "linears, LayerNorm and a float gain buffer the model casts itself", ParityNet)
