"""The optimizer of a case (``CaseConfig.optimizer``), built the same way for every side.

Engines, DDP and the local reference all train with the torch optimizer class and hyperparameters
``build_optimizer`` gives, so a difference in the trajectory is the engine's, not the optimizer's.
``adamw_groups`` and ``two_optimizers`` need the parameters' names (canonical, as the unwrapped model
has them): ``build_optimizers`` takes ``(name, parameter)`` pairs, and ``freeze`` marks the parameters a
case trains frozen before any side wraps its model. ``init_optimizer_state`` materialises an
optimizer's state without changing any parameter: a fresh optimizer has no state, and a checkpoint's optimizer state is loaded in place into a template of the
right structure (``harness.engines.checkpoint``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn as nn

from harness.cases.case import CaseConfig

__all__ = [
    "ADAMW_BETAS",
    "ADAMW_EPS",
    "ADAMW_WEIGHT_DECAY",
    "NAMED_OPTIMIZERS",
    "adamw",
    "build_optimizer",
    "build_optimizers",
    "freeze",
    "frozen_names",
    "init_optimizer_state",
    "sgd",
    "zero_grads",
]

#: The optimizers that split parameters by name (groups, or two optimizers): FSDP1-API engines must
#: expose the original parameters for them.
NAMED_OPTIMIZERS = ("adamw_groups", "two_optimizers")
#: ``adamw_groups``: the no-decay group's learning rate, as a fraction of ``CaseConfig.lr``.
NO_DECAY_LR_FACTOR = 0.5
#: ``two_optimizers``: the learning rates of torch's test_multiple_optimizers (Adam, AdamW).
TWO_OPTIMIZER_LRS = (5e-3, 1e-2)

#: AdamW's hyperparameters besides ``CaseConfig.lr``: torch's defaults, with a weight decay that is
#: not zero so that the decoupled decay is part of what is compared.
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8
ADAMW_WEIGHT_DECAY = 0.01


def frozen_names(named: Sequence[tuple[str, nn.Parameter]], rank_local: Iterable[str] = ()) -> set[str]:
    """The parameters ``adamw_groups`` freezes: the first one-dimensional shared parameter (a bias or a
    norm's weight), so a unit holds frozen and trainable parameters side by side."""
    local = set(rank_local)
    for name, p in named:
        if p.dim() == 1 and name not in local:
            return {name}
    return set()


def freeze(case: CaseConfig, model: nn.Module, rank_local: Iterable[str] = ()) -> None:
    """Mark the parameters ``case`` trains frozen (before wrapping: every side freezes the same ones)."""
    if case.optimizer != "adamw_groups":
        return
    frozen = frozen_names(list(model.named_parameters()), rank_local)
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


def sgd(params: Iterable[nn.Parameter], lr: float, momentum: float) -> torch.optim.SGD:
    """SGD with momentum, the parity optimizer (Adam's normalization would hide a gradient scaled by a
    constant): every side that trains with SGD builds it here."""
    return torch.optim.SGD(list(params), lr=lr, momentum=momentum)


def adamw(params: Iterable[nn.Parameter] | list[dict], lr: float) -> torch.optim.AdamW:
    """AdamW at ``lr`` with the harness's betas, eps and (non-zero) weight decay."""
    return torch.optim.AdamW(list(params), lr=lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=ADAMW_WEIGHT_DECAY)


def build_optimizers(
    case: CaseConfig, named: Iterable[tuple[str, nn.Parameter]], dims: Mapping[str, int] | None = None
) -> list[torch.optim.Optimizer]:
    """The case's optimizers over the trainable ``(canonical name, parameter)`` pairs; ``dims``: each name's
    dimensions in the unwrapped model (FSDP1's original parameters are flattened shards), default the
    parameters' own.

    ``sgd``/``adamw``: one over every parameter. ``adamw_groups``: one AdamW whose decay group (the
    parameters of two or more dimensions) trains at ``case.lr`` and whose no-decay group (biases, norms)
    at ``NO_DECAY_LR_FACTOR * case.lr`` without weight decay. ``two_optimizers``: Adam over the first half
    of the names in sorted order, AdamW over the rest (``TWO_OPTIMIZER_LRS``); the names' order, not
    the wrapper's, decides, so every side splits alike.
    """
    pairs = [(name, p) for name, p in named if p.requires_grad]
    if case.optimizer in ("sgd", "adamw"):
        return [build_optimizer(case, [p for _, p in pairs])]
    if case.optimizer == "adamw_groups":
        decayed = {name for name, p in pairs if (dims[name] if dims is not None else p.dim()) >= 2}
        decay = [p for name, p in pairs if name in decayed]
        no_decay = [p for name, p in pairs if name not in decayed]
        return [adamw([
            {"params": decay},
            {"params": no_decay, "lr": case.lr * NO_DECAY_LR_FACTOR, "weight_decay": 0.0},
        ], case.lr)]
    if case.optimizer == "two_optimizers":
        names = sorted({name for name, _ in pairs})
        first = set(names[: len(names) // 2])
        adam_lr, adamw_lr = TWO_OPTIMIZER_LRS
        return [
            torch.optim.Adam([p for n, p in pairs if n in first], lr=adam_lr, betas=ADAMW_BETAS, eps=ADAMW_EPS),
            adamw([p for n, p in pairs if n not in first], adamw_lr),
        ]
    raise ValueError(f"CaseConfig.optimizer={case.optimizer!r} is not one of sgd, adamw, adamw_groups, two_optimizers")


def adam_lr(case: CaseConfig) -> float | None:
    """The largest learning rate an Adam-family optimizer of the case trains at; None under SGD."""
    if case.optimizer in ("adamw", "adamw_groups"):
        return case.lr
    if case.optimizer == "two_optimizers":
        return max(TWO_OPTIMIZER_LRS)
    return None


def zero_grads(case: CaseConfig, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Clear the gradients after a step: ``two_optimizers``' second keeps zero-filled gradients
    (``set_to_none=False``), which Adam-family optimizers step unlike missing ones."""
    for i, optimizer in enumerate(optimizers):
        optimizer.zero_grad(set_to_none=not (case.optimizer == "two_optimizers" and i == 1))


def build_optimizer(case: CaseConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The case's one optimizer over ``params``: SGD with ``case.momentum`` or AdamW, at ``case.lr``
    (the optimizers that split parameters by name are ``build_optimizers``')."""
    params = list(params)
    if case.optimizer == "sgd":
        return sgd(params, case.lr, case.momentum)
    if case.optimizer == "adamw":
        return adamw(params, case.lr)
    raise ValueError(
        f"CaseConfig.optimizer={case.optimizer!r}: build_optimizer builds 'sgd' or 'adamw'; the optimizers that "
        "split parameters by name need their names (build_optimizers)"
    )


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter its optimizer state (momentum buffer; step and both moments) without
    moving any parameter: one step at ``lr=0`` and ``weight_decay=0`` over zero gradients.

    Loading state in place (DCP) needs a template holding every tensor; the values are overwritten.
    Parameters that already have a gradient are refused: that step would consume it.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.grad is not None for p in params):
        raise ValueError("init_optimizer_state: a parameter already has a gradient; call it on a fresh optimizer")
    saved = [(group["lr"], group.get("weight_decay", 0.0)) for group in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    try:
        for group in optimizer.param_groups:
            group["lr"] = 0.0
            if "weight_decay" in group:
                group["weight_decay"] = 0.0
        optimizer.step()
    finally:
        for group, (lr, decay) in zip(optimizer.param_groups, saved):
            group["lr"] = lr
            if "weight_decay" in group:
                group["weight_decay"] = decay
        for p in params:
            p.grad = None
