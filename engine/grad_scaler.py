"""``ShardedGradScaler``: loss scaling whose inf/nan check covers every rank's gradient shard.

A plain :class:`torch.amp.GradScaler` looks only at the gradients it can see. With sharded
gradients each rank holds a different part, so one rank may find an inf the others do not; if
only that rank skipped ``optimizer.step()`` the replicas would diverge. Here the per-device
``found_inf`` flags are all-reduced (max) over the process group before the step decision, so
every rank skips together and backs the scale off together.

Also unlike the base class: gradients may live on the CPU (CPU offload) next to a loss on the
GPU, may be float16 (``keep_low_precision_grads``) or bfloat16, and :meth:`scale` keeps the
outputs' dtype (a float16 loss stays float16, as FSDP1's scaler does).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_leaves, tree_map_only

__all__ = ["ShardedGradScaler"]


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def scale_device(device: str) -> torch.device:
    """The device the scale lives on, and the found-inf flags are combined on (torch's rule: the
    scaler's own device; an accelerator without an index is its current device)."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def unscale_and_check_(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """Multiply ``grads`` (one device, one dtype) by ``inv_scale`` in place; set ``found_inf`` to 1
    if any element is inf or nan (the fused op of the base scaler, which has CPU kernels)."""
    if grads and grads[0].dtype == torch.bfloat16 and grads[0].device.type == "cuda":
        # The fused CUDA kernel has no bfloat16 instantiation (torch 2.11-2.13); check and
        # unscale with plain ops, which keep the same semantics (inf/nan flag, in-place multiply).
        for g in grads:
            found_inf.copy_(torch.maximum(found_inf, (~torch.isfinite(g)).any().to(found_inf.dtype)))
            g.mul_(inv_scale.to(g.dtype))
        return
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)


class ShardedGradScaler(torch.amp.GradScaler):
    """A :class:`torch.amp.GradScaler` for sharded gradients (FSDP1's ``ShardedGradScaler`` API).

    ``device`` is where the scale lives (default: ``"cuda"`` when available, else ``"cpu"``);
    ``process_group`` is the group whose ranks must agree to skip a step (default: the world).
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(
            device or _default_device(),
            init_scale=init_scale,
            backoff_factor=backoff_factor,
            growth_factor=growth_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        #: the ranks whose inf/nan findings are combined (None: the default group).
        self.process_group = process_group

    def scale(self, outputs: Tensor | Iterable[Tensor]) -> Any:  # type: ignore[override]
        """``outputs`` (a tensor, or nested lists/tuples of tensors) times the scale, each tensor
        keeping its device and dtype."""
        if not self._enabled:
            return outputs
        leaves = [outputs] if isinstance(outputs, Tensor) else tree_leaves(outputs)
        tensors = [t for t in leaves if isinstance(t, Tensor)]
        if not tensors:
            raise ValueError(
                f"ShardedGradScaler.scale: outputs must be a Tensor or lists/tuples of Tensors, got {type(outputs).__name__}"
            )
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(tensors[0].device)
        scale = self._scale
        assert scale is not None

        def apply(t: Tensor) -> Tensor:
            # The scale is a one-element float32 tensor: the plain product would be promoted. A copy
            # to CPU must be blocking: the CPU product would read it before a non-blocking copy lands.
            return (t * scale.to(device=t.device, non_blocking=t.device.type != "cpu")).to(t.dtype)

        return tree_map_only(Tensor, apply, outputs)

    def _unscale_grads_(  # type: ignore[override]
        self, optimizer: torch.optim.Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        """Unscale every gradient of ``optimizer``, grouped by device and dtype; float16 gradients
        are allowed (sharded engines keep them with ``keep_low_precision_grads``)."""
        groups: dict[torch.device, dict[torch.dtype, list[Tensor]]] = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if grad.is_sparse:
                        if grad.dtype is torch.float16:
                            # Coalescing sums duplicates; doing it in float16 could overflow.
                            param.grad = grad.float().coalesce().half()
                            grad = param.grad
                        grad = grad._values()
                    groups[grad.device][grad.dtype].append(grad)
            found: dict[torch.device, Tensor] = {}
            for device, by_dtype in groups.items():
                found[device] = found_inf.to(device, copy=True)
                inv = inv_scale.to(device)
                for grads in by_dtype.values():
                    unscale_and_check_(grads, found[device], inv)
        if not found:
            # No gradient at all: still a flag, on the scale's device, for the step decision.
            found[found_inf.device] = found_inf.clone()
        return found

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale ``optimizer``'s gradients, then make every rank see every rank's inf/nan."""
        if not self._enabled:
            return
        super().unscale_(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._agree(state["found_inf_per_device"])

    def _agree(self, found_per_device: dict[torch.device, Tensor]) -> dict[torch.device, Tensor]:
        """One flag for all devices and ranks: the maximum of every flag, placed on each device.

        Every rank must issue the same collectives, but ranks may hold gradients on different
        devices (a rank whose shard is empty has none), so the flags are combined locally first
        and exactly one all-reduce runs, on the scaler's device (as torch's scaler reduces there).
        """
        comm_device = scale_device(self._device)
        combined = torch.zeros((), dtype=torch.float32, device=comm_device)
        for flag in found_per_device.values():
            combined = torch.maximum(combined, flag.to(comm_device, torch.float32).reshape(()))
        dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=self.process_group)
        for device, flag in found_per_device.items():
            flag.copy_(combined.to(device).reshape(flag.shape))
        return found_per_device
