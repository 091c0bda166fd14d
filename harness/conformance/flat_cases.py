"""Hypothesis strategies for flat-parameter fuzzing: small module trees as plain data.

A drawn :class:`FlatCase` is a description (frozen dataclasses), not a module: it prints and
shrinks well, and :meth:`FlatCase.build` turns it into a fresh module whose parameter values are
random bit patterns (NaN payloads, subnormals and negative zero included), so every equality
check downstream is bitwise. Shapes are tiny on purpose: the time must go to the checks, not to
building modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Union

import torch
import torch.nn as nn
from hypothesis import assume, note
from hypothesis import strategies as st

from harness.cases.case import ShardingName

LeafKind = Literal[
    "linear", "conv1d", "conv2d", "embedding", "layer_norm", "batch_norm", "group_norm", "rms_norm", "relu"
]
ContainerKind = Literal["sequential", "module_list", "module_dict", "custom"]

PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: integer dtype of the same width, to compare and fill floating tensors bit by bit.
BITS_DTYPE = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}
_SHORT = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32", torch.float64: "fp64", None: "-"}


@dataclass(frozen=True)
class LeafSpec:
    """One module with parameters of its own (or none, for ``relu``)."""

    kind: LeafKind
    #: the constructor's size arguments in its order (conv: in, out, kernel...; group_norm: groups, channels).
    dims: tuple[int, ...]
    #: whether the module has a bias (ignored by kinds that always or never have one).
    bias: bool
    #: ``requires_grad=False`` on all of this module's parameters.
    frozen: bool

    def build(self, dtype: torch.dtype) -> nn.Module:
        d, kw = self.dims, {"dtype": dtype}
        if self.kind == "linear":
            return nn.Linear(d[0], d[1], bias=self.bias, **kw)
        if self.kind == "conv1d":
            return nn.Conv1d(d[0], d[1], d[2], bias=self.bias, **kw)
        if self.kind == "conv2d":
            return nn.Conv2d(d[0], d[1], (d[2], d[3]), bias=self.bias, **kw)
        if self.kind == "embedding":
            return nn.Embedding(d[0], d[1], **kw)
        if self.kind == "layer_norm":
            return nn.LayerNorm(d[0], bias=self.bias, **kw)
        if self.kind == "batch_norm":
            return nn.BatchNorm1d(d[0], **kw)
        if self.kind == "group_norm":
            return nn.GroupNorm(d[0], d[1], **kw)
        if self.kind == "rms_norm":
            return nn.RMSNorm(d[0], **kw)
        return nn.ReLU()

    def describe(self) -> str:
        bias = "+b" if self.bias and self.kind in ("linear", "conv1d", "conv2d", "layer_norm") else ""
        frozen = " frozen" if self.frozen and self.kind != "relu" else ""
        return f"{self.kind}{list(self.dims)}{bias}{frozen}"


@dataclass(frozen=True)
class ReuseSpec:
    """The module object of an earlier leaf registered again (all its parameters shared)."""

    #: index of the leaf, in drawing (= registration) order.
    index: int

    def describe(self) -> str:
        return f"reuse(#{self.index})"


@dataclass(frozen=True)
class TieSpec:
    """A bias-free ``Linear`` whose weight is an earlier leaf's first parameter (a tied weight)."""

    index: int

    def describe(self) -> str:
        return f"tie(#{self.index})"


@dataclass(frozen=True)
class ContainerSpec:
    kind: ContainerKind
    children: tuple["NodeSpec", ...]

    def describe(self) -> str:
        return f"{self.kind}(" + ", ".join(c.describe() for c in self.children) + ")"


NodeSpec = Union[LeafSpec, ReuseSpec, TieSpec, ContainerSpec]


class _Custom(nn.Module):
    """A user-style module holding children as plain attributes."""


