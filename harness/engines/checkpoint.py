"""Saving an engine's model and optimizer state mid-run and resuming from it (``CaseConfig.checkpoint``).

Each engine family is driven through its own public checkpoint API, as a user would:

- FSDP1-API engines (``builtin``, ``torch-fsdp``): ``FSDP.state_dict_type`` with ``FULL_STATE_DICT``
  (every rank gathers the full dict; rank 0 writes one ``torch.save`` file every rank reads back),
  ``SHARDED_STATE_DICT`` (``torch.distributed.checkpoint``, DCP) or ``LOCAL_STATE_DICT`` (the flat
  shards, through DCP); the optimizer through ``FSDP.optim_state_dict`` and
  ``FSDP.optim_state_dict_to_load`` (full and sharded, keyed by parameter name), or for ``local`` the
  optimizer's own ``state_dict()`` per rank (it holds the flat shards' state, which only the same
  engine at the same world size can take back).
- FSDP2 (``torch-fsdp2``): ``torch.distributed.checkpoint.state_dict`` (``get_model_state_dict`` and
  ``get_optimizer_state_dict`` in their sharded form; a full checkpoint is gathered from it and split
  back with plain collectives, ``harness.engines.dtensors``, since the helpers' own full form crashes on gloo
  with CUDA tensors) with DCP for the sharded files; it has no local type.
- a plain ``nn.Module`` (the 1-rank end of a reshard): the same DCP helpers, loading without a
  process group.

Full and sharded checkpoints name parameters by their clean names in both families, so one engine
can resume another's (cross-engine resume). Sharded loads fill a template in place: the fresh
optimizer's state is first materialised (``harness.engines.optim.init_optimizer_state``).

Faults for proving the resume check can fail (``extras=(("fault", name),)``): ``drop_optimizer_state``
throws the optimizer's state away once loaded; ``swap_optimizer_state`` hands two
parameters of one shape each other's optimizer state; ``corrupt_checkpoint_rank1`` overwrites rank 1's file
before a full or local load (the load error must reach every rank, with no rank left in a collective:
``agree_loaded``).
"""

from __future__ import annotations

import contextlib
import importlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.engines.adapters import EngineAdapter, FSDP1Adapter
from harness.engines.dtensors import distribute, full_tensor
from harness.engines.fsdp2_adapter import FSDP2Adapter
from harness.engines.optim import init_optimizer_state
from harness.engines.owned_step import NEUTRAL_FULL_FILE, owned_checkpoint_reason
from harness.ranks.rank import RankContext

__all__ = [
    "CHECKPOINT_FAULTS",
    "CheckpointLoadError",
    "agree_loaded",
    "engine_family",
    "load_checkpoint",
    "load_plain",
    "save_checkpoint",
    "shared_tempdir",
    "unsupported_checkpoint",
]

#: faults planted in the load path (see the module docstring).
CHECKPOINT_FAULTS = ("drop_optimizer_state", "swap_optimizer_state", "corrupt_checkpoint_rank1")


class CheckpointLoadError(RuntimeError):
    """A checkpoint some rank could not read: raised on every rank alike (``agree_loaded``)."""


def agree_loaded(error: BaseException | None, ctx: RankContext) -> None:
    """Collective: every rank says whether it read its part of the checkpoint; where one could not, every
    rank raises ``CheckpointLoadError`` naming each failure, so none waits in a collective the failed rank
    never joins (the error is recorded on every rank, and ``shared_tempdir`` still removes the files)."""
    said: list[Any] = [None] * dist.get_world_size(ctx.world_group())
    dist.all_gather_object(said, f"{type(error).__name__}: {error}" if error is not None else None, group=ctx.world_group())
    failed = [f"rank {rank}: {text}" for rank, text in enumerate(said) if text is not None]
    if failed:
        raise CheckpointLoadError(f"the checkpoint could not be loaded ({'; '.join(failed)})") from error

_FULL_FILE = NEUTRAL_FULL_FILE
_DCP_DIR = "dcp"


@contextlib.contextmanager
def shared_tempdir(ctx: RankContext) -> Iterator[Path]:
    """A fresh directory every rank of ``ctx`` sees under the same path (rank 0 creates it and sends
    its name), removed by rank 0 once every rank is done with it."""
    group = ctx.world_group()
    names: list[Any] = [tempfile.mkdtemp(prefix="fsdp-parity-ckpt-") if ctx.rank == 0 else None]
    dist.broadcast_object_list(names, src=dist.get_global_rank(group, 0), group=group)
    path = Path(names[0])
    try:
        yield path
    finally:
        dist.barrier(group=group)
        if ctx.rank == 0:
            shutil.rmtree(path, ignore_errors=True)


