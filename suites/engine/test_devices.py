"""The engine's devices, as torch FSDP1 decides them: the compute device from ``device_id``, the
parameters and the current accelerator device (never from the communication backend), where meta
states are materialized, the node size of the default hybrid groups, the device the gradient
scaler combines its flags on.

The rules are pure functions (:mod:`engine.config`), checked here over plain devices; the wrappers of
both FSDP1-API engines (``fsdp_api``) are checked on a one-rank process-group double: on the CPU here,
on the current CUDA device where there is one (``gpu``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from engine.config import choose_compute_device, hybrid_node_size, materialization_device
from engine.grad_scaler import scale_device
from harness.conformance.flat_handles import DummyProcessGroup
from harness.conformance.fsdp1_checks import FSDPApi, load_api

CPU = torch.device("cpu")
CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
META = torch.device("meta")
PG = DummyProcessGroup(rank=0, size=1)


@pytest.mark.parametrize(
    "device_id, params, current, expected",
    [
        # device_id wins; CPU parameters were moved to it before the rule runs.
        (CUDA1, [CUDA1], CUDA0, CUDA1),
        (CPU, [CPU], CUDA0, CPU),
        # A module already on an accelerator computes there.
        (None, [CUDA1, CUDA1], CUDA0, CUDA1),
        # A CPU module with no device_id computes on the current accelerator device, whatever the
        # backend (a gloo group included): torch FSDP1's rule.
        (None, [CPU], CUDA1, CUDA1),
        (None, [], CUDA1, CUDA1),
        # Without an accelerator: the CPU (torch FSDP1 refuses; ours computes there).
        (None, [CPU], None, CPU),
        (None, [], None, CPU),
    ],
)
def test_compute_device_rule(
    device_id: torch.device | None, params: list[torch.device], current: torch.device | None, expected: torch.device
) -> None:
    assert choose_compute_device(device_id, params, current) == expected


@pytest.mark.parametrize("device_id, params", [(CPU, [CUDA0]), (CUDA0, [CUDA1])])
def test_parameters_off_device_id_are_refused(device_id: torch.device, params: list[torch.device]) -> None:
    with pytest.raises(ValueError, match=rf"parameters are on {params[0]} but device_id={device_id}"):
        choose_compute_device(device_id, params, CUDA0)


@pytest.mark.parametrize(
    "device_id, current, expected", [(CUDA1, CUDA0, CUDA1), (CPU, CUDA0, CPU), (None, CUDA1, CUDA1), (None, None, CPU)]
)
def test_meta_states_materialize_on_device_id_else_the_current_device(
    device_id: torch.device | None, current: torch.device | None, expected: torch.device
) -> None:
    assert materialization_device(device_id, current) == expected


@pytest.mark.parametrize(
    "world, local_world_size, devices, expected",
    [
        (8, None, 8, 8),  # one rank per GPU: the device count
        (4, "2", 1, 2),  # ranks sharing one GPU: the launcher's count
        (4, "4", 0, 4),  # CPU ranks
        (4, "", 2, 2),  # unset
    ],
)
def test_hybrid_node_size(world: int, local_world_size: str | None, devices: int, expected: int) -> None:
    assert hybrid_node_size(world, local_world_size, devices) == expected


@pytest.mark.parametrize(
    "world, local_world_size, devices, message",
    [
        (4, None, 0, r"world_size=4, 0 CUDA devices on this node\): set LOCAL_WORLD_SIZE"),
        (4, "3", 1, r"world_size=4, LOCAL_WORLD_SIZE=3\)"),
        (4, "two", 1, r"LOCAL_WORLD_SIZE='two' must be the number of ranks"),
    ],
)
def test_hybrid_node_size_errors_name_the_setting(world: int, local_world_size: str | None, devices: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        hybrid_node_size(world, local_world_size, devices)


def test_scaler_combines_flags_on_its_own_device() -> None:
    assert scale_device("cpu") == CPU
    if torch.cuda.is_available():
        assert scale_device("cuda") == torch.device("cuda", torch.cuda.current_device())


# ------------------------------------------------------------------------------- both engines
@pytest.fixture(scope="module")
def api(fsdp_api: str) -> FSDPApi:
    return load_api(fsdp_api)


def _compute_device(model: nn.Module) -> torch.device:
    return torch.device(model.compute_device)


def test_cpu_module_with_device_id_cpu_computes_on_the_cpu(api: FSDPApi) -> None:
    model = api.FSDP(nn.Linear(3, 3), process_group=PG, device_id=CPU)
    assert _compute_device(model) == CPU
    assert all(p.device == CPU for p in model.parameters())
    assert model(torch.randn(2, 3)).device == CPU


def test_meta_module_with_device_id_cpu_materializes_on_the_cpu(api: FSDPApi) -> None:
    with torch.device("meta"):
        module = nn.Linear(3, 3)
    model = api.FSDP(module, process_group=PG, device_id=CPU)
    assert _compute_device(model) == CPU
    assert all(p.device == CPU for p in model.parameters())


@pytest.mark.gpu
@pytest.mark.parametrize("on_meta", [False, True], ids=["cpu_module", "meta_module"])
def test_module_without_device_id_computes_on_the_current_cuda_device(api: FSDPApi, on_meta: bool) -> None:
    """Whatever the group's backend (here a double with none): the current CUDA device."""
    current = torch.device("cuda", torch.cuda.current_device())
    kwargs: dict[str, Any] = {"process_group": PG}
    if on_meta:
        with torch.device("meta"):
            module = nn.Linear(3, 3)
        model = api.FSDP(module, **kwargs)
        assert all(p.device == current for p in model.parameters())
    else:
        # The parameters stay on the CPU: torch FSDP1 then refuses to train ("move the module to cuda:0
        # before training"), so only the device it decides is compared here.
        model = api.FSDP(nn.Linear(3, 3), **kwargs)
        assert _compute_device(model) == current
        return
    assert _compute_device(model) == current
    assert model(torch.randn(2, 3, device=current)).device == current


def test_assert_state_takes_torch_fsdp1_training_states(api: FSDPApi) -> None:
    """torch's own test machinery calls the private ``_assert_state`` with torch's enum (common_fsdp)."""
    from torch.distributed.fsdp._common_utils import TrainingState as TorchState

    model = api.FSDP(nn.Linear(3, 3), process_group=PG, device_id=CPU)
    model._assert_state(TorchState.IDLE)
    model._assert_state([TorchState.IDLE, TorchState.FORWARD_BACKWARD])
    with pytest.raises(ValueError, match="IDLE"):
        model._assert_state(TorchState.FORWARD_BACKWARD)