def _build_node(spec: NodeSpec, dtype: torch.dtype, leaves: list[nn.Module]) -> nn.Module:
    if isinstance(spec, LeafSpec):
        module = spec.build(dtype)
        for p in module.parameters():
            p.requires_grad_(not spec.frozen)
        leaves.append(module)
        return module
    if isinstance(spec, ReuseSpec):
        return leaves[spec.index]
    if isinstance(spec, TieSpec):
        tied = nn.Linear(1, 1, bias=False, dtype=dtype)
        tied.weight = next(leaves[spec.index].parameters())
        return tied
    children = [_build_node(c, dtype, leaves) for c in spec.children]
    if spec.kind == "sequential":
        return nn.Sequential(*children)
    if spec.kind == "module_list":
        return nn.ModuleList(children)
    if spec.kind == "module_dict":
        return nn.ModuleDict({f"k{i}": c for i, c in enumerate(children)})
    custom = _Custom()
    for i, child in enumerate(children):
        setattr(custom, f"m{i}", child)
    return custom


@dataclass(frozen=True)
class FlatCase:
    """A module tree plus everything a flat-parameter handle is constructed with."""

    tree: ContainerSpec
    #: dtype of every original parameter.
    dtype: torch.dtype
    #: MixedPrecision(param_dtype=...): the compute dtype, which decides the alignment unit.
    mp_param_dtype: torch.dtype | None
    mp_reduce_dtype: torch.dtype | None
    #: True is the aligned mode (FSDP1 aligns only with use_orig_params).
    use_orig_params: bool
    world_size: int
    #: the rank a single handle is built for (properties over all ranks ignore it).
    rank: int
    sharding: ShardingName
    #: convert 4-D weights to channels_last, so some parameters are not contiguous.
    channels_last: bool
    #: seeds the parameters' random bit patterns.
    seed: int

    @property
    def compute_dtype(self) -> torch.dtype:
        return self.mp_param_dtype or self.dtype

    def build(self) -> nn.Module:
        """A fresh module; the same case always builds bitwise-identical parameters."""
        root = _build_node(self.tree, self.dtype, [])
        if self.channels_last:
            root = root.to(memory_format=torch.channels_last)
        gen = torch.Generator().manual_seed(self.seed)
        bits = BITS_DTYPE[self.dtype]
        width = torch.empty((), dtype=bits).element_size()
        for p in root.parameters():
            raw = torch.randint(0, 256, (p.numel() * width,), dtype=torch.uint8, generator=gen)
            with torch.no_grad():
                p.view(bits).copy_(raw.view(bits).view(p.shape))
        return root

    def describe(self) -> str:
        mode = "aligned" if self.use_orig_params else "unaligned"
        layout = " channels_last" if self.channels_last else ""
        return (
            f"{self.tree.describe()} dtype={_SHORT[self.dtype]} mp_param={_SHORT[self.mp_param_dtype]} "
            f"mp_reduce={_SHORT[self.mp_reduce_dtype]} {mode} {self.sharding} world_size={self.world_size} "
            f"rank={self.rank}{layout} seed={self.seed}"
        )


def _leaf_param_numels(leaf: LeafSpec) -> list[int]:
    """Numels of the parameters ``leaf`` registers, from the spec alone."""
    d = leaf.dims
    if leaf.kind == "linear":
        return [d[0] * d[1]] + ([d[1]] if leaf.bias else [])
    if leaf.kind == "conv1d":
        return [d[1] * d[0] * d[2]] + ([d[1]] if leaf.bias else [])
    if leaf.kind == "conv2d":
        return [d[1] * d[0] * d[2] * d[3]] + ([d[1]] if leaf.bias else [])
    if leaf.kind == "embedding":
        return [d[0] * d[1]]
    if leaf.kind == "layer_norm":
        return [d[0]] + ([d[0]] if leaf.bias else [])
    if leaf.kind in ("batch_norm", "group_norm"):
        return [d[-1], d[-1]]
    if leaf.kind == "rms_norm":
        return [d[0]]
    return []


