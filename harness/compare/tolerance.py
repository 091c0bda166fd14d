"""Tolerance policy: how far an engine may be from its reference, per quantity, and why.

Each quantity is a ``QuantityError`` (max absolute and relative error, the tolerance used, and
``ratio``, the worst element's error over what ``torch.testing.assert_close`` allows). Tolerances
(``budget_source`` decides which; ``TolerancePolicy`` applies them):

- Full precision up to ``ORDER_FREE_WORLD_SIZE`` (2) ranks: torch's defaults for the dtype, nothing
  else. Averaging two ranks' gradients rounds the same whatever the reduction: one addition commutes
  and dividing by 2 is exact, so an fp32 engine matches DDP and the local reference bitwise (every
  fp32 case at 2 gloo ranks measured ratio 0.0).
- Full precision past 2 ranks: torch's defaults, widened per quantity by a budget of
  ``BUDGET_FACTOR`` times the distance between the reference itself and the same run in float64
  (``harness.compare.compare.derive_budgets``, worst over the ranks). With three or more terms the order of a
  sum changes its rounding: DDP divides and then sums in its all-reduce buckets, FSDP1 reduce-scatters
  between a pre- and a post-division, the local reference sums rank after rank, and each bound is
  ``depth * u * sum|g_i|`` (depth ``n - 1`` for a ring or a sequential sum, ``ceil(log2 n)`` for a
  tree). Training then amplifies that rounding from step to step by a factor that belongs to the
  model and the data, not to the world size. Measured on gloo over 5 steps: under torch's defaults
  the transformer's worst ratio over seeds 0-11 is 1.89 at 4 ranks and 1.05 at 8 (seed 0 at 8, ratio
  1.001, is what failed FSDP1 and the built-in engine against DDP), and 0.36 to 0.94 at 3, 6 and 16
  ranks (seed 0); gpt, nested and moe stay below 0.2 at 3 to 8 ranks. A factor of the world size
  alone cannot tell those apart: ``ceil(log2 ws)`` still left 0.95 at 4 ranks, and it already missed
  a gradient planted 1e-5 off (relative) on gpt at 8. The float64 distance measures the
  amplification of the case at hand. Both fp32 runs round the same float64 computation in different
  orders, so by the triangle inequality an engine as accurate as the reference is within about twice
  the reference's drift, and ``BUDGET_FACTOR`` (the same 4 as mixed precision) leaves room for the
  engine to drift more by chance. Measured: worst ratio 0.68 over those transformer runs. Where the
  model does not amplify rounding the budgets stay at or near torch's atol (gpt keeps exactly its
  tolerances), and a gradient planted 1e-5 off still fails every zoo model at 4 and 8 ranks (worst
  ratio 2.4 on gpt to 29). A float64 case keeps the defaults at every world size: float64 is its own
  truth.
- Mixed precision up to ``ORDER_FREE_WORLD_SIZE`` ranks (``ablation``): the engine is compared with
  the local reference that emulates its casts (DDP computes in full precision, so a mixed-precision
  case is compared with the emulation whatever its ``reference``), under torch's defaults for the
  full dtype, widened per quantity by ``MIXED_PRECISION_FACTOR`` (0.5) times the distance from the
  emulation to the nearest run an engine that drops casts would compute: the float64 run (every
  cast dropped) and each ``harness.engines.references.cast_ablations`` run (one ``MixedPrecision`` field
  ignored), see ``ablation_budget``. The factor is below 1 on purpose: an engine that drops a cast
  lands on that run, at the full distance from the emulation, so any factor of 1 or more would pass
  it and the values could not tell an engine that ignores ``param_dtype``, ``reduce_dtype`` or
  ``buffer_dtype`` from an honest one (the knob checks would be the only guard). An honest engine
  rounds exactly as the emulation here (the same casts, a two-term sum): every mixed-precision case
  of the pairwise tier on 2 gloo ranks measured ratio 0.0, and on 2 NCCL GPUs the built-in engine's
  float16 cases matched the emulation bitwise. A run whose half distance is within torch's
  tolerance at the quantity's magnitude cannot be told apart by values and is not *resolvable* for
  that quantity (a cast with no numerical effect on the model); ``detail["resolvable"]`` of a record
  says which quantities each run resolves.
- Mixed precision past ``ORDER_FREE_WORLD_SIZE`` ranks (``emulation``): the order in which a
  low-precision sum is taken (ring, tree, wider accumulators inside the backend) changes its rounding
  by as much as the reduce cast itself, and training amplifies it: the honest engines ended 1.98 off
  the emulation on a gradient of the bf16 transformer at 8 ranks, where summing the emulation's ranks
  in reverse order moved it less than a fifth of that; at 4 ranks (hybrid, bf16) the loss landed one
  bfloat16 rounding (0.0078) away. Values cannot resolve a dropped cast there (the precision knob
  check does), so the budget is ``BUDGET_FACTOR`` times the emulation's distance to float64, with the
  rtol of the lowest-precision dtype the case computes or reduces in: a scalar such as a loss can
  land on a lucky rounding in the emulation, so one rounding of the low-precision dtype is allowed.
  The distance is the worst over the orders the emulation sums the ranks in (``emulation_orders``:
  rank order and its reverse past ``ORDER_FREE_WORLD_SIZE`` ranks), for the reason the budget is the
  worst over the ranks: one order can land next to float64 by chance, and the engine's order is the
  backend's, not the emulation's. Measured (seed 0 of the bf16 transformer at 4 gloo ranks, two
  optimizers, clipping, two micro-batches under ``no_sync``): the emulation in rank order ended
  0.47 from float64 on ``clip_norm@3``, where the same emulation in reverse order ended 3.36, in
  three other orders 0.25 to 3.03, and with a float32 accumulator 3.26; our engine and torch FSDP1
  (bitwise equal) ended 3.2 away, and bitwise on the emulation that adds each chunk's ranks in gloo's
  ring order (``k+2, k+3, k+1, k`` for chunk ``k``), so only the order set them apart. Budgeted on
  the rank order alone that case failed 3 of seeds 0-11 (ratios 1.91, 2.79, 1.44); over both orders
  1 (seed 2, ratio 1.21 on one gradient, where the engine, again bitwise the gloo-order emulation,
  ended 7.2e-4 from float64 and 11 other orders 1.2e-4 to 4.2e-4): two orders sample the spread,
  they do not bound it, and each further order costs one more run of the emulation.

- Cases that sum in an order of their own at any world size (``reorders``): compiled kernels
  (``CaseConfig.compile``: decompositions, fused reductions) and accumulated micro-batches
  (``CaseConfig.grad_accum``: a step's gradient is a sum over micro-batches and ranks, more than two
  terms). They are budgeted as cases past ``ORDER_FREE_WORLD_SIZE`` ranks (``reference``, or
  ``emulation`` under mixed precision). Measured on 2 gloo ranks: with ``aot_eager`` the tied transformer
  under AdamW ended up to 5.4e-5 off the eager reference on attention biases; with two micro-batches and
  Adam, 0.019 off DDP on the attention biases whose key part has no gradient in exact arithmetic (Adam
  normalizes the rounding noise to a full step), for torch FSDP1 and our engine alike.

- Null-gradient elements under Adam on CUDA ranks: elements a model declares to have a zero gradient
  in exact arithmetic (``ZooModel.null_gradient_ranges``: attention key biases) train on rounding
  noise, and Adam scales any noise to a step of about its learning rate. Where both sides round alike
  (CPU ranks) the noise is identical and the comparison stays exact; on CUDA ranks the sides' kernels
  differ (an offloaded optimizer step on the CPU, a recomputed forward), and those elements are held to
  twice the distance Adam can move a parameter in the case's steps (``adam_drift_bound``), the rest of
  the parameter exactly. Measured on one H100: the transformer with CPU offload and reentrant
  activation checkpointing under AdamW ended 0.044 off on key biases only, for our engine.

A budget is the worst over the ranks (``harness.compare.compare.worst_budgets``): every rank's loss measures
the same drift of the shared parameters from float64, and on one rank the measured run can land next
to float64 by chance (bf16 transformer at 8 ranks: rank 1's emulated loss at step 4 within 0.17 of
float64 while the drift shows as 2.6 on rank 3, so even torch FSDP1 failed that rank's budget). A
budget only widens ``atol``; it never narrows torch's defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from harness.cases.case import PrecisionSpec
from harness.cases.dtypes import dtype_of
from harness.engines.references import RankOrder

__all__ = [
    "BUDGET_FACTOR",
    "BudgetSource",
    "DEFAULT_TOLERANCES",
    "DerivedBudget",
    "MIXED_PRECISION_FACTOR",
    "ORDER_FREE_WORLD_SIZE",
    "TolerancePolicy",
    "ablation_budget",
    "adam_drift_bound",
    "budget_source",
    "emulation_orders",
    "mixed_precision_budgets",
]


#: ``torch.testing.assert_close``'s default ``(rtol, atol)`` per dtype.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1.3e-6, 1e-5),
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
}


#: Past ``ORDER_FREE_WORLD_SIZE`` ranks: how far from the float64 run an engine may be, in multiples of
#: how far the measured run is (the reference itself in full precision, the emulating reference under
#: mixed precision). The engine rounds at the same places as that run, in another order.
BUDGET_FACTOR = 4.0


#: Under mixed precision, the multiple of the distance from the emulation to the nearest cast-dropping
#: run that an engine may be off. Below 1, so that dropping a cast fails on values alone.
MIXED_PRECISION_FACTOR = 0.5


#: Up to this many ranks a gradient average rounds the same in any reduction order (one addition
#: commutes, dividing by 1 or 2 is exact): full precision keeps torch's defaults there.
ORDER_FREE_WORLD_SIZE = 2


#: Which runs set the budgets: none (torch's defaults); the emulation's distance to the runs that drop
#: casts (mixed precision up to ``ORDER_FREE_WORLD_SIZE`` ranks); the emulation's distance to float64
#: (mixed precision past it); the reference's own distance to float64 (full precision past it).
BudgetSource = Literal["none", "ablation", "emulation", "reference"]


@dataclass(frozen=True)
class TolerancePolicy:
    """The tolerance of each quantity: a dtype default, widened by a derived budget where one exists."""

    rtol: float
    atol: float
    #: per quantity name: an absolute budget (mixed precision), used where larger than ``atol``.
    budgets: dict[str, float] = field(default_factory=dict)
    #: per parameter name: elements ``[start, stop)`` held to an absolute bound of their own instead
    #: (null-gradient elements under Adam, see the module docstring), compared as ``param:NAME[start:stop]``.
    null_gradients: dict[str, tuple[int, int, float]] = field(default_factory=dict)

    def with_null_gradients(self, ranges: Mapping[str, tuple[int, int]], bound: float) -> "TolerancePolicy":
        """This policy with ``ranges`` (``ZooModel.null_gradient_ranges``) held to ``bound``."""
        held = {name: (start, stop, bound) for name, (start, stop) in ranges.items()}
        return TolerancePolicy(self.rtol, self.atol, dict(self.budgets), {**self.null_gradients, **held})

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> "TolerancePolicy":
        """torch's defaults for ``dtype`` and no budget: the policy of a full-precision case at up to
        ``ORDER_FREE_WORLD_SIZE`` ranks, for checks that compare tensors of that dtype directly."""
        if dtype not in DEFAULT_TOLERANCES:
            raise ValueError(f"TolerancePolicy.for_dtype: dtype={dtype} has no default tolerance; pass one of {sorted(map(str, DEFAULT_TOLERANCES))}")
        return cls(*DEFAULT_TOLERANCES[dtype])

    @classmethod
    def for_precision(
        cls, spec: PrecisionSpec, budgets: dict[str, float] | None = None, source: BudgetSource = "none"
    ) -> "TolerancePolicy":
        """torch's defaults for the full dtype, widened by the derived ``budgets``. Under ``emulation``
        (mixed precision past ``ORDER_FREE_WORLD_SIZE`` ranks) the rtol of the lowest-precision dtype
        the case computes or reduces in; under ``ablation`` the full dtype's, as a low-precision rtol
        (1.6e-2 for bfloat16) would pass a dropped cast, whose effect on a parameter is a small
        fraction of its value."""
        rtol, atol = DEFAULT_TOLERANCES.get(dtype_of(spec.full), DEFAULT_TOLERANCES[torch.float32])
        if source == "emulation":
            for name in (spec.param, spec.reduce):
                if name is not None:
                    rtol = max(rtol, DEFAULT_TOLERANCES.get(dtype_of(name), (rtol, atol))[0])
        return cls(rtol, atol, dict(budgets or {}))

    def tolerance(self, quantity: str) -> tuple[float, float]:
        """``(atol, rtol)`` for a quantity."""
        return max(self.atol, self.budgets.get(quantity, 0.0)), self.rtol


def adam_drift_bound(lr: float, steps: int, betas: tuple[float, float], weight_decay: float = 0.0, magnitude: float = 0.0) -> float:
    """How far two Adam trajectories of one element can end apart after ``steps`` steps at ``lr``,
    whatever gradients they saw: twice the sum of each step's largest move.

    A step moves ``lr * m_hat / (sqrt(v_hat) + eps)``; by Cauchy-Schwarz over the gradients' history,
    ``|m_t| <= (1 - b1) / sqrt(1 - b2) * sqrt(sum_k (b1**2 / b2)**k) * sqrt(v_t)``, and bias correction
    multiplies that by ``sqrt(1 - b2**t) / (1 - b1**t)`` (1 at the first step, 1.007 at the fourth for
    torch's betas). Decoupled weight decay adds ``lr * weight_decay * magnitude`` per step.
    """
    b1, b2 = betas
    total = 0.0
    for t in range(1, steps + 1):
        history = sum((b1 * b1 / b2) ** k for k in range(t))
        ratio = (1 - b1) / (1 - b2) ** 0.5 * history**0.5 * (1 - b2**t) ** 0.5 / (1 - b1**t)
        total += lr * (ratio + weight_decay * magnitude)
    return 2.0 * total


def budget_source(spec: PrecisionSpec, world_size: int, reorders: bool = False) -> BudgetSource:
    """Where a case's budgets come from (the module docstring says why); ``reorders``: the case sums in
    an order of its own at any world size (compiled kernels, accumulated micro-batches)."""
    if world_size < 1:
        raise ValueError(f"budget_source: world_size={world_size} must be at least 1")
    order_free = world_size <= ORDER_FREE_WORLD_SIZE and not reorders
    if spec.is_mixed:
        return "ablation" if order_free else "emulation"
    if dtype_of(spec.full) == torch.float64 or order_free:
        return "none"
    return "reference"


def emulation_orders(world_size: int) -> tuple[RankOrder, ...]:
    """The orders the emulation sums the ranks' gradients in when it measures a budget (the module docstring
    says why more than one): past ``ORDER_FREE_WORLD_SIZE`` ranks rank order and its reverse, the two
    directions of a ring; up to it rank order alone, as one addition commutes."""
    if world_size < 1:
        raise ValueError(f"emulation_orders: world_size={world_size} must be at least 1")
    return ("ranks",) if world_size <= ORDER_FREE_WORLD_SIZE else ("ranks", "reversed")


@dataclass(frozen=True)
class DerivedBudget:
    """One quantity's mixed-precision budget and what it was derived from."""

    #: the absolute budget (widens ``atol`` where larger).
    budget: float
    #: the resolvable reference whose distance set it; empty when none resolves (no budget).
    nearest: str
    #: the references an engine computing them would fail on this quantity.
    resolvable: tuple[str, ...]