def engine_family(adapter: EngineAdapter) -> str:
    """``fsdp1`` (state_dict_type API), ``fsdp2`` (DCP state-dict helpers), ``owned`` (the engine's own
    hooks, ``EngineAdapter.checkpoint_kinds``), or ``none`` (no checkpoint path: unsupported)."""
    if adapter.checkpoint_kinds() is not None:
        return "owned"
    if isinstance(adapter, FSDP1Adapter):
        return "fsdp1"
    if isinstance(adapter, FSDP2Adapter):
        return "fsdp2"
    return "none"


def unsupported_checkpoint(saver: EngineAdapter, loader: EngineAdapter, kind: str, use_orig_params: bool) -> str | None:
    """Why ``loader`` cannot resume ``saver``'s checkpoint of type ``kind`` (one line), or None."""
    families = {engine_family(saver), engine_family(loader)}
    for adapter in (saver, loader):
        if engine_family(adapter) == "none":
            return (f"{adapter.name}: its adapter ({type(adapter).__name__}) declares no checkpoint path; an engine "
                    "that owns its step declares checkpoint_kinds() and saves through OwnedStep.save/load")
    if "owned" in families:
        return owned_checkpoint_reason(saver.name, saver.checkpoint_kinds(), loader.name, loader.checkpoint_kinds(), kind)
    if kind == "local" and use_orig_params and "torch-fsdp" in (saver.name, loader.name):
        return ("torch-fsdp: a LOCAL_STATE_DICT with use_orig_params=True holds the flat parameters and the "
                "original parameters' views, and its own strict load_state_dict refuses the flat parameters as "
                "unexpected keys (pytorch/pytorch#102667)")
    if kind == "local" and "fsdp2" in families:
        return "torch-fsdp2 has no LOCAL state dict (no flat parameters whose shards it could save)"
    if kind == "local" and saver.name != loader.name:
        return (f"a LOCAL state dict holds {saver.name}'s own flat shards; {loader.name} need not lay its flat "
                "parameters out the same way")
    return None


# ---------------------------------------------------------------------------------------------------
# FSDP1 API


def _fsdp1_api(adapter: FSDP1Adapter) -> Any:
    module = importlib.import_module(adapter.module_name)
    missing = [n for n in ("StateDictType", "FullStateDictConfig", "FullOptimStateDictConfig",
                           "ShardedStateDictConfig", "ShardedOptimStateDictConfig") if not hasattr(module, n)]
    if missing:
        raise AttributeError(
            f"engine {adapter.name!r} ({adapter.module_name}) does not export {missing}: it cannot save or load "
            "checkpoints through torch FSDP1's state_dict_type API"
        )
    return module


def _on_accelerator(module: nn.Module) -> bool:
    return any(p.device.type != "cpu" for p in module.parameters())


@contextlib.contextmanager
def _fsdp1_type(adapter: FSDP1Adapter, module: nn.Module, kind: str) -> Iterator[Any]:
    api = _fsdp1_api(adapter)
    fsdp = api.FullyShardedDataParallel
    if kind == "full":
        # Offloading to CPU what is on CPU already frees the gathered tensors torch FSDP1 still reads.
        offload = _on_accelerator(module)
        ctx = fsdp.state_dict_type(
            module, api.StateDictType.FULL_STATE_DICT,
            api.FullStateDictConfig(offload_to_cpu=offload, rank0_only=False),
            api.FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=False),
        )
    elif kind == "sharded":
        ctx = fsdp.state_dict_type(
            module, api.StateDictType.SHARDED_STATE_DICT, api.ShardedStateDictConfig(), api.ShardedOptimStateDictConfig()
        )
    elif kind == "local":
        ctx = fsdp.state_dict_type(module, api.StateDictType.LOCAL_STATE_DICT)
    else:
        raise ValueError(f"checkpoint kind={kind!r} is not 'full', 'sharded' or 'local'")
    with ctx:
        yield fsdp


def _fsdp1_state(
    adapter: FSDP1Adapter, module: nn.Module, optimizer: torch.optim.Optimizer, kind: str, group: Any
) -> dict[str, Any]:
    with _fsdp1_type(adapter, module, kind) as fsdp:
        model_sd = module.state_dict()
        # ``group``: the optimizer helpers' own collectives default to the whole world.
        optim_sd = optimizer.state_dict() if kind == "local" else fsdp.optim_state_dict(module, optimizer, group=group)
    return {"model": model_sd, "optim": optim_sd}


def _local_tensor(value: Any) -> Any:
    """This rank's tensor of a LOCAL state-dict value: a ShardedTensor's one local shard (empty when the
    rank holds nothing), a plain tensor as it is."""
    if hasattr(value, "local_shards"):
        shards = value.local_shards()
        return shards[0].tensor.detach().clone() if shards else torch.empty(0)
    return value.detach().clone() if torch.is_tensor(value) else value