@st.composite
def leaf_specs(draw: st.DrawFn, *, frozen: bool | None = None) -> LeafSpec:
    """One leaf module; ``frozen=None`` draws whether it is frozen."""
    kind = draw(st.sampled_from(LeafKind.__args__))  # type: ignore[attr-defined]
    small = st.integers(1, 8)
    if kind == "linear":
        # in_features=0 gives a zero-numel weight: an edge case of shard membership.
        dims = (draw(st.integers(0, 8)), draw(small))
    elif kind == "conv1d":
        dims = (draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 3)))
    elif kind == "conv2d":
        dims = (draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    elif kind == "embedding":
        dims = (draw(st.integers(1, 10)), draw(st.integers(1, 6)))
    elif kind == "group_norm":
        groups = draw(st.integers(1, 3))
        dims = (groups, groups * draw(st.integers(1, 3)))
    elif kind == "relu":
        dims = ()
    else:
        dims = (draw(small),)
    bias = draw(st.booleans())
    return LeafSpec(kind, dims, bias, draw(st.booleans()) if frozen is None else frozen)


@st.composite
def module_trees(
    draw: st.DrawFn, *, max_children: int = 4, max_depth: int = 2, frozen: bool | None = None
) -> ContainerSpec:
    """A container of leaves, nested containers (``max_depth`` levels below the root), reused
    modules and tied weights.

    At least one parameter has at least one element (an all-empty flat parameter is rejected by
    torch FSDP1 as well, so it is not a layout case).
    """
    leaves: list[LeafSpec] = []

    def node(depth: int) -> NodeSpec:
        with_params = [i for i, leaf in enumerate(leaves) if _leaf_param_numels(leaf)]
        choices = ["leaf", "leaf", "leaf"]
        if depth < max_depth:
            choices.append("container")
        if leaves:
            choices.append("reuse")
        if with_params:
            choices.append("tie")
        choice = draw(st.sampled_from(choices))
        if choice == "leaf":
            leaves.append(draw(leaf_specs(frozen=frozen)))
            return leaves[-1]
        if choice == "reuse":
            return ReuseSpec(draw(st.integers(0, len(leaves) - 1)))
        if choice == "tie":
            return TieSpec(draw(st.sampled_from(with_params)))
        return container(depth + 1)

    def container(depth: int) -> ContainerSpec:
        kind = draw(st.sampled_from(ContainerKind.__args__))  # type: ignore[attr-defined]
        count = draw(st.integers(1, max_children))
        return ContainerSpec(kind, tuple(node(depth) for _ in range(count)))

    tree = container(0)
    assume(any(n > 0 for leaf in leaves for n in _leaf_param_numels(leaf)))
    return tree


@st.composite
def flat_cases(
    draw: st.DrawFn,
    *,
    max_world_size: int = 64,
    aligned: bool | None = None,
    shardings: tuple[ShardingName, ...] = ("full_shard",),
) -> FlatCase:
    """A module tree with dtypes, alignment mode, world size, rank and sharding strategy.

    ``aligned=None`` draws the mode. Unaligned mode requires uniform ``requires_grad`` (as FSDP1),
    so there one frozen flag is drawn for the whole tree; aligned mode freezes leaf by leaf.
    """
    use_orig_params = draw(st.booleans()) if aligned is None else aligned
    frozen = None if use_orig_params else draw(st.booleans())
    tree = draw(module_trees(frozen=frozen))
    world_size = draw(st.integers(1, max_world_size))
    case = FlatCase(
        tree=tree,
        dtype=draw(st.sampled_from(PARAM_DTYPES)),
        mp_param_dtype=draw(st.sampled_from((None, *PARAM_DTYPES))),
        mp_reduce_dtype=draw(st.sampled_from((None, *PARAM_DTYPES))),
        use_orig_params=use_orig_params,
        world_size=world_size,
        rank=draw(st.integers(0, world_size - 1)),
        sharding=draw(st.sampled_from(shardings)),
        channels_last=draw(st.booleans()),
        seed=draw(st.integers(0, 2**32 - 1)),
    )
    note(f"case: {case.describe()}")
    return case