def ablation_budget(distances: Mapping[str, float], floor: float, factor: float = MIXED_PRECISION_FACTOR) -> DerivedBudget:
    """``factor`` times the distance to the nearest reference whose ``factor``-fold distance exceeds
    ``floor`` (what the tolerance allows anyway); no budget where none does."""
    if not 0 < factor < 1:
        raise ValueError(
            f"ablation_budget: factor={factor} must be in (0, 1): at 1 or more an engine that drops a cast "
            "(and lands on that run) would pass"
        )
    resolvable = {name: d for name, d in distances.items() if factor * d > floor}
    if not resolvable:
        return DerivedBudget(0.0, "", ())
    nearest = min(resolvable, key=resolvable.__getitem__)
    return DerivedBudget(factor * resolvable[nearest], nearest, tuple(sorted(resolvable)))


def mixed_precision_budgets(
    distances: Mapping[str, Mapping[str, float]], scales: Mapping[str, float], full: str
) -> dict[str, DerivedBudget]:
    """Per quantity: the ``ablation_budget`` from the emulation's ``distances`` (per reference name, per
    quantity, worst over the ranks) and the quantity's magnitude ``scales`` (torch's tolerance there
    is the floor)."""
    rtol, atol = DEFAULT_TOLERANCES.get(dtype_of(full), DEFAULT_TOLERANCES[torch.float32])
    quantities = sorted({q for per in distances.values() for q in per})
    return {
        q: ablation_budget({name: per.get(q, 0.0) for name, per in distances.items()}, atol + rtol * scales.get(q, 0.0))
        for q in quantities
    }
