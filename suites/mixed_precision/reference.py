"""Parity that does not look away: an unsharded reference that applies mixed precision's casts.

PyTorch's own parity test skips the parameter comparison under mixed precision, because an
fp32 reference and a low-precision run legitimately differ. Here the reference *emulates* the
casts instead, so parameters are compared, and the tolerance of each case is derived from the
run itself rather than guessed:

1. :class:`EmulatingReference`: one unsharded master model in the full-precision dtype that
   trains as ``world_size`` data-parallel ranks under mixed precision would. Per step and rank it
   casts the parameters to the compute dtype, the buffers (each rank keeps its own, as sharded
   engines do) to the buffer dtype and the floating-point inputs to the compute dtype, runs
   forward and backward, casts each rank's gradient to the reduce dtype, averages as the
   collectives do (divide by the pre-factor, sum in rank order, divide by the post-factor),
   casts the average back to the full dtype and steps a full-precision optimizer.
2. The same run in float64 (:func:`float64_plan`): the numbers mixed precision approximates.
3. :func:`derive_tolerance`: ``max(factor * d, floor)`` where ``d`` is the largest distance
   between the emulating and the float64 final parameters. ``factor`` is below one on purpose:
   an engine that drops the casts lands near the float64 run, at distance about ``d`` from the
   emulation, so a tolerance of ``d`` or more would accept it. The floor (a few ulps of the full
   dtype at the parameters' magnitude) covers runs where ``d`` is zero or tiny (fp64, fp32).
   One distance can be dominated by one cast (a bfloat16 buffer, say) and hide another: passing
   the :func:`single_cast_ablations` runs as ``neighbours`` takes ``d`` as the distance to the
   nearest of them and fp64, so dropping any single cast that changes the numbers fails too.

Engine-independent: nothing here imports the engine or ``torch.distributed``; the API takes a
model, an input function, a loss function and an optimizer factory, so any runner can use it.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Mapping, Sequence

import torch
import torch.nn as nn
from torch import Tensor
from torch.func import functional_call
from torch.utils._pytree import tree_map_only

__all__ = [
    "CastPlan",
    "DerivedTolerance",
    "EmulatingReference",
    "ParityComparison",
    "compare_to_reference",
    "derive_tolerance",
    "float64_plan",
    "predivide_factor",
    "run_reference",
    "single_cast_ablations",
]

InputFn = Callable[[int, int], Sequence[Tensor]]
LossFn = Callable[[Tensor], Tensor]
OptimizerFn = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def _dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype name (e.g. 'float16', 'bfloat16')")
    return dtype


@dataclass(frozen=True)
class CastPlan:
    """The casts a mixed-precision run applies (``MixedPrecision``'s fields plus the master dtype)."""

    #: dtype of the master parameters, the gradients the optimizer sees, and the optimizer state.
    full: torch.dtype
    #: dtype parameters and floating-point inputs are cast to for compute; None: ``full``.
    param: torch.dtype | None = None
    #: dtype gradients are reduced in; None: ``param`` if set, else ``full`` (FSDP1's rule).
    reduce: torch.dtype | None = None
    #: dtype floating-point buffers are cast to; None: their own dtype.
    buffer: torch.dtype | None = None

    @classmethod
    def from_spec(cls, spec: object) -> "CastPlan":
        """From anything with dtype-name attributes ``full``, ``param``, ``reduce``, ``buffer``
        (e.g. ``harness.case.PrecisionSpec``)."""
        return cls(
            full=_dtype(getattr(spec, "full")),  # type: ignore[arg-type]
            param=_dtype(getattr(spec, "param")),
            reduce=_dtype(getattr(spec, "reduce")),
            buffer=_dtype(getattr(spec, "buffer")),
        )

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.param or self.full

    @property
    def reduce_dtype(self) -> torch.dtype:
        return self.reduce or self.param or self.full

    def describe(self) -> str:
        name = lambda d: str(d).removeprefix("torch.") if d is not None else "-"  # noqa: E731
        return f"full={name(self.full)} param={name(self.param)} reduce={name(self.reduce)} buffer={name(self.buffer)}"


def float64_plan() -> CastPlan:
    """Everything in float64, buffers included: the run mixed precision approximates."""
    return CastPlan(full=torch.float64, buffer=torch.float64)


def predivide_factor(world_size: int) -> int:
    """FSDP1's split of the gradient average: divide by this before the sum and by
    ``world_size / factor`` after it (keeps low-precision sums from overflowing)."""
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return factor


def _cast_floating(tree: object, dtype: torch.dtype) -> object:
    return tree_map_only(Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


class EmulatingReference:
    """An unsharded model trained as ``world_size`` data-parallel ranks under ``plan`` would be.

    The master parameters (``self.model``, in ``plan.full``) and the optimizer are full
    precision; each rank's forward and backward run on cast copies. Rank ``r``'s buffers persist
    across steps in ``self.rank_buffers[r]`` (sharded engines never synchronize buffers).
    """

    def __init__(self, model: nn.Module, plan: CastPlan, world_size: int, make_optimizer: OptimizerFn) -> None:
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be at least 1")
        self.plan = plan
        self.world_size = world_size
        #: the master model: a copy of ``model`` with floating-point parameters in ``plan.full``.
        self.model = copy.deepcopy(model)
        with torch.no_grad():
            for p in self.model.parameters():
                p.data = p.data.to(plan.full)
        self.optimizer = make_optimizer(self.model.parameters())
        buffers = dict(self.model.named_buffers())
        self.rank_buffers: list[dict[str, Tensor]] = [
            {n: b.detach().to(plan.buffer) if (plan.buffer is not None and b.is_floating_point()) else b.detach().clone()
             for n, b in buffers.items()}
            for _ in range(world_size)
        ]

    def step(self, rank_inputs: Sequence[Sequence[Tensor]], loss_fn: LossFn) -> list[float]:
        """One optimizer step on every rank's batch; returns each rank's loss."""
        if len(rank_inputs) != self.world_size:
            raise ValueError(f"step() needs one batch per rank ({self.world_size}), got {len(rank_inputs)}")
        plan = self.plan
        names = [n for n, p in self.model.named_parameters() if p.requires_grad]
        masters = dict(self.model.named_parameters())
        pre = predivide_factor(self.world_size)
        post = self.world_size / pre
        summed: dict[str, Tensor] = {}
        losses = []
        for rank, inputs in enumerate(rank_inputs):
            compute = {n: masters[n].detach().to(plan.compute_dtype).requires_grad_() for n in names}
            frozen = {n: p.detach().to(plan.compute_dtype) for n, p in masters.items() if n not in compute}
            args = _cast_floating(tuple(inputs), plan.compute_dtype)
            out = functional_call(self.model, {**compute, **frozen, **self.rank_buffers[rank]}, args)  # type: ignore[arg-type]
            loss = loss_fn(out)
            losses.append(loss.item())
            grads = torch.autograd.grad(loss, [compute[n] for n in names], allow_unused=True)
            for n, g in zip(names, grads):
                g = torch.zeros_like(compute[n]) if g is None else g
                g = g.to(plan.reduce_dtype)
                if pre > 1:
                    g = g / pre
                # Sum in rank order, in the reduce dtype, as a two-rank collective does.
                summed[n] = g if n not in summed else summed[n] + g
        with torch.no_grad():
            for n in names:
                g = summed[n] / post if post > 1 else summed[n]
                masters[n].grad = g.to(plan.full)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return losses

    def parameters(self) -> dict[str, Tensor]:
        """The master parameters by name (detached clones)."""
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}


def run_reference(
    model: nn.Module,
    plan: CastPlan,
    world_size: int,
    steps: int,
    inputs: InputFn,
    loss_fn: LossFn,
    make_optimizer: OptimizerFn,
) -> dict[str, Tensor]:
    """Train an :class:`EmulatingReference` for ``steps`` steps on ``inputs(step, rank)``;
    return its final parameters."""
    ref = EmulatingReference(model, plan, world_size, make_optimizer)
    for step in range(steps):
        ref.step([inputs(step, r) for r in range(world_size)], loss_fn)
    return ref.parameters()


def _max_distance(a: Mapping[str, Tensor], b: Mapping[str, Tensor]) -> tuple[float, str]:
    if sorted(a) != sorted(b):
        raise ValueError(f"parameter names differ: {sorted(a)} vs {sorted(b)}")
    worst, where = 0.0, ""
    for name in a:
        d = (a[name].detach().double().cpu() - b[name].detach().double().cpu()).abs().max().item()
        if d > worst or not where:
            worst, where = d, name
    return worst, where


def single_cast_ablations(plan: CastPlan) -> dict[str, CastPlan]:
    """``plan`` with one of its casts removed, for each cast it sets (``no_param``, ``no_reduce``,
    ``no_buffer``): what an engine that ignores exactly that field would compute."""
    return {
        f"no_{field}": dataclasses.replace(plan, **{field: None})
        for field in ("param", "reduce", "buffer")
        if getattr(plan, field) is not None
    }


@dataclass(frozen=True)
class DerivedTolerance:
    """A case's tolerance and what it was derived from."""

    #: the largest |emulating - float64| over the final parameters.
    distance_to_fp64: float
    #: the largest |emulating - r| for each reference ``r`` considered: ``fp64`` and the neighbours.
    distances: tuple[tuple[str, float], ...]
    #: the reference whose distance sets the tolerance: the nearest one that the floor can resolve.
    nearest: str
    #: the multiple of that distance allowed (below one: see the module docstring).
    factor: float
    #: the smallest tolerance: ``floor_ulps`` ulps of the full dtype at the parameters' scale.
    floor: float
    #: ``max(factor * distance to nearest, floor)``: the absolute tolerance on every parameter.
    atol: float

    @property
    def resolvable(self) -> tuple[str, ...]:
        """References far enough from the emulation that an engine computing them fails."""
        return tuple(name for name, d in self.distances if self.factor * d > self.floor)


def derive_tolerance(
    emulated: Mapping[str, Tensor],
    fp64: Mapping[str, Tensor],
    full: torch.dtype,
    factor: float = 0.5,
    floor_ulps: float = 32.0,
    neighbours: Mapping[str, Mapping[str, Tensor]] | None = None,
) -> DerivedTolerance:
    """The absolute tolerance for comparing an engine's final parameters with ``emulated``.

    Without ``neighbours`` it is ``max(factor * |emulated - fp64|, floor)``. ``neighbours`` (e.g.
    the :func:`single_cast_ablations` runs) tighten it to ``factor`` times the distance to the
    nearest of fp64 and the neighbours, ignoring those within the floor (a cast with no numerical
    effect on this model cannot be told apart, and is reported as such by ``resolvable``). Then
    an engine that drops any one resolvable cast fails, not only one that drops them all.
    """
    if not 0 < factor < 1:
        raise ValueError(
            f"factor={factor} must be in (0, 1): at 1 or more an engine that ignores mixed precision "
            "(and lands on the float64 run) would pass"
        )
    distances = {"fp64": _max_distance(emulated, fp64)[0]}
    for name, params in (neighbours or {}).items():
        distances[name] = _max_distance(emulated, params)[0]
    scale = max([1.0] + [t.detach().abs().max().item() for t in emulated.values() if t.numel()])
    floor = floor_ulps * torch.finfo(full).eps * scale
    resolvable = {name: d for name, d in distances.items() if factor * d > floor}
    nearest = min(resolvable, key=resolvable.__getitem__) if resolvable else "fp64"
    return DerivedTolerance(
        distances["fp64"], tuple(distances.items()), nearest, factor, floor, max(factor * distances[nearest], floor)
    )


@dataclass(frozen=True)
class ParityComparison:
    """An engine's final parameters against the emulating reference, under a derived tolerance."""

    #: the largest |engine - emulating| over the final parameters.
    error: float
    #: the parameter where it occurs.
    worst: str
    tolerance: DerivedTolerance

    @property
    def passed(self) -> bool:
        return self.error <= self.tolerance.atol

    def to_dict(self) -> dict[str, object]:
        tol = asdict(self.tolerance)
        tol["distances"] = dict(self.tolerance.distances)
        return {"error": self.error, "worst": self.worst, "passed": self.passed, "resolvable": list(self.tolerance.resolvable), **tol}


def compare_to_reference(
    actual: Mapping[str, Tensor], emulated: Mapping[str, Tensor], tolerance: DerivedTolerance
) -> ParityComparison:
    error, worst = _max_distance(actual, emulated)
    return ParityComparison(error, worst, tolerance)
