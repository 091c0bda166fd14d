"""Fuzzing the flat parameter: random module trees against layout invariants and torch FSDP1.

Each test checks one property over :func:`~harness.conformance.flat_cases.flat_cases` on the builtin
engine's ``FlatParamHandle``. Two runners collect them: the CI tier through
``suites/flat_param/test_fuzz_flat_param.py`` (profile ``ci``: 300 derandomized examples, or
``--hypothesis-profile``/``FUZZ_PROFILE``), and the nightly's campaign
(``python -m harness.conformance.fuzz_campaign``, profile ``nightly``: 10,000), which runs this file
alone and reports examples per second. Each property body counts its examples in ``EXAMPLES``, for the
campaign (shrinking and replays count too).

The element-ownership oracle below is deliberately naive: it walks the unsharded buffer one
element at a time and shares no code or arithmetic shortcut with ``engine.layout``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from hypothesis import given, note
from torch import Tensor

from engine.flat_param import FlatParamHandle, HandleShardingStrategy
from harness.conformance.flat_cases import FlatCase, flat_cases
from harness.conformance.flat_handles import Registrations, bits, case_kwargs, shard_per_rank, storage_order

try:  # torch FSDP1 is the differential reference only; the engine never imports it.
    from torch.distributed.fsdp import _flat_param as torch_flat_param
except ImportError:
    torch_flat_param = None

#: what a collector of these properties imports: the tests, and the marks that go with them.
__all__ = [
    "test_every_element_owned_once_at_oracle_offset",
    "test_numels_and_bytes_preserved",
    "test_aligned_mode_starts_are_aligned",
    "test_shards_equal_size_and_padding_bounded",
    "test_shard_concat_unflatten_roundtrip_bitwise",
    "test_metadata_and_shard_match_torch_fsdp1",
    "pytestmark",
]

pytestmark = [
    # in_features=0 Linears are drawn on purpose (zero-numel parameters).
    pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op"),
]

#: examples run per property (property name -> count); the campaign reads it.
EXAMPLES: Counter[str] = Counter()


def count_example(prop: str) -> None:
    EXAMPLES[prop] += 1


#: the alignment flat parameters keep, in bytes (TorchInductor's assumption about parameter addresses).
ALIGN_BYTES = 16
SHARDED = ("full_shard", "shard_grad_op", "hybrid_shard")
ALL_STRATEGIES = (*SHARDED, "no_shard")


def _itemsize(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _align_numel(case: FlatCase) -> int:
    """Elements per alignment unit of the compute dtype; 0 in unaligned mode."""
    return max(ALIGN_BYTES // _itemsize(case.compute_dtype), 1) if case.use_orig_params else 0


@dataclass(frozen=True)
class Ownership:
    """Where every element of every original parameter must end up."""

    #: per parameter, per element (in storage order): ``(rank, offset in that rank's shard)``.
    owners: list[list[tuple[int, int]]]
    #: numel of the unsharded flat parameter, alignment and world-size padding included.
    total: int
    #: numel of every rank's shard, right padding included.
    shard_numel: int

    def right_padding(self, rank: int) -> int:
        start = rank * self.shard_numel
        return sum(1 for pos in range(start, start + self.shard_numel) if pos >= self.total)


def ownership_oracle(numels: list[int], *, world_size: int, align_numel: int) -> Ownership:
    """Brute force: place elements one by one, skipping to alignment, then deal out equal shards."""
    cursor = 0
    positions: list[list[int]] = []
    for numel in numels:
        while align_numel and cursor % align_numel:
            cursor += 1
        positions.append([])
        for _ in range(numel):
            positions[-1].append(cursor)
            cursor += 1
    while align_numel and cursor % world_size:
        cursor += 1
    shard_numel = 0
    while shard_numel * world_size < cursor:
        shard_numel += 1
    owners = [[(pos // shard_numel, pos % shard_numel) for pos in param] for param in positions]
    return Ownership(owners, cursor, shard_numel)


def _originals(module: nn.Module) -> list[tuple[str, Tensor]]:
    """Unique parameters in first-registration order, as torch's own traversal reports them."""
    return [(name, p.detach().clone()) for name, p in module.named_parameters()]


def _strides_that_matter(t: Tensor) -> tuple[int, ...]:
    """Strides of the dimensions longer than 1: the others never move the address, so their
    strides are arbitrary (a channels_last 1x1 conv weight is also "contiguous")."""
    return tuple(stride for stride, size in zip(t.stride(), t.shape) if size > 1)


