"""Small models for the engine suites, each with its wrapping and its reference reduction.

Every model builds identically on every rank (seeded), except the experts of
:class:`MixtureOfExperts`, which differ per rank by design and are never averaged.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch import Tensor

Wrapper = Callable[..., nn.Module]


def batch(step: int, rank: int, shape: tuple[int, ...], device: torch.device, vocab: int | None = None) -> Tensor:
    """Deterministic input for ``(step, rank)``: different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    if vocab is not None:
        return torch.randint(0, vocab, shape, generator=g).to(device)
    return torch.randn(shape, generator=g).to(device)


class NestedWrapped(nn.Module):
    """Linear -> (Linear -> ReLU -> Linear) -> Linear: a nested unit inside a unit inside the root."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 12, device=device)
        self.block = nn.Sequential(nn.Linear(12, 16, device=device), nn.ReLU(), nn.Linear(16, 12, device=device))
        self.out = nn.Linear(12, 5, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(self.block(torch.relu(self.inp(x)))))

    @staticmethod
    def input(step: int, rank: int, device: torch.device) -> tuple[Tensor, ...]:
        return (batch(step, rank, (4, 8), device),)

    @staticmethod
    def loss(out: Tensor) -> Tensor:
        return (out**2).mean()

    def wrap(self, fsdp: Wrapper, **kwargs: Any) -> nn.Module:
        """Units: block[0], block[2], block (the rest: none), out, and the root (inp)."""
        self.block[0] = fsdp(self.block[0], **kwargs)
        self.block[2] = fsdp(self.block[2], **kwargs)
        self.block = fsdp(self.block, **kwargs)
        self.out = fsdp(self.out, **kwargs)
        return fsdp(self, **kwargs)


class SharedTransformer(nn.Module):
    """Embedding -> 2 encoder layers -> output projection tied to the embedding."""

    vocab = 13
    d_model = 8

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(self.vocab, self.d_model, device=device)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(
                self.d_model, nhead=2, dim_feedforward=16, dropout=0.0, batch_first=True, device=device
            )
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(self.d_model, device=device)
        self.proj = nn.Linear(self.d_model, self.vocab, bias=False, device=device)
        self.proj.weight = self.embed.weight  # tied

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.proj(self.norm(h))

    @classmethod
    def input(cls, step: int, rank: int, device: torch.device) -> tuple[Tensor, ...]:
        return (batch(step, rank, (3, 5), device, vocab=cls.vocab),)

    @staticmethod
    def loss(out: Tensor) -> Tensor:
        return out.float().logsumexp(-1).mean()

    def wrap(self, fsdp: Wrapper, **kwargs: Any) -> nn.Module:
        """Each encoder layer is a unit; the root holds the tied embedding/projection."""
        for i in range(len(self.layers)):
            self.layers[i] = fsdp(self.layers[i], **kwargs)
        return fsdp(self, **kwargs)


class MixtureOfExperts(nn.Module):
    """Linear -> shared Linear -> expert Linear -> Linear; the expert differs per rank.

    The model declares how its gradients are reduced: the expert's parameters (marked
    ``expert``) are local to each rank, every other gradient is averaged over the ranks.
    Wrapped, the expert is a unit over a one-rank group (so it is never averaged).
    """

    def __init__(self, rank: int, device: torch.device | str = "cpu") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(6, 10, device=device)
        self.shared = nn.Linear(10, 9, device=device)
        torch.manual_seed(42 + rank)
        self.expert = nn.Linear(9, 10, device=device)
        for p in self.expert.parameters():
            p.expert = True  # type: ignore[attr-defined]
        torch.manual_seed(1)
        self.out = nn.Linear(10, 4, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.relu(self.expert(torch.relu(self.shared(torch.relu(self.inp(x)))))))

    @staticmethod
    def input(step: int, rank: int, device: torch.device) -> tuple[Tensor, ...]:
        return (batch(step, rank, (4, 6), device),)

    @staticmethod
    def loss(out: Tensor) -> Tensor:
        return (out**2).mean()

    def wrap(self, fsdp: Wrapper, expert_group: dist.ProcessGroup, **kwargs: Any) -> nn.Module:
        self.expert = fsdp(self.expert, process_group=expert_group, **kwargs)
        self.shared = fsdp(self.shared, **kwargs)
        return fsdp(self, **kwargs)

    def reduce_reference_grads(self, group: dist.ProcessGroup | None = None) -> None:
        """What the wrapped model does to gradients, done by hand on the unwrapped model."""
        world = dist.get_world_size(group)
        with torch.no_grad():
            for p in self.parameters():
                if getattr(p, "expert", False) or p.grad is None:
                    continue
                p.grad.div_(world)
                dist.all_reduce(p.grad, group=group)


def singleton_groups() -> dist.ProcessGroup:
    """This rank's one-rank group (every rank creates every group, in the same order)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]
    return groups[dist.get_rank()]
