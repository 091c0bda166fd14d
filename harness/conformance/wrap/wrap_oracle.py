"""Auto wrapping against torch FSDP1 as the oracle: over random module trees, callable policies and
ignored modules, our wrapping picks the units torch FSDP1's ``_recursive_wrap`` picks.
"""

from __future__ import annotations

import functools

import torch.nn as nn
from hypothesis import event, given
from hypothesis import strategies as st
from torch.nn.modules.batchnorm import _BatchNorm

from engine.wrap import (
    _or_policy,
    _wrap_module_cls_individually,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from harness.conformance.wrap.wrap_models import RecordingUnit, recorded

#: what a collector of these tests imports (the suite of the same name): fixtures, then the tests in
#: the order they run, then the marks.
__all__ = ["recorded", "test_callable_policies_wrap_what_fsdp1_wraps"]

wrap_bn_individually = functools.partial(_wrap_module_cls_individually, module_classes=[_BatchNorm])


class Block(nn.Module):
    """A custom container, the class-policy target in the property test."""

    def __init__(self, children: list[nn.Module]) -> None:
        super().__init__()
        for i, child in enumerate(children):
            self.add_module(f"c{i}", child)


LEAVES = st.one_of(
    st.tuples(st.just("linear"), st.integers(1, 10), st.integers(1, 10)),
    st.just(("mha",)),
    st.just(("bn",)),
)
TREES = st.recursive(
    LEAVES,
    lambda children: st.tuples(st.sampled_from(["seq", "list", "block"]), st.lists(children, min_size=1, max_size=3)),
    max_leaves=10,
)


def build(spec: tuple) -> nn.Module:
    kind = spec[0]
    if kind == "linear":
        return nn.Linear(spec[1], spec[2])
    if kind == "mha":
        return nn.MultiheadAttention(4, 1)
    if kind == "bn":
        return nn.BatchNorm1d(3)
    children = [build(child) for child in spec[1]]
    if kind == "seq":
        return nn.Sequential(*children)
    return nn.ModuleList(children) if kind == "list" else Block(children)


@st.composite
def callable_policies(draw: st.DrawFn):
    kind = draw(st.sampled_from(["size", "size_custom", "always", "block", "lambda", "or"]))
    size = functools.partial(size_based_auto_wrap_policy, min_num_params=draw(st.integers(0, 300)))
    if kind == "size":
        return size
    if kind == "size_custom":
        return functools.partial(
            size, force_leaf_modules={nn.Linear, Block}, exclude_wrap_modules={nn.Sequential}
        )
    if kind == "always":
        return always_wrap_policy
    if kind == "block":
        return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    if kind == "lambda":
        return functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear) and m.in_features % 2)
    return functools.partial(_or_policy, policies=[size, wrap_bn_individually])


class OracleUnit(nn.Module):
    def __init__(self, module: nn.Module, **kwargs: object) -> None:
        super().__init__()
        self.module = module


@given(spec=TREES, policy=callable_policies(), ignore_bits=st.lists(st.booleans(), max_size=30))
def test_callable_policies_wrap_what_fsdp1_wraps(spec: tuple, policy, ignore_bits: list[bool]) -> None:
    """Our auto wrapping picks the same units as torch FSDP1's ``_recursive_wrap``."""
    from torch.distributed.fsdp.wrap import _recursive_wrap

    def unit_names(root: nn.Module, unit_cls: type) -> set[str]:
        return {name for name, m in root.named_modules() if isinstance(m, unit_cls)}

    ours, theirs = build(spec), build(spec)
    # The same submodules (by position, the root excluded) are ignored in both trees.
    ignored_ours = {m for m, bit in zip(list(ours.modules())[1:], ignore_bits) if bit}
    ignored_theirs = {m for m, bit in zip(list(theirs.modules())[1:], ignore_bits) if bit}
    # Ignoring a module ignores its subtree, as FSDP1's constructor expands it.
    ignored_theirs = {sub for m in ignored_theirs for sub in m.modules()}
    _recursive_wrap(
        theirs,
        auto_wrap_policy=policy,
        wrapper_cls=OracleUnit,
        ignored_modules=ignored_theirs,
        ignored_params={p for m in ignored_theirs for p in m.parameters()},
        only_wrap_children=True,
    )
    root = RecordingUnit(ours, auto_wrap_policy=policy, ignored_modules=ignored_ours)
    expected = unit_names(theirs, OracleUnit)
    event(f"units: {min(len(expected), 3)}{'+' if len(expected) >= 3 else ''}")
    assert unit_names(root.module, RecordingUnit) == expected
