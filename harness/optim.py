"""The optimizer of a case (``CaseConfig.optimizer``), built the same way for every side.

Engines, DDP and the local reference all train with the torch optimizer class and hyperparameters
``build_optimizer`` gives, so a difference in the trajectory is the engine's, not the optimizer's.
``init_optimizer_state`` materialises an optimizer's state without changing any parameter: a fresh
optimizer has no state, and a checkpoint's optimizer state is loaded in place into a template of the
right structure (``harness.checkpoint``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from harness.case import CaseConfig

__all__ = ["ADAMW_BETAS", "ADAMW_EPS", "ADAMW_WEIGHT_DECAY", "build_optimizer", "init_optimizer_state"]

#: AdamW's hyperparameters besides ``CaseConfig.lr``: torch's defaults, with a weight decay that is
#: not zero so that the decoupled decay is part of what is compared.
ADAMW_BETAS = (0.9, 0.999)
ADAMW_EPS = 1e-8
ADAMW_WEIGHT_DECAY = 0.01


def build_optimizer(case: CaseConfig, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The case's optimizer over ``params``: SGD with ``case.momentum`` or AdamW, at ``case.lr``."""
    params = list(params)
    if case.optimizer == "sgd":
        return torch.optim.SGD(params, lr=case.lr, momentum=case.momentum)
    if case.optimizer == "adamw":
        return torch.optim.AdamW(
            params, lr=case.lr, betas=ADAMW_BETAS, eps=ADAMW_EPS, weight_decay=ADAMW_WEIGHT_DECAY
        )
    raise ValueError(f"CaseConfig.optimizer={case.optimizer!r} is not 'sgd' or 'adamw'")


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