def _note_layout(handle: FlatParamHandle) -> None:
    note(f"numels_with_padding={handle.flat_param._numels_with_padding} fqns={handle.flat_param._fqns}")


def _sharded_with_oracle(case: FlatCase) -> tuple[list[tuple[str, Tensor]], list[FlatParamHandle], list[int], Ownership]:
    """The case's module flattened on every rank, with its original parameters, their numels and the
    ownership oracle over them."""
    module = case.build()
    originals = _originals(module)
    handles = shard_per_rank(module, case, FlatParamHandle, range(case.world_size))
    _note_layout(handles[0])
    numels = [t.numel() for _, t in originals]
    return originals, handles, numels, ownership_oracle(numels, world_size=case.world_size, align_numel=_align_numel(case))


# ---------------------------------------------------------------------------------------- (a)
@given(case=flat_cases(shardings=SHARDED))
def test_every_element_owned_once_at_oracle_offset(case: FlatCase) -> None:
    """Over all ranks' real shards, every element of every original parameter is held exactly
    once, at the (rank, offset) the oracle computes, with its own bits; shard metadata agrees."""
    count_example("a_ownership")
    originals, handles, numels, oracle = _sharded_with_oracle(case)
    expected_bits = [bits(storage_order(t)).tolist() for _, t in originals]

    held: list[list[list[tuple[int, int]]]] = [[[] for _ in range(n)] for n in numels]
    for rank, handle in enumerate(handles):
        assert handle.flat_param._fqns == tuple(name for name, _ in originals)
        shard_bits = bits(handle.flat_param.detach()).tolist()
        expected_rows = []
        for k, info in enumerate(handle.flat_param._shard_param_infos):
            if not info.in_shard:
                continue
            assert info.numel_in_shard == info.intra_param_end_idx - info.intra_param_start_idx + 1
            for j in range(info.intra_param_start_idx, info.intra_param_end_idx + 1):
                offset = info.offset_in_shard + j - info.intra_param_start_idx
                held[k][j].append((rank, offset))
                assert shard_bits[offset] == expected_bits[k][j], (
                    f"rank {rank} offset {offset}: wrong bits for element {j} of {originals[k][0]}"
                )
        for k, (name, _) in enumerate(originals):
            mine = [j for j, (owner, _) in enumerate(oracle.owners[k]) if owner == rank]
            if mine:
                expected_rows.append((name, (mine[0], mine[-1])))
        metadata = handle.shard_metadata()
        actual_rows = [
            (name, offsets)
            for name, numel, offsets in zip(metadata.param_names, metadata.param_numels, metadata.param_offsets)
            if numel > 0
        ]
        assert actual_rows == expected_rows, f"rank {rank}: shard_metadata() disagrees with the oracle"
    assert held == [[[owner] for owner in param] for param in oracle.owners]


# ---------------------------------------------------------------------------------------- (b)
@given(case=flat_cases(shardings=ALL_STRATEGIES))
def test_numels_and_bytes_preserved(case: FlatCase) -> None:
    """Flattening and sharding lose and duplicate no element and no byte: shared parameters
    count once, every registration is accounted for, and the world holds the whole buffer."""
    count_example("b_numel_bytes")
    module = case.build()
    registrations = len(list(module.named_parameters(remove_duplicate=False)))
    originals = _originals(module)
    handle = FlatParamHandle(list(module.parameters()), module, **case_kwargs(case, case.rank))
    _note_layout(handle)
    flat = handle.flat_param
    unsharded_numel, unsharded_bytes = flat.numel(), flat.numel() * flat.element_size()
    real_numel = sum(t.numel() for _, t in originals)
    real_bytes = sum(t.numel() * t.element_size() for _, t in originals)

    assert flat.dtype == case.dtype
    assert flat._numels == tuple(t.numel() for _, t in originals)
    assert len(flat._fqns) + len(list(handle.shared_param_module_names())) == registrations
    real_segments = [n for n, pad in zip(flat._numels_with_padding, flat._is_padding_mask) if not pad]
    assert real_segments == list(flat._numels)
    assert sum(flat._numels_with_padding) == unsharded_numel
    assert sum(real_segments) * flat.element_size() == real_bytes
    assert unsharded_bytes - real_bytes == (unsharded_numel - real_numel) * _itemsize(case.dtype)
    if not case.use_orig_params:
        assert unsharded_numel == real_numel, "unaligned mode adds no padding to the unsharded buffer"

    handle.shard()
    shard = handle.flat_param
    held = sum(i.numel_in_shard for i in shard._shard_param_infos if i.in_shard)
    assert held + shard._shard_numel_padded <= shard.numel()
    if case.sharding == "no_shard":
        assert (shard.numel(), held, shard._shard_numel_padded) == (unsharded_numel, real_numel, 0)
    else:
        assert shard.numel() * case.world_size >= unsharded_numel
        assert (shard.numel() - 1) * case.world_size < unsharded_numel


