"""Constructor and utility arguments: a wrong type is a ValueError naming the parameter and the type
it needs, raised before anything changes; torch FSDP1's own enums and configurations are accepted as
their equivalents (the test imports ``torch.distributed.fsdp``; the engine never does).

In one process, on a one-rank process-group double (no communication).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.fsdp as torch_fsdp
import torch.nn as nn

import engine
from engine import FSDP
from engine.arguments import is_torch_fsdp_object
from engine.wrap import always_wrap_policy
from harness.conformance.engine_models import NestedWrapped
from harness.conformance.flat_handles import DummyProcessGroup

PG = DummyProcessGroup(rank=0, size=1)


def _snapshot(module: nn.Module) -> list[tuple[str, int, str]]:
    return [(n, id(p), str(p.device)) for n, p in module.named_parameters()] + [
        (n, id(m), type(m).__name__) for n, m in module.named_modules()
    ]


BAD = [
    ("cpu_offload", True, r"cpu_offload=True .*must be a CPUOffload.*CPUOffload\(offload_params=True\)"),
    ("cpu_offload", "yes", r"cpu_offload='yes' .*must be a CPUOffload"),
    ("mixed_precision", {"param_dtype": torch.float16}, r"mixed_precision=\{.*\}.*must be a MixedPrecision.*dict"),
    ("mixed_precision", torch.float16, r"mixed_precision=torch.float16 .*must be a MixedPrecision.*MixedPrecision\(param_dtype=torch.float16"),
    ("mixed_precision", engine.MixedPrecision(param_dtype="bf16"), r"MixedPrecision.param_dtype='bf16' .*must be a torch.dtype.*torch.bfloat16"),
    ("mixed_precision", engine.MixedPrecision(reduce_dtype="float32"), r"MixedPrecision.reduce_dtype='float32' .*must be a torch.dtype"),
    ("mixed_precision", engine.MixedPrecision(buffer_dtype=16), r"MixedPrecision.buffer_dtype=16 .*must be a torch.dtype"),
    ("process_group", "gloo", r"process_group='gloo' .*must be a torch.distributed.ProcessGroup"),
    ("process_group", (PG, "gloo"), r"process_group=.*must be a torch.distributed.ProcessGroup"),
    ("sharding_strategy", "FULL_SHARD", r"sharding_strategy='FULL_SHARD' .*must be a ShardingStrategy member"),
    ("backward_prefetch", 1, r"backward_prefetch=1 .*must be a BackwardPrefetch member"),
    ("device_id", 1.5, r"device_id=1.5 .*must be an int"),
    ("device_id", "not-a-device", r"device_id='not-a-device' is not a device"),
    ("use_orig_params", "True", r"use_orig_params='True' .*must be a bool"),
    ("sync_module_states", None, r"sync_module_states=None .*must be a bool"),
]


@pytest.mark.parametrize("name, value, message", BAD, ids=[f"{n}-{i}" for i, (n, _, _) in enumerate(BAD)])
def test_wrong_argument_is_a_value_error_before_anything_changes(name: str, value: object, message: str) -> None:
    model = NestedWrapped()
    before = _snapshot(model)
    kwargs = {"process_group": PG, "auto_wrap_policy": always_wrap_policy, name: value}
    with pytest.raises(ValueError, match=message):
        FSDP(model, **kwargs)
    assert _snapshot(model) == before, "the module was changed before the argument was refused"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA; this one has CUDA")
@pytest.mark.parametrize("device_id", ["cuda:0", 0, torch.device("cuda", 0), "cuda"])
def test_cuda_device_id_without_cuda_names_device_id(device_id: object) -> None:
    model = NestedWrapped()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"device_id=.*CUDA is not available here"):
        FSDP(model, process_group=PG, device_id=device_id)
    assert _snapshot(model) == before


def test_state_dict_type_arguments_are_checked() -> None:
    model = FSDP(nn.Linear(2, 2), process_group=PG)
    with pytest.raises(ValueError, match=r"state_dict_type='full' .*must be a StateDictType member"):
        with FSDP.state_dict_type(model, "full"):
            pass
    with pytest.raises(RuntimeError, match=r"state_dict_config of type FullStateDictConfig but got dict"):
        with FSDP.state_dict_type(model, engine.StateDictType.FULL_STATE_DICT, {}):
            pass


def test_torch_objects_are_recognised_by_name_and_module() -> None:
    assert is_torch_fsdp_object(torch_fsdp.ShardingStrategy.FULL_SHARD, "ShardingStrategy")
    assert not is_torch_fsdp_object(engine.ShardingStrategy.FULL_SHARD, "ShardingStrategy")
    assert not is_torch_fsdp_object(torch_fsdp.CPUOffload(), "MixedPrecision")


@pytest.mark.parametrize("strategy", list(torch_fsdp.ShardingStrategy), ids=lambda s: s.name)
def test_torch_sharding_strategy_is_accepted(strategy: object) -> None:
    ours = engine.ShardingStrategy[strategy.name]
    pg = DummyProcessGroup(0, 2) if "HYBRID" not in strategy.name else (DummyProcessGroup(0, 2), DummyProcessGroup(0, 1))
    model = FSDP(nn.Linear(2, 2), process_group=pg, sharding_strategy=strategy)
    assert model.sharding_strategy is ours


def test_torch_configurations_are_accepted_as_equivalents() -> None:
    mp = torch_fsdp.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16,
        keep_low_precision_grads=True, cast_forward_inputs=True,
    )
    model = FSDP(
        nn.Linear(2, 2),
        process_group=DummyProcessGroup(0, 2),
        sharding_strategy=torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
        cpu_offload=torch_fsdp.CPUOffload(offload_params=True),
        backward_prefetch=torch_fsdp.BackwardPrefetch.BACKWARD_POST,
        mixed_precision=mp,
    )
    assert model.sharding_strategy is engine.ShardingStrategy.SHARD_GRAD_OP
    assert model.cpu_offload == engine.CPUOffload(offload_params=True)
    assert model.backward_prefetch is engine.BackwardPrefetch.BACKWARD_POST
    assert model.mixed_precision == engine.MixedPrecision(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.bfloat16,
        keep_low_precision_grads=True, cast_forward_inputs=True,
    )
    handle = model._unit.handle
    assert (handle.param_dtype, handle.reduce_dtype) == (torch.bfloat16, torch.float32)


def test_mixing_both_apis_computes_in_the_configured_dtype() -> None:
    # Our policy and strategy with torch's MixedPrecision and CPUOffload (forward only: the
    # process-group double cannot reduce gradients). On the CPU on any host: without device_id a
    # host with CUDA would compute on its current device, as torch FSDP1 does.
    model = FSDP(
        NestedWrapped(),
        process_group=PG,
        device_id=torch.device("cpu"),
        auto_wrap_policy=always_wrap_policy,
        sharding_strategy=engine.ShardingStrategy.FULL_SHARD,
        mixed_precision=torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16),
        cpu_offload=torch_fsdp.CPUOffload(offload_params=False),
    )
    out = model(*NestedWrapped.get_input(step=0, rank=0))
    assert out.dtype == torch.bfloat16
    assert len(FSDP.fsdp_modules(model)) == 7
    assert all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize(
    "state_dict_type, config",
    [
        (torch_fsdp.StateDictType.FULL_STATE_DICT, torch_fsdp.FullStateDictConfig(offload_to_cpu=True, rank0_only=True)),
        (torch_fsdp.StateDictType.SHARDED_STATE_DICT, torch_fsdp.ShardedStateDictConfig(offload_to_cpu=True)),
        (torch_fsdp.StateDictType.LOCAL_STATE_DICT, torch_fsdp.LocalStateDictConfig()),
    ],
    ids=lambda v: type(v).__name__,
)
def test_torch_state_dict_type_and_configs_are_accepted(state_dict_type: object, config: object) -> None:
    model = FSDP(nn.Linear(2, 2), process_group=PG)
    with FSDP.state_dict_type(model, state_dict_type, config):
        assert model._state_dict_type is engine.StateDictType[state_dict_type.name]
        ours = model._state_dict_config
        assert type(ours).__name__ == type(config).__name__ and type(ours).__module__.startswith("engine")
        assert ours.offload_to_cpu == config.offload_to_cpu
        if hasattr(config, "rank0_only"):
            assert ours.rank0_only == config.rank0_only