@torch.no_grad()
def _fill_local(template: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """The engine's own LOCAL state dict (``template``, ShardedTensors as its loader demands) holding the
    saved local tensors; a missing key or another size is an error naming it."""
    missing = sorted(set(template) - set(saved))
    if missing:
        raise KeyError(f"LOCAL checkpoint lacks {missing}; was it saved by another engine or wrapping?")
    for key, value in template.items():
        target = _local_tensor(value) if not hasattr(value, "local_shards") else (
            value.local_shards()[0].tensor if value.local_shards() else None)
        if target is None or not torch.is_tensor(target):
            continue
        if target.shape != saved[key].shape:
            raise ValueError(f"LOCAL checkpoint {key}: saved shape {tuple(saved[key].shape)}, this rank holds "
                             f"{tuple(target.shape)}; a LOCAL state dict loads at its own world size only")
        if hasattr(value, "local_shards"):
            target.copy_(saved[key])
        else:
            template[key] = saved[key]
    return template


def _fsdp1_apply(
    adapter: FSDP1Adapter, module: nn.Module, optimizer: torch.optim.Optimizer, kind: str, state: dict[str, Any],
    group: Any,
) -> None:
    with _fsdp1_type(adapter, module, kind) as fsdp:
        module.load_state_dict(state["model"])
        if kind == "local":
            optimizer.load_state_dict(state["optim"])
        else:
            optimizer.load_state_dict(fsdp.optim_state_dict_to_load(module, optimizer, state["optim"], group=group))


# ---------------------------------------------------------------------------------------------------
# DCP state-dict helpers (FSDP2 and plain modules)


def _sharded_options() -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Always the sharded (DTensor) form: the helpers' full_state_dict gathers and scatters through
    # functional collectives, which crash on gloo with CUDA tensors (ranks sharing a GPU); "full" state
    # is gathered and split here with plain collectives instead (harness.engines.dtensors).
    return StateDictOptions(full_state_dict=False)


def _gathered(tree: Any) -> Any:
    """``tree`` with every ``DTensor`` replaced by its full tensor on the CPU (collective, in tree order)."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict):
        return {k: _gathered(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_gathered(v) for v in tree]
    if isinstance(tree, DTensor):
        return full_tensor(tree).cpu()
    return tree


def _split_like(tree: Any, like: Any) -> Any:
    """A full-tensor ``tree`` laid out as ``like`` (the module's own sharded state): each tensor whose
    counterpart is a ``DTensor`` becomes this rank's piece of it, on that ``DTensor``'s device."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, dict) and isinstance(like, dict):
        return {k: _split_like(v, like[k]) if k in like else v for k, v in tree.items()}
    if isinstance(tree, list) and isinstance(like, list) and len(tree) == len(like):
        return [_split_like(v, w) for v, w in zip(tree, like)]
    if isinstance(like, DTensor) and isinstance(tree, torch.Tensor) and not isinstance(tree, DTensor):
        local = like.to_local()
        return distribute(tree.to(device=local.device, dtype=local.dtype), like.device_mesh, like.placements)
    return tree


def _dsd_state(module: nn.Module, optimizer: torch.optim.Optimizer, kind: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if kind == "local":
        raise ValueError("torch-fsdp2 has no LOCAL state dict")
    options = _sharded_options()
    state = {"model": get_model_state_dict(module, options=options),
             "optim": get_optimizer_state_dict(module, optimizer, options=options)}
    return _gathered(state) if kind == "full" else state


def _dsd_apply(module: nn.Module, optimizer: torch.optim.Optimizer, kind: str, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = _sharded_options()
    if kind == "full":
        like = {"model": get_model_state_dict(module, options=options),
                "optim": get_optimizer_state_dict(module, optimizer, options=options)}
        state = _split_like(state, like)
    set_model_state_dict(module, state["model"], options=options)
    set_optimizer_state_dict(module, optimizer, state["optim"], options=options)


def _plant_after_load(optimizer: torch.optim.Optimizer, fault: str) -> None:
    """``drop_optimizer_state``: the optimizer's state thrown away once loaded, as an adapter that never
    loads it would leave it (clearing afterwards also covers loads that write the state in place)."""
    if fault == "drop_optimizer_state":
        optimizer.state.clear()


# ---------------------------------------------------------------------------------------------------
# Save and load


def _state(
    adapter: EngineAdapter, module: nn.Module, optimizer: torch.optim.Optimizer, kind: str, ctx: RankContext
) -> dict[str, Any]:
    if engine_family(adapter) == "fsdp1":
        return _fsdp1_state(adapter, module, optimizer, kind, ctx.world_group())  # type: ignore[arg-type]
    return _dsd_state(module, optimizer, kind)


def save_checkpoint(
    adapter: EngineAdapter, module: nn.Module, optimizer: torch.optim.Optimizer, kind: str, path: Path, ctx: RankContext
) -> None:
    """Save ``module`` and ``optimizer`` (wrapped by ``adapter``'s engine) as a ``kind`` checkpoint under
    ``path``; collective over ``ctx``'s ranks."""
    state = _state(adapter, module, optimizer, kind, ctx)
    group = ctx.world_group()
    if kind == "full":
        if ctx.rank == 0:
            torch.save(state, path / _FULL_FILE)
    elif kind == "local":
        # This rank's own flat shards and their optimizer state, one file per rank: DCP would keep one
        # copy of what it takes for replicated plain tensors (the use_orig_params views torch leaves in).
        model_sd = {k: _local_tensor(v) for k, v in state["model"].items()}
        torch.save({"model": model_sd, "optim": state["optim"]}, path / f"local-rank{ctx.rank}.pt")
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=str(path / _DCP_DIR), process_group=group)
    dist.barrier(group=group)


def load_checkpoint(
    adapter: EngineAdapter, module: nn.Module, optimizer: torch.optim.Optimizer, kind: str, path: Path,
    ctx: RankContext, fault: str = "",
) -> None:
    """Load a ``kind`` checkpoint saved by any engine under ``path`` into a freshly wrapped ``module`` and
    its fresh ``optimizer``; collective over ``ctx``'s ranks. ``fault`` plants a load bug (module docstring)."""
    if kind in ("full", "local"):
        template = _state(adapter, module, optimizer, kind, ctx)["model"] if kind == "local" else None
        source = path / (_FULL_FILE if kind == "full" else f"local-rank{ctx.rank}.pt")
        if fault == "corrupt_checkpoint_rank1" and ctx.rank == 1:
            # A copy of its own: the full file is shared, and rank 0 must still read it intact.
            source = source.with_name(f"corrupt-{source.name}")
            source.write_bytes(b"not a checkpoint")
        error: BaseException | None = None
        try:  # each rank reads its own file (or rank 0's): a failure here is this rank's alone
            if kind == "full":
                state = torch.load(source, weights_only=True)
            else:
                saved = torch.load(source, weights_only=True)
                state = {"model": _fill_local(template, saved["model"]), "optim": saved["optim"]}
        except Exception as exc:  # noqa: BLE001 - every rank raises it below, after agreeing
            error = exc
        agree_loaded(error, ctx)
    else:
        import torch.distributed.checkpoint as dcp

        init_optimizer_state(optimizer)
        state = _state(adapter, module, optimizer, kind, ctx)
        dcp.load(state, checkpoint_id=str(path / _DCP_DIR), process_group=ctx.world_group())
    if fault == "swap_optimizer_state":
        _swap_same_shape(state["optim"])
    if engine_family(adapter) == "fsdp1":
        _fsdp1_apply(adapter, module, optimizer, kind, state, ctx.world_group())  # type: ignore[arg-type]
    else:
        _dsd_apply(module, optimizer, kind, state)
    _plant_after_load(optimizer, fault)


def load_plain(module: nn.Module, optimizer: torch.optim.Optimizer, path: Path, fault: str = "") -> None:
    """Load a sharded (DCP) checkpoint into an unwrapped ``module`` on this rank alone (no process group)."""
    import torch.distributed.checkpoint as dcp

    init_optimizer_state(optimizer)
    state = _dsd_state(module, optimizer, "sharded")
    dcp.load(state, checkpoint_id=str(path / _DCP_DIR), no_dist=True)
    if fault == "swap_optimizer_state":
        _swap_same_shape(state["optim"])
    _dsd_apply(module, optimizer, "sharded", state)
    _plant_after_load(optimizer, fault)


def _swap_same_shape(optim_sd: dict[str, Any]) -> None:
    """The ``swap_optimizer_state`` fault: the first two parameters whose state tensors have one shape
    trade their state (momentum of the wrong parameter)."""
    per_param = optim_sd["state"]
    by_shape: dict[tuple[Any, ...], Any] = {}
    for key, entry in per_param.items():
        shape = tuple((k, tuple(v.shape)) for k, v in sorted(entry.items()) if torch.is_tensor(v) and v.dim() > 0)
        if not shape:
            continue
        if shape in by_shape:
            other = by_shape[shape]
            per_param[key], per_param[other] = per_param[other], per_param[key]
            return
        by_shape[shape] = key
    raise ValueError("fault swap_optimizer_state: no two parameters share a shape in this model's optimizer state")