# ---------------------------------------------------------------------------------------- (c)
@given(case=flat_cases(aligned=True, shardings=SHARDED))
def test_aligned_mode_starts_are_aligned(case: FlatCase) -> None:
    """In aligned mode every original parameter starts at a multiple of 16 bytes of the compute
    dtype, its data really sits there, and every shard starts at a whole element boundary."""
    count_example("c_alignment")
    module = case.build()
    originals = _originals(module)
    handle = FlatParamHandle(list(module.parameters()), module, **case_kwargs(case, case.rank))
    _note_layout(handle)
    align = _align_numel(case)
    unsharded = bits(handle.flat_param.detach())
    flat = handle.flat_param
    start, starts = 0, []
    for numel, pad in zip(flat._numels_with_padding, flat._is_padding_mask):
        if pad:
            assert numel < max(align, case.world_size), f"padding segment of {numel} is more than needed"
        else:
            starts.append(start)
        start += numel
    assert start % case.world_size == 0
    for (name, original), begin in zip(originals, starts):
        assert begin % align == 0, f"{name} starts at element {begin}"
        assert begin * _itemsize(case.compute_dtype) % ALIGN_BYTES == 0, f"{name} starts at element {begin}"
        assert torch.equal(unsharded[begin : begin + original.numel()], bits(storage_order(original))), name

    handle.shard()
    shard_numel = handle.flat_param.numel()
    for (name, _), info, begin in zip(originals, handle.flat_param._shard_param_infos, starts):
        if info.in_shard and info.intra_param_start_idx == 0 and info.numel_in_shard > 0:
            assert case.rank * shard_numel + info.offset_in_shard == begin, name


# ---------------------------------------------------------------------------------------- (d)
@given(case=flat_cases(shardings=SHARDED))
def test_shards_equal_size_and_padding_bounded(case: FlatCase) -> None:
    """Every rank's shard has the same size; right padding is where the oracle says and the
    total padding is at most what alignment and the world size force."""
    count_example("d_equal_shards")
    originals, handles, numels, oracle = _sharded_with_oracle(case)

    assert {h.flat_param.numel() for h in handles} == {oracle.shard_numel}
    assert [h.flat_param._shard_numel_padded for h in handles] == [
        oracle.right_padding(r) for r in range(case.world_size)
    ]
    total_padding = oracle.shard_numel * case.world_size - sum(numels)
    align = _align_numel(case)
    bound = (len(numels) - 1) * max(align - 1, 0) + case.world_size - 1
    assert total_padding <= bound, f"{total_padding} padding elements, at most {bound} are needed"
    if case.use_orig_params:
        assert all(h.flat_param._shard_numel_padded == 0 for h in handles), "aligned mode pads the buffer, not shards"


# ---------------------------------------------------------------------------------------- (e)
@given(case=flat_cases(shardings=SHARDED))
def test_shard_concat_unflatten_roundtrip_bitwise(case: FlatCase) -> None:
    """flatten -> shard (every rank's real shard()) -> concatenate -> unflatten returns every
    original tensor bitwise, with its shape and strides, and re-registers tied parameters as one;
    flatten_tensors() of the originals reproduces the concatenated shards' real elements."""
    count_example("e_roundtrip")
    module = case.build()
    registered = [(name, id(p), p.detach().clone()) for name, p in module.named_parameters(remove_duplicate=False)]
    originals = _originals(module)
    handles = shard_per_rank(module, case, FlatParamHandle, range(case.world_size))
    _note_layout(handles[0])
    gathered = torch.cat([h.flat_param.detach() for h in handles])

    flat = handles[0].flat_param
    reflattened = handles[0].flatten_tensors([t for _, t in originals])
    start = 0
    for numel, pad in zip(flat._numels_with_padding, flat._is_padding_mask):
        if not pad:
            segment = slice(start, start + numel)
            assert torch.equal(bits(reflattened[segment]), bits(gathered[segment])), f"segment at {start}"
        start += numel

    views = handles[0].unflat_views(gathered)
    assert len(views) == len(originals)
    for view, (name, original) in zip(views, originals):
        assert view.shape == original.shape, name
        assert _strides_that_matter(view) == _strides_that_matter(original), name
        assert torch.equal(bits(view), bits(original)), name

    handles[-1].use_unsharded_views(as_params=True, source=gathered)
    restored = list(module.named_parameters(remove_duplicate=False))
    assert [name for name, _ in restored] == [name for name, _, _ in registered]
    same_object = {}
    for (name, param), (_, orig_id, original) in zip(restored, registered):
        assert isinstance(param, nn.Parameter), name
        assert torch.equal(bits(param.detach()), bits(original)), name
        same_object.setdefault(orig_id, set()).add(id(param))
    assert all(len(ids) == 1 for ids in same_object.values()), "tied parameters came back as different objects"
    assert len({i for ids in same_object.values() for i in ids}) == len(same_object)


