"""The engine and ported suites' models, registered in the harness's zoo (``harness.cases.models``).

Each is a ``ZooModel``: its inputs come from ``get_input(seed=, step=, rank=)`` (on CPU; callers move
them with ``harness.cases.model_protocol.to_device``), its loss from ``get_loss(inputs, output)``, and its
units from ``wrap_units()`` (``harness.cases.model_protocol.wrap_bottom_up`` wraps them deepest first).
Unlike the harness's own models, each seeds the global RNG itself when built (the ported checks build
them directly, on any device), so every rank builds the same parameters, except the experts of
:class:`MixtureOfExperts`, which differ per rank by design and are never averaged. ``ENGINE_MODELS``
maps their zoo names to their classes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

from harness.cases.models import ZooModel, register_model
from harness.ranks.rank import new_singleton_groups

#: keeps the batches of different seeds apart; seed 0 gives the batches these suites always used.
_SEED_STRIDE = 1_000_003


def batch(seed: int, step: int, rank: int, shape: tuple[int, ...], vocab: int | None = None) -> Tensor:
    """Deterministic CPU input for ``(seed, step, rank)``: different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank + _SEED_STRIDE * seed)
    if vocab is not None:
        return torch.randint(0, vocab, shape, generator=g)
    return torch.randn(shape, generator=g)


def _init_device(device: torch.device | str) -> str:
    """Where a model of these checks draws its initial weights: the CPU's generator, wherever the model
    lives after (``meta`` stays meta). A CUDA generator draws other values from the same seed, and the
    torch tests' CUDA_AFTER twins (built on the CPU, moved after wrapping) must start from DDP's weights."""
    return "meta" if torch.device(device).type == "meta" else "cpu"


class NestedWrapped(ZooModel):
    """Linear -> (Linear -> ReLU -> Linear) -> Linear: a nested unit inside a unit inside the root.

    Units: ``block[0]``, ``block[2]``, ``block`` (which keeps nothing of its own) and ``out``; the root
    keeps ``inp``.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(0)
        init = _init_device(device)
        self.inp = nn.Linear(8, 12, device=init)
        self.block = nn.Sequential(nn.Linear(12, 16, device=init), nn.ReLU(), nn.Linear(16, 12, device=init))
        self.out = nn.Linear(12, 5, device=init)
        self.to(device)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(self.block(torch.relu(self.inp(x)))))

    def wrap_units(self) -> list[nn.Module]:
        return [self.block, self.block[0], self.block[2], self.out]

    @classmethod
    def get_input(cls, *, seed: int = 0, step: int, rank: int) -> tuple[Tensor, ...]:
        return (batch(seed, step, rank, (4, 8)),)

    @staticmethod
    def get_loss(inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        return (output**2).mean()


class NestedAlwaysWrapped(NestedWrapped):
    """The nested model with every submodule its own unit (what ``always_wrap_policy`` wraps: seven units
    with the root, the parameterless ReLU among them)."""

    def wrap_units(self) -> list[nn.Module]:
        return [m for m in self.modules() if m is not self]


class SharedTransformer(ZooModel):
    """Embedding -> 2 encoder layers -> output projection tied to the embedding.

    Each encoder layer is a unit; the root holds the tied embedding and projection.
    """

    wrap_classes = (nn.TransformerEncoderLayer,)
    vocab = 13
    d_model = 8

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(0)
        init = _init_device(device)
        self.embed = nn.Embedding(self.vocab, self.d_model, device=init)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                self.d_model, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True, device=init
            )
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(self.d_model, device=init)
        self.proj = nn.Linear(self.d_model, self.vocab, bias=False, device=init)
        self.proj.weight = self.embed.weight  # tied
        self.to(device)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.proj(self.norm(h))

    @classmethod
    def get_input(cls, *, seed: int = 0, step: int, rank: int) -> tuple[Tensor, ...]:
        return (batch(seed, step, rank, (3, 5), vocab=cls.vocab),)

    @staticmethod
    def get_loss(inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        return output.float().logsumexp(-1).mean()


class MixtureOfExperts(ZooModel):
    """Linear -> shared Linear -> expert Linear -> Linear; the expert differs per rank.

    The model declares how its gradients are reduced: the expert's parameters (its rank-local module,
    its parameters marked ``expert``) are local to each rank, every other gradient is averaged over
    the ranks. Wrapped, the expert is a unit over a one-rank group (so it is never averaged).
    """

    def __init__(self, rank: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(0)
        init = _init_device(device)
        self.inp = nn.Linear(6, 10, device=init)
        self.shared = nn.Linear(10, 9, device=init)
        torch.manual_seed(42 + rank)
        self.expert = nn.Linear(9, 10, device=init)
        for p in self.expert.parameters():
            p.expert = True  # type: ignore[attr-defined]
        torch.manual_seed(1)
        self.out = nn.Linear(10, 4, device=init)
        self.to(device)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(self.expert(torch.relu(self.shared(torch.relu(self.inp(x)))))))

    def wrap_units(self) -> list[nn.Module]:
        # The expert first: the order these suites always wrapped in (wrap_bottom_up keeps it per depth).
        return [self.expert, self.shared]

    def rank_local_modules(self) -> list[nn.Module]:
        return [self.expert]

    @classmethod
    def get_input(cls, *, seed: int = 0, step: int, rank: int) -> tuple[Tensor, ...]:
        return (batch(seed, step, rank, (4, 6)),)

    @staticmethod
    def get_loss(inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        return (output**2).mean()

    def reduce_reference_grads(self, group: dist.ProcessGroup | None = None) -> None:
        """What the wrapped model does to gradients, done by hand on the unwrapped model."""
        world = dist.get_world_size(group)
        local = {id(p) for m in self.rank_local_modules() for p in m.parameters()}
        with torch.no_grad():
            for p in self.parameters():
                if id(p) in local or p.grad is None:
                    continue
                p.grad.div_(world)
                dist.all_reduce(p.grad, group=group)


#: Their names in the zoo (registered below), for the cases that train them: a module that names one
#: imports it from here, which registers the models before a rank pool starts (the ranks import what
#: registered models: ``harness.cases.models.registering_modules``).
NESTED, ALWAYS_WRAP, TRANSFORMER, MOE = "engine_nested", "engine_always_wrap", "engine_transformer", "engine_moe"
#: these models by their names in the zoo.
ENGINE_MODELS: dict[str, type[ZooModel]] = {
    NESTED: NestedWrapped,
    ALWAYS_WRAP: NestedAlwaysWrapped,
    TRANSFORMER: SharedTransformer,
    MOE: MixtureOfExperts,
}

register_model(NESTED, "the engine suites' nested linears (units inside units)", NestedWrapped)
register_model(ALWAYS_WRAP, "the engine suites' nested linears, every submodule a unit", NestedAlwaysWrapped)
register_model(TRANSFORMER, "the engine suites' encoder, projection tied to the embedding", SharedTransformer)
register_model(MOE, "the engine suites' mixture of experts (rank-local expert)", lambda seed, rank, world_size: MixtureOfExperts(rank))


def singleton_groups() -> dist.ProcessGroup:
    """This rank's one-rank group (every rank creates every group, in the same order)."""
    return new_singleton_groups(dist.get_rank(), dist.get_world_size())
