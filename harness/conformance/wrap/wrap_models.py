"""Models and a recording wrapper shared by the wrap suites.

The models mirror the torch test's (``test_wrap.py``) in structure, kept small for a 2-core CPU tier; they
have no inputs or loss (nothing trains them: only which modules become units matters), but for
:class:`FourLinears`, which the main wrap API check trains: it is in the zoo (``wrap_four_linears``), so
the harness's local reference says what its parameters must be. The tied
transformer is the zoo's (``harness.cases.models.TransformerModel`` with its batch norm).
:class:`RecordingUnit` stands in for the real wrapper where only the wrapping structure matters:
it runs auto wrapping exactly as the runtime's constructor does and records what it was given.
"""

from __future__ import annotations

from typing import Any, ClassVar, Iterator

import pytest
import torch
import torch.nn as nn

from engine.wrap import auto_wrap
from harness.cases.model_protocol import ZooModel, batch_generator
from harness.cases.models import register_model

__all__ = [
    "BatchNormContainer",
    "BatchNormKinds",
    "FourLinears",
    "LoraAttention",
    "LoraDecoder",
    "LoraDecoderStack",
    "LoraMLP",
    "MarkedUnit",
    "Nested",
    "RecordingUnit",
    "nested_sequential",
    "recorded",
]


class RecordingUnit(nn.Module):
    """A wrapper double: ``RecordingUnit(module, **kwargs)`` auto-wraps like the runtime would.

    It carries no unit marker, so nested-wrapping detection must come from ``isinstance``.
    """

    #: every unit constructed, in construction order (reset by the ``recorded`` fixture).
    constructed: ClassVar[list["RecordingUnit"]] = []

    def __init__(
        self,
        module: nn.Module,
        *,
        auto_wrap_policy: Any = None,
        ignored_modules: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        ignored = set(ignored_modules or ())
        ignored_params = {p for m in ignored for p in m.parameters()}
        if auto_wrap_policy is not None:
            root_kwargs = {"auto_wrap_policy": auto_wrap_policy, **kwargs}
            auto_wrap(module, auto_wrap_policy, type(self), ignored, ignored_params, root_kwargs)
        self.module = module
        #: the constructor kwargs this unit received (what a real unit would be configured with).
        self.kwargs = kwargs
        type(self).constructed.append(self)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getitem__(self, idx: int) -> nn.Module:
        return self.module[idx]  # type: ignore[index]


@pytest.fixture(autouse=True)
def recorded() -> Iterator[list[RecordingUnit]]:
    """The units :class:`RecordingUnit` constructs during the test, in construction order (autouse in
    every module that imports it: no test sees another's units)."""
    RecordingUnit.constructed = []
    yield RecordingUnit.constructed
    RecordingUnit.constructed = []


class MarkedUnit(nn.Module):
    """Another wrapper class, recognised as a unit only through the marker attribute."""

    _is_fsdp_unit = True

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module = module


def nested_sequential() -> nn.Sequential:
    """Two Linear(5, 5) then a Sequential of two more: 30 numel each, 120 in all."""
    return nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5), nn.Sequential(nn.Linear(5, 5), nn.Linear(5, 5)))


class BatchNormKinds(nn.Module):
    """A bias-free linear and one batch norm of each kind (1d, 2d, 3d, sync): no forward, structure only."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(10, 10, bias=False)
        self.bn1 = nn.BatchNorm1d(10)
        self.bn2 = nn.BatchNorm2d(10)
        self.bn3 = nn.BatchNorm3d(10)
        self.sync_bn = nn.SyncBatchNorm(10)


class BatchNormContainer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bn_container = BatchNormKinds()


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.nested_lin = nn.Linear(1, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.nested_lin(x)


class FourLinears(ZooModel):
    """The torch test's main-wrap-API model: three Linear(1, 1) and one nested in a submodule."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(1, 1, bias=False)
        self.lin2 = nn.Linear(1, 1, bias=False)
        self.lin3 = nn.Linear(1, 1, bias=False)
        self.lin4 = Nested()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin4(self.lin3(self.lin2(self.lin1(x))))

    def get_input(self, *, seed: int, step: int, rank: int) -> tuple[torch.Tensor, ...]:
        # The torch test feeds ones on every rank; different batches per rank also check the averaging.
        return (1.0 + torch.rand(4, 1, generator=batch_generator(seed, step, rank)),)

    def get_loss(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return output.mean()


#: its name in the zoo: the main wrap API check's case trains it.
FOUR_LINEARS = "wrap_four_linears"
register_model(FOUR_LINEARS, "the wrap suites' four 1x1 linears (the torch test's main wrap API model)",
               lambda seed, rank, world_size: FourLinears())


class LoraAttention(nn.Module):
    """Frozen projections with trainable low-rank adapters: a mixed unit if wrapped whole."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(32, 32, bias=False)
        self.lora_A = nn.Linear(32, 8, bias=False)
        self.lora_B = nn.Linear(8, 32, bias=False)
        self.k_proj = nn.Linear(32, 32, bias=False)
        self.v_proj = nn.Linear(32, 32, bias=False)
        self.o_proj = nn.Linear(32, 32, bias=False)
        for proj in (self.q_proj, self.k_proj, self.v_proj, self.o_proj):
            proj.weight.requires_grad_(False)


class LoraMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj1 = nn.Linear(32, 128, bias=False)
        self.proj2 = nn.Linear(128, 32, bias=False)
        self.proj1.weight.requires_grad_(False)
        self.proj2.weight.requires_grad_(False)


class LoraDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = LoraAttention()
        self.mlp = LoraMLP()
        self.inp_layernorm = nn.LayerNorm(32)
        self.post_attn_layernorm = nn.LayerNorm(32)
        for norm in (self.inp_layernorm, self.post_attn_layernorm):
            norm.requires_grad_(False)


class LoraDecoderStack(nn.Module):
    """A toy LoRA decoder stack: everything frozen but the adapters (the zoo's ``LoraModel`` trains;
    this one only has a structure to wrap)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(100, 32)
        self.layers = nn.ModuleList([LoraDecoder() for _ in range(4)])
        self.norm = nn.LayerNorm(32)
        self.embed_tokens.requires_grad_(False)
        self.norm.requires_grad_(False)