# ---------------------------------------------------------------------------------------- (f)
def _handle_state(handle, registrations: Registrations, *, sharded: bool, with_attrs: bool) -> dict[str, object]:
    """What a handle exposes, normalised so ours and torch FSDP1's compare with ``==``."""
    flat = handle.flat_param
    real_bits = bits(flat.detach()).tolist()
    state: dict[str, object] = {
        "numel": flat.numel(),
        "dtype": flat.dtype,
        "requires_grad": flat.requires_grad,
        "fqns": tuple(flat._fqns),
        "shapes": tuple(tuple(s) for s in flat._shapes),
        "strides": tuple(tuple(s) for s in flat._strides),
        "contiguities": tuple(flat._contiguities),
        "numels": tuple(flat._numels),
        "numels_with_padding": tuple(flat._numels_with_padding),
        "is_padding_mask": tuple(flat._is_padding_mask),
        "param_module_names": tuple(handle.param_module_names()),
        "shared_param_module_names": tuple(handle.shared_param_module_names()),
        "fwd_bwd_param_dtype": handle._fwd_bwd_param_dtype,
        "reduce_dtype": handle._reduce_dtype,
    }
    if sharded:
        infos = flat._shard_param_infos
        state["shard_param_infos"] = tuple(tuple(i) for i in infos)
        state["shard_numel_padded"] = flat._shard_numel_padded
        state["shard_metadata"] = tuple(
            tuple(tuple(x) if isinstance(x, (list, tuple)) else x for x in field) for field in handle.shard_metadata()
        )
        state["real_elements"] = [
            real_bits[i.offset_in_shard : i.offset_in_shard + i.numel_in_shard] for i in infos if i.in_shard
        ]
    else:
        start, real = 0, []
        for numel, pad in zip(flat._numels_with_padding, flat._is_padding_mask):
            if not pad:
                real.append(real_bits[start : start + numel])
            start += numel
        state["real_elements"] = real
    if with_attrs:
        attrs = []
        for module, name, param in registrations.entries:
            value = getattr(module, name)
            is_param = type(value) is nn.Parameter
            attrs.append((name, is_param, value is param, tuple(value.shape), value.stride(), bits(value.detach()).tolist()))
        state["module_attributes"] = attrs
    return state


def handle_states(case: FlatCase, make, strategy_enum, module: nn.Module, registrations: Registrations) -> tuple[dict, dict]:
    """What the handle of ``make`` (a ``FlatParamHandle`` class) exposes for ``case`` on ``module``,
    constructed and then sharded: the two states the differential property compares."""
    registrations.restore()
    handle = make(list(module.parameters()), module, **case_kwargs(case, case.rank, strategy_enum))
    before = _handle_state(handle, registrations, sharded=False, with_attrs=True)
    handle.shard()
    # Without use_orig_params, module attributes are views of the freed unsharded buffer after shard().
    after = _handle_state(handle, registrations, sharded=True, with_attrs=case.use_orig_params)
    return before, after


@pytest.mark.skipif(torch_flat_param is None, reason="torch built without distributed: no FSDP1 to compare with")
@given(case=flat_cases(shardings=ALL_STRATEGIES))
def test_metadata_and_shard_match_torch_fsdp1(case: FlatCase) -> None:
    """Differential: on the same module, our handle and torch FSDP1's FlatParamHandle agree on all
    metadata, on the shard's real elements (bitwise), and on what the module's attributes hold."""
    count_example("f_torch_differential")
    module = case.build()
    registrations = Registrations(module)
    ours = handle_states(case, FlatParamHandle, HandleShardingStrategy, module, registrations)
    theirs = handle_states(
        case, torch_flat_param.FlatParamHandle, torch_flat_param.HandleShardingStrategy, module, registrations
    )
    for phase, mine, ref in zip(("constructed", "sharded"), ours, theirs):
        assert mine.keys() == ref.keys()
        for key in mine:
            assert mine[key] == ref[key], f"{phase}: {key} differs from torch FSDP1"
