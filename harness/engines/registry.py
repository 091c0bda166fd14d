"""The engine registry: which adapter a ``CaseConfig.engine`` value names.

An engine is named by a *spec*, everywhere an engine is named (``--engine``/``--engines``, cases,
records, reports):

- ``NAME``: a registered engine: the built-in registrations (``builtin``: our ``engine`` package,
  ``torch-fsdp``: torch FSDP1, ``torch-fsdp2``: torch's ``fully_shard``), ``register``-ed ones, and the
  entry points of the group ``fsdp_parity.engines`` of the installed distributions;
- ``NAME=fsdp1:MODULE``: a namespace with torch FSDP1's public API, through ``FSDP1Adapter``;
- ``NAME=fsdp2:MODULE``: a namespace with ``fully_shard``, ``MixedPrecisionPolicy`` and
  ``CPUOffloadPolicy``, through ``FSDP2Adapter``;
- ``NAME=deepspeed:PATH.json``: DeepSpeed ZeRO with a config file over the adapter's neutral defaults
  (``harness.engines.deepspeed_adapter``); ``deepspeed-zero1|2|3`` are registered with the defaults alone;
- ``NAME=megatron-fsdp:PATH.json``: Megatron-FSDP with a file of ``fully_shard`` keywords over the adapter's
  (``harness.engines.megatron_fsdp_adapter``); ``megatron-fsdp``, ``megatron-fsdp-zero1|2`` are registered, and
  ``fairscale`` (``harness.engines.fairscale_adapter``);
- ``NAME=MODULE:OBJECT``: an ``EngineAdapter`` instance, or a factory called with the name (or with no
  argument) that returns one.

An entry point's object is an adapter or such a factory, e.g. in a ``pyproject.toml``::

    [project.entry-points."fsdp_parity.engines"]
    mine = "mine.parity:adapter"

The spec string is what travels: a case carries it to the rank processes and every rank resolves it
again (``resolve`` caches per process), so nothing but the string has to be registered anywhere.
``check_engines`` is the one validation of engine options: it resolves every spec and imports what
each engine needs, and raises ``EngineSpecError`` (one line naming the option, the engine and what is
missing) before anything runs.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Iterable, Sequence
from importlib import metadata
from typing import Any

from harness.cases.case import DEFAULT_ENGINES, engine_name
from harness.engines.adapters import EngineAdapter, FSDP1Adapter
from harness.engines.deepspeed_adapter import DEEPSPEED_STAGES, DeepSpeedAdapter
from harness.engines.fairscale_adapter import FairScaleAdapter
from harness.engines.fsdp2_adapter import FSDP2Adapter
from harness.engines.megatron_fsdp_adapter import MegatronFSDPAdapter

__all__ = [
    "API_KINDS",
    "DEFAULT_ENGINES",
    "ENTRY_POINT_GROUP",
    "EngineSpecError",
    "check_engines",
    "fsdp1_engines",
    "register",
    "registered_names",
    "resolve",
]

ENTRY_POINT_GROUP = "fsdp_parity.engines"

Factory = Callable[[str], EngineAdapter]

#: the API kinds of a spec ``NAME=KIND:MODULE``: the adapter over a module with that public API.
#: They take precedence over ``MODULE:OBJECT`` (a module named ``deepspeed`` is never imported for
#: ``NAME=deepspeed:cfg.json``). ``deepspeed``'s is a config file, not a module.
API_KINDS: dict[str, Callable[[str, str], EngineAdapter]] = {
    "fsdp1": FSDP1Adapter,
    "fsdp2": FSDP2Adapter,
    "deepspeed": lambda name, path: DeepSpeedAdapter(name, config_path=path),
    "megatron-fsdp": lambda name, path: MegatronFSDPAdapter(name, config_path=path),
}
#: the API kinds whose target is a file path (which a comma list of engines cannot carry with a comma).
PATH_KINDS = ("deepspeed", "megatron-fsdp")

#: name -> factory, filled below and by ``register``; entry points are read on first use.
_REGISTERED: dict[str, Factory] = {}


class EngineSpecError(ValueError):
    """An engine spec that names nothing usable; the message is one line naming the engine and the fix."""


def register(name: str, factory: Factory) -> None:
    """Register ``factory(name) -> EngineAdapter`` under ``name`` (a plain name, no ``=`` or ``:``)."""
    if not name or "=" in name or ":" in name or "," in name:
        raise EngineSpecError(f"register: engine name {name!r} must be non-empty without '=', ':' or ','")
    _REGISTERED[name] = factory
    if "resolve" in globals():  # a registration replacing one must not leave the old adapter cached
        resolve.cache_clear()


register("builtin", lambda name: FSDP1Adapter(name, "engine"))
# torch FSDP1 pins offloaded shards' host memory, which needs an accelerator.
register("torch-fsdp", lambda name: FSDP1Adapter(name, "torch.distributed.fsdp", offload_needs_accelerator=True,
                                                 offloaded_summon_needs_nccl=True, accumulates_with_offload=False))
register("torch-fsdp2", lambda name: FSDP2Adapter(name, None))
# DeepSpeed ZeRO by stage, with the adapter's neutral config (``harness.engines.deepspeed_adapter``); without
# deepspeed installed their cases are unsupported with the install line.
for _stage in DEEPSPEED_STAGES:
    register(f"deepspeed-zero{_stage}", functools.partial(lambda name, stage: DeepSpeedAdapter(name, stage=stage), stage=_stage))
# Megatron-FSDP by zero_dp_strategy (3: ``megatron-fsdp``, full_shard) and FairScale's FSDP, CUDA only; without the
# package, or on CPU ranks, their cases are unsupported with the one line saying so.
for _name, _level in (("megatron-fsdp", 3), ("megatron-fsdp-zero2", 2), ("megatron-fsdp-zero1", 1)):
    register(_name, functools.partial(lambda name, level: MegatronFSDPAdapter(name, level=level), level=_level))
register("fairscale", FairScaleAdapter)


@functools.lru_cache(maxsize=None)
def _entry_points() -> dict[str, Any]:
    return {ep.name: ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}


def registered_names() -> list[str]:
    """Every engine name a bare spec may use: the registrations and the installed entry points."""
    return sorted({*_REGISTERED, *_entry_points()})


def _from_object(label: str, name: str, obj: Any) -> EngineAdapter:
    adapter = obj
    if not isinstance(obj, EngineAdapter) and callable(obj):
        try:
            takes_name = bool(inspect.signature(obj).parameters)
        except (TypeError, ValueError):
            takes_name = True
        adapter = obj(name) if takes_name else obj()
    if not isinstance(adapter, EngineAdapter):
        raise EngineSpecError(
            f"engine {label!r}: {type(adapter).__name__} is not a harness.engines.adapters.EngineAdapter; point it at an "
            "adapter instance or a factory returning one"
        )
    return adapter


def _build(spec: str) -> EngineAdapter:
    name, sep, target = spec.partition("=")
    name = name.strip()
    if not name:
        raise EngineSpecError(f"engine {spec!r}: give a name before '=' (NAME=fsdp1:MODULE, NAME=fsdp2:MODULE, NAME=MODULE:OBJECT)")
    if not sep:
        if name in _REGISTERED:
            return _REGISTERED[name](name)
        entry = _entry_points().get(name)
        if entry is None:
            raise EngineSpecError(
                f"engine {name!r} is not registered (known: {', '.join(registered_names())}); name a spec "
                f"NAME=fsdp1:MODULE, NAME=fsdp2:MODULE or NAME=MODULE:OBJECT, or install a package with an "
                f"entry point in {ENTRY_POINT_GROUP!r}"
            )
        return _from_object(spec, name, entry.load())
    if name in registered_names():
        # Two engines under one name would make the report's rows and verdicts say the wrong one.
        raise EngineSpecError(
            f"engine {spec!r}: the name {name!r} is already the registered engine {name!r}; give the spec "
            f"another name (e.g. {name}-2={target})"
        )
    kind, colon, rest = target.partition(":")
    if not colon or not kind or not rest:
        raise EngineSpecError(
            f"engine {spec!r}: {target!r} is not fsdp1:MODULE, fsdp2:MODULE or MODULE:OBJECT"
        )
    if kind in API_KINDS:
        return API_KINDS[kind](name, rest)
    try:
        module = importlib.import_module(kind)
    except ModuleNotFoundError as exc:
        if exc.name != kind.split(".")[0]:
            raise
        raise EngineSpecError(
            f"engine {spec!r}: {kind!r} is no API kind (known: {', '.join(API_KINDS)}) and no module to import "
            f"for MODULE:OBJECT; write NAME={'|'.join(API_KINDS)}:MODULE or NAME=MODULE:OBJECT"
        ) from None
    obj: Any = module
    for part in rest.split("."):
        if not hasattr(obj, part):
            raise AttributeError(f"module {kind!r} has no attribute {rest!r}")
        obj = getattr(obj, part)
    return _from_object(spec, name, obj)


@functools.lru_cache(maxsize=None)
def resolve(spec: str) -> EngineAdapter:
    """The adapter ``spec`` names, checked (``EngineAdapter.check``); ``EngineSpecError`` says why not.

    Cached per process: the rank processes resolve the spec a case carries once each.
    """
    try:
        adapter = _build(spec)
        adapter.check()
    except EngineSpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - an engine's own failure, reported as its one line
        raise EngineSpecError(f"engine {spec!r}: {_one_line(exc)}") from exc
    # The spec's name wins over the adapter's own, so ids and reports say what the user wrote.
    adapter.name = engine_name(spec)
    return adapter


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    if isinstance(exc, ModuleNotFoundError):
        return f"cannot import module {exc.name!r} ({text}); install it or fix the module name"
    return f"{type(exc).__name__}: {text}"


def check_engines(specs: Iterable[str], option: str = "--engines") -> list[str]:
    """Every spec resolved and checked, in order, without repeats; raises ``EngineSpecError`` naming
    ``option`` and the engine. The one validation of engine names for every front end."""
    specs = [s.strip() for s in specs if s.strip()]
    _refuse_split_path(specs, option)
    if not specs:
        raise EngineSpecError(f"{option}: give at least one engine (known: {', '.join(registered_names())})")
    names = [engine_name(s) for s in specs]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise EngineSpecError(f"{option}: engine name(s) {repeated} given more than once")
    for spec in specs:
        try:
            resolve(spec)
        except EngineSpecError as exc:
            raise EngineSpecError(f"{option}: {exc}") from None
    return specs


def _refuse_split_path(specs: Sequence[str], option: str) -> None:
    """A ``NAME=deepspeed:PATH`` whose path held a comma arrives cut in two by the comma list: say so in
    one line, instead of "not registered" about the path's tail."""
    for before, after in zip(specs, specs[1:]):
        kind = before.partition("=")[2].partition(":")[0]
        if kind in PATH_KINDS and "=" not in after and after not in registered_names():
            raise EngineSpecError(
                f"{option}: {before},{after}: a {kind} config path with a comma cannot travel in a comma list "
                "of engines; move or rename the file to a path without ','")


def fsdp1_engines(specs: Sequence[str]) -> tuple[str, ...]:
    """The specs among ``specs`` whose engine speaks torch FSDP1's public API (the ported suites' engines)."""
    return tuple(s for s in specs if resolve(s).fsdp1_module is not None)
