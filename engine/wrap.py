"""Wrapping: where one sharded unit ends and the next begins.

Users choose unit boundaries with an *auto-wrap policy* passed to the wrapper's constructor, or by
hand with :func:`enable_wrap` / :func:`wrap`. Names and signatures are torch FSDP1's
(``torch.distributed.fsdp.wrap``), so code written against it runs unchanged.

Two kinds of policy exist, as in FSDP1:

- a *callable* ``policy(module=, recurse=, nonwrapped_numel=) -> bool``. It is asked twice per
  module during a depth-first walk: with ``recurse=True`` whether to descend into the module, and
  (after its children) with ``recurse=False`` whether to wrap it, given the parameter numel of its
  subtree that no child unit took;
- a :class:`_Policy` object (:class:`ModuleWrapPolicy`, :class:`CustomPolicy`) that maps each
  module to wrap directly to its constructor keyword arguments.

:func:`auto_wrap` (what the runtime calls) works in three steps so that each can be tested
alone: *plan* (a pure function of the module tree and the policy: ``{module: kwargs}``),
*validate* (frozen/trainable mix, [Note: frozen parameters in one unit]), *apply* (construct the
units children first and put them in place of the modules in every parent).

[Note: frozen parameters in one unit]
One flat parameter has one ``requires_grad``. With ``use_orig_params=False`` a unit whose
parameters mix frozen and trainable ones cannot be built, so planning it is an error. With
``use_orig_params=True`` it can be built, but the gradient of the whole flat parameter is
materialized (frozen parts included), so it only warns. The root unit is not checked here: it
takes whatever no child took, and the flat-parameter handle rejects a mix there itself.

[Note: mixed-precision module classes]
FSDP1 keeps modules of ``MixedPrecision._module_classes_to_ignore`` (BatchNorm by default) in full
precision when an auto-wrap policy is given: each becomes its own unit with
``mixed_precision=None`` whatever the policy says, and hooks cast its floating-point inputs to
float32 and its outputs back to the input dtype. We do the same, reading the attribute
duck-typed so that any ``MixedPrecision`` class works.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from abc import ABC, abstractmethod
from collections import deque
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import torch
import torch.nn as nn

from engine.module_tree import FSDP_MARKER, is_fsdp

__all__ = [
    "FSDP_UNIT_MARKER",
    "CustomPolicy",
    "ModuleWrapPolicy",
    "always_wrap_policy",
    "auto_wrap",
    "enable_wrap",
    "is_wrapped_unit",
    "lambda_auto_wrap_policy",
    "plan_wrap",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

#: Class attribute (set to ``True``) by which any wrapper class marks its instances as units, so
#: that an already-wrapped module is recognised even when another wrapper class is auto-wrapping.
FSDP_UNIT_MARKER = FSDP_MARKER


class WrapperClass(Protocol):
    """What auto wrapping needs of a wrapper: ``wrapper_cls(module, **kwargs)`` is the unit."""

    def __call__(self, module: nn.Module, **kwargs: Any) -> nn.Module: ...


def is_wrapped_unit(module: nn.Module, wrapper_cls: Any = None) -> bool:
    """Whether ``module`` is already a unit: an instance of ``wrapper_cls`` or of a marked class."""
    if is_fsdp(module):
        return True
    return isinstance(wrapper_cls, type) and isinstance(module, wrapper_cls)


# ---------------------------------------------------------------------------- callable policies
def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Recurse everywhere and wrap every submodule."""
    return True


def _module_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, module_classes: Iterable[type[nn.Module]]
) -> bool:
    if recurse:
        return True
    return isinstance(module, tuple(module_classes))


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """Recurse everywhere; wrap the modules for which ``lambda_fn(module)`` is true."""
    if recurse:
        return True
    return bool(lambda_fn(module))


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    transformer_layer_cls: Iterable[type[nn.Module]],
) -> bool:
    """Wrap every instance of ``transformer_layer_cls``; the rest goes to the enclosing unit."""
    return _module_wrap_policy(module, recurse, nonwrapped_numel, transformer_layer_cls)


def _wrap_module_cls_individually(
    module: nn.Module, module_classes: Sequence[type], recurse: bool, *args: Any, **kwargs: Any
) -> bool:
    """Recurse everywhere; wrap every instance of ``module_classes`` as its own unit."""
    if recurse:
        return True
    return isinstance(module, tuple(module_classes))


def _or_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, policies: Iterable[Callable[..., bool]]
) -> bool:
    """True when any of ``policies`` is: recurse if any recurses, wrap if any wraps."""
    return any(policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel) for policy in policies)


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wrap a module once the numel no child unit took reaches ``min_num_params``.

    ``force_leaf_modules`` (default :attr:`FORCE_LEAF_MODULES`) are never descended into, so their
    children are never units; ``exclude_wrap_modules`` (default :attr:`EXCLUDE_WRAP_MODULES`,
    containers without a forward) are never units themselves, though their children may be.
    """
    if force_leaf_modules is None:
        force_leaf_modules = size_based_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    if exclude_wrap_modules is None:
        exclude_wrap_modules = size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]
    # ``min_num_params`` keeps FSDP1's name; it is compared with the *not yet wrapped* numel.
    is_large = nonwrapped_numel >= min_num_params
    if recurse:
        return is_large and not isinstance(module, tuple(force_leaf_modules))
    return is_large and not isinstance(module, tuple(exclude_wrap_modules))


size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- policy objects
class _Policy(ABC):
    """A policy that names the modules to wrap and the constructor kwargs of each, in one pass."""

    @abstractmethod
    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> dict[nn.Module, dict[str, Any]]:
        """Map each module to wrap to its kwargs (a copy of ``root_kwargs``, maybe overridden)."""


class ModuleWrapPolicy(_Policy):
    """Wrap every module of one of ``module_classes`` with the root's kwargs.

    Also usable as a callable policy (``policy(module=, recurse=, nonwrapped_numel=)``), e.g.
    inside :func:`_or_policy`.
    """

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        #: the classes whose instances become units.
        self._module_classes: set[type[nn.Module]] = set(module_classes)

    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> dict[nn.Module, dict[str, Any]]:
        classes = tuple(self._module_classes)
        return {
            module: copy.copy(root_kwargs)
            for module in root_module.modules()
            if module not in ignored_modules and isinstance(module, classes)
        }

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return _module_wrap_policy(module, recurse, -1, self._module_classes)

    def __repr__(self) -> str:
        names = sorted(cls.__name__ for cls in self._module_classes)
        return f"{type(self).__name__}({{{', '.join(names)}}})"


class CustomPolicy(_Policy):
    """Wrap according to ``lambda_fn(module)``, which returns, per module:

    - ``False`` or ``{}``: not a unit;
    - ``True``: a unit with the root's kwargs;
    - a non-empty ``dict``: a unit with the root's kwargs updated by the dict (e.g.
      ``{"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}`` for that unit only).
    """

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        self._lambda_fn = lambda_fn

    def _run_policy(
        self, root_module: nn.Module, ignored_modules: set[nn.Module], root_kwargs: dict[str, Any]
    ) -> dict[nn.Module, dict[str, Any]]:
        targets: dict[nn.Module, dict[str, Any]] = {}
        for name, module in root_module.named_modules():
            if module in ignored_modules:
                continue
            result = self._lambda_fn(module)
            if not isinstance(result, (bool, dict)):
                raise ValueError(
                    "The lambda_fn passed to CustomPolicy should return False/True or a kwarg dict, "
                    f"but it returned {result!r} (of type {type(result).__name__}) for module "
                    f"{name or '<root>'!r} ({type(module).__name__}): return True to wrap with the "
                    "root's settings, a dict to override some of them, or False not to wrap"
                )
            if not result:
                continue
            kwargs = copy.copy(root_kwargs)
            if isinstance(result, dict):
                kwargs.update(result)
            targets[module] = kwargs
        return targets


# ---------------------------------------------------------------------------- auto wrapping
def auto_wrap(
    root_module: nn.Module,
    policy: Callable[..., bool] | _Policy,
    wrapper_cls: WrapperClass,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    root_kwargs: dict[str, Any],
) -> None:
    """Wrap the submodules of ``root_module`` that ``policy`` selects, in place, children first.

    Each unit is ``wrapper_cls(submodule, **kwargs)`` with ``kwargs`` the root's
    (``root_kwargs`` without ``auto_wrap_policy``) updated by the policy's per-unit overrides.
    The root itself is not wrapped: its wrapper's constructor is the caller. Ignored modules and
    everything under them are never wrapped; ignored parameters count toward no unit's numel.

    Raises ``ValueError`` if a submodule is already a unit (see :func:`is_wrapped_unit`), if a
    planned unit mixes frozen and trainable parameters with ``use_orig_params=False`` (a
    ``UserWarning`` with ``True``), or if a :class:`CustomPolicy` returns something else than a
    bool or a dict.
    """
    _check_nested_wrapping(root_module, wrapper_cls)
    kwargs = {k: v for k, v in root_kwargs.items() if k != "auto_wrap_policy"}
    ignored_tree = _expand_ignored(ignored_modules)
    mp_classes = _mixed_precision_ignored_classes(kwargs.get("mixed_precision"))

    targets = plan_wrap(root_module, policy, ignored_tree, ignored_params, kwargs, mp_classes)
    overridden = _override_mixed_precision(root_module, targets, mp_classes)
    if overridden:
        warnings.warn(
            "Both mixed precision and an auto_wrap_policy were specified, and the model has "
            f"submodules of type {sorted(c.__name__ for c in overridden)}. These modules will be "
            "wrapped as separate FSDP units with mixed precision disabled (set "
            "MixedPrecision._module_classes_to_ignore to change which classes)",
            UserWarning,
            stacklevel=2,
        )
    _validate_frozen_params(root_module, set(targets), ignored_params, bool(kwargs.get("use_orig_params", False)))
    _apply_wrap(root_module, targets, wrapper_cls)


def plan_wrap(
    root_module: nn.Module,
    policy: Callable[..., bool] | _Policy,
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    root_kwargs: dict[str, Any],
    mp_ignored_classes: tuple[type[nn.Module], ...] = (),
) -> dict[nn.Module, dict[str, Any]]:
    """Which submodules of ``root_module`` become units, each with its constructor kwargs.

    Pure: neither the modules nor ``root_kwargs`` are changed. The root is in the result only when
    a policy object selects it (so that its parameters are validated as FSDP1 does); it is never
    wrapped here. ``ignored_modules`` must already contain the descendants of each ignored module.
    """
    if isinstance(policy, _Policy):
        targets = policy._run_policy(root_module, ignored_modules, root_kwargs)
    elif callable(policy):
        if mp_ignored_classes:
            # FSDP1 ORs the class policy in, which also makes the walk descend everywhere.
            policy = functools.partial(
                _or_policy,
                policies=[policy, functools.partial(_wrap_module_cls_individually, module_classes=mp_ignored_classes)],
            )
        modules: list[nn.Module] = []
        _plan_recursive(root_module, policy, ignored_modules, ignored_params, modules, is_root=True)
        targets = {module: copy.copy(root_kwargs) for module in modules}
    else:
        raise ValueError(
            f"auto_wrap_policy={policy!r} is neither callable nor a policy object: pass a function "
            "(module, recurse, nonwrapped_numel) -> bool, ModuleWrapPolicy or CustomPolicy"
        )
    if mp_ignored_classes:
        for module in root_module.modules():
            if module is root_module or module in ignored_modules or not isinstance(module, mp_ignored_classes):
                continue
            targets[module] = {**targets.get(module, root_kwargs), "mixed_precision": None}
    return targets


def _plan_recursive(
    module: nn.Module,
    policy: Callable[..., bool],
    ignored_modules: set[nn.Module],
    ignored_params: set[nn.Parameter],
    out: list[nn.Module],
    is_root: bool = False,
) -> int:
    """Append to ``out``, children first, the modules to wrap under ``module``; return their numel.

    Mirrors FSDP1's ``_recursive_wrap`` decisions without constructing anything: a module's
    ``nonwrapped_numel`` is its subtree's (non-ignored, deduplicated) parameter numel minus what
    its wrapped children took.
    """
    nonwrapped_numel = sum(p.numel() for p in module.parameters() if p not in ignored_params)
    if not policy(module=module, recurse=True, nonwrapped_numel=nonwrapped_numel):
        return 0
    wrapped_numel = 0
    for child in module.children():
        if child in ignored_modules:
            continue
        wrapped_numel += _plan_recursive(child, policy, ignored_modules, ignored_params, out)
    remainder = nonwrapped_numel - wrapped_numel
    if not is_root and policy(module=module, recurse=False, nonwrapped_numel=remainder):
        out.append(module)
        return nonwrapped_numel
    return wrapped_numel


def _apply_wrap(
    root_module: nn.Module, targets: dict[nn.Module, dict[str, Any]], wrapper_cls: WrapperClass
) -> None:
    """Construct the units children first and put each in place of its module in every parent."""
    units: dict[nn.Module, nn.Module] = {}
    for _, module in _post_order_named_modules(root_module):
        # Children come before parents in post order, so every child unit exists by now.
        for child_name, child in list(module.named_children()):
            if child in units:
                setattr(module, child_name, units[child])
        if module is not root_module and module in targets:
            units[module] = wrapper_cls(module, **targets[module])


def _check_nested_wrapping(root_module: nn.Module, wrapper_cls: Any) -> None:
    for name, module in root_module.named_modules():
        if is_wrapped_unit(module, wrapper_cls):
            raise ValueError(
                "FSDP auto wrapping requires modules to not already have FSDP applied but found "
                f"{name or '<root>'} in\n{root_module}\nEither wrap by hand everywhere or pass the "
                "unwrapped model with auto_wrap_policy"
            )


def _expand_ignored(ignored_modules: Iterable[nn.Module]) -> set[nn.Module]:
    """The ignored modules with all their descendants: nothing under an ignored module is wrapped."""
    return {sub for module in ignored_modules for sub in module.modules()}


# ---------------------------------------------------------------------------- mixed precision
def _mixed_precision_ignored_classes(mixed_precision: Any) -> tuple[type[nn.Module], ...]:
    if mixed_precision is None:
        return ()
    return tuple(dict.fromkeys(getattr(mixed_precision, "_module_classes_to_ignore", ())))


def _override_mixed_precision(
    root_module: nn.Module, targets: dict[nn.Module, dict[str, Any]], classes: tuple[type[nn.Module], ...]
) -> set[type[nn.Module]]:
    """Cast the inputs of the full-precision units to float32 and their outputs back.

    See [Note: mixed-precision module classes]. Returns the classes actually found.
    """
    if not classes:
        return set()
    overridden: set[type[nn.Module]] = set()
    for module in root_module.modules():
        # Exactly the units ``plan_wrap`` gave ``mixed_precision=None`` (never the root's).
        if module is not root_module and module in targets and isinstance(module, classes):
            overridden.add(type(module))
            _register_fp32_cast_hooks(module)
    return overridden


def _register_fp32_cast_hooks(module: nn.Module) -> None:
    # The input dtype of the current forward, to cast the outputs back to; one slot is enough
    # because a module's forward does not reenter itself.
    input_dtype: list[torch.dtype | None] = [None]

    def cast(dtype: torch.dtype, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x

    def pre_hook(mod: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        floats = [a.dtype for a in args if isinstance(a, torch.Tensor) and torch.is_floating_point(a)]
        input_dtype[0] = floats[0] if floats else None
        return tuple(cast(torch.float32, a) for a in args)

    def post_hook(mod: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if input_dtype[0] is None:
            return output
        dtype = input_dtype[0]
        return torch.utils._pytree.tree_map(functools.partial(cast, dtype), output)

    # Appended, so they run after any hook the wrapper registers (it casts to param_dtype first).
    module.register_forward_pre_hook(pre_hook)
    module.register_forward_hook(post_hook)


# ---------------------------------------------------------------------------- frozen parameters
def _validate_frozen_params(
    root_module: nn.Module,
    modules_to_wrap: set[nn.Module],
    ignored_params: set[nn.Parameter],
    use_orig_params: bool,
) -> None:
    """Check that each planned unit's parameters are all frozen or all trainable.

    A mix raises ``ValueError`` with ``use_orig_params=False`` and warns (``UserWarning``) with
    ``True``; see [Note: frozen parameters in one unit]. Units are visited children first, so the
    message names the first offending unit in registration order, and each unit is checked for the
    parameters it would manage (not those of units under it). Parameters in ``ignored_params``
    belong to no unit.
    """
    claimed: set[nn.Module] = set()
    for name, module in _post_order_named_modules(root_module):
        if module not in modules_to_wrap:
            continue
        managed = _managed_param_fqns(module, name, ignored_params, claimed)
        trainable = [fqn for p, fqn in managed.items() if p.requires_grad]
        frozen = [fqn for p, fqn in managed.items() if not p.requires_grad]
        if not trainable or not frozen:
            continue
        trainable_numel = sum(p.numel() for p in managed if p.requires_grad)
        total_numel = sum(p.numel() for p in managed)
        msg = f"{name} has both parameters with requires_grad=True and False."
        if use_orig_params:
            msg += (
                " We do not recommend wrapping such modules since the gradient memory usage will be "
                f"higher than expected ({total_numel} numel instead of {trainable_numel} numel before "
                "sharding via reduce-scatter). "
            )
        else:
            msg += " FSDP does not support wrapping such modules when use_orig_params=False. "
        msg += (
            "If possible, wrap the frozen parameters with FSDP separately.\n"
            f"The following parameters have requires_grad=True:\n{trainable}\n"
            f"The following parameters have requires_grad=False:\n{frozen}"
        )
        if use_orig_params:
            warnings.warn(msg, UserWarning, stacklevel=2)
        else:
            raise ValueError(msg)


def _post_order_named_modules(root_module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Each module once (first name), children before parents, siblings in registration order."""
    order: list[tuple[str, nn.Module]] = []
    seen: set[nn.Module] = {root_module}

    def visit(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            if child is None or child in seen:
                continue
            seen.add(child)
            visit(f"{prefix}.{child_name}" if prefix else child_name, child)
        order.append((prefix, module))

    visit("", root_module)
    return order


def _managed_param_fqns(
    module: nn.Module, prefix: str, ignored_params: set[nn.Parameter], claimed: set[nn.Module]
) -> dict[nn.Parameter, str]:
    """The parameters ``module`` would manage, with their FQNs from the root.

    Skips modules already ``claimed`` by a unit below (called children first) and claims the rest.
    """
    managed: dict[nn.Parameter, str] = {}
    queue: deque[tuple[nn.Module, str]] = deque([(module, prefix)])
    claimed.add(module)
    while queue:
        current, current_prefix = queue.popleft()
        for param_name, param in current.named_parameters(recurse=False):
            if param not in ignored_params and param not in managed:
                managed[param] = f"{current_prefix}.{param_name}" if current_prefix else param_name
        for child_name, child in current.named_children():
            if child is None or child in claimed:
                continue
            claimed.add(child)
            queue.append((child, f"{current_prefix}.{child_name}" if current_prefix else child_name))
    return managed


# ---------------------------------------------------------------------------- wrap context
class _WrapContext:
    """The settings of the active :func:`enable_wrap` block; inactive outside one."""

    def __init__(self) -> None:
        #: the wrapper class of the active block, ``None`` outside any block.
        self.wrapper_cls: WrapperClass | None = None
        #: the default constructor kwargs of the active block.
        self.kwargs: dict[str, Any] = {}

    @property
    def active(self) -> bool:
        return self.wrapper_cls is not None

    @contextlib.contextmanager
    def enabled(self, wrapper_cls: WrapperClass, kwargs: dict[str, Any]) -> Iterator[None]:
        if self.active:
            raise NotImplementedError(
                "enable_wrap() is already active: nested wrap contexts are not supported; pass "
                "per-module overrides to wrap() instead"
            )
        if wrapper_cls is None:
            raise ValueError("enable_wrap(wrapper_cls=None): pass the wrapper class, e.g. FullyShardedDataParallel")
        self.wrapper_cls, self.kwargs = wrapper_cls, dict(kwargs)
        try:
            yield
        finally:
            self.wrapper_cls, self.kwargs = None, {}


_WRAP_CONTEXT = _WrapContext()


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Iterator[None]:
    """Make :func:`wrap` construct ``wrapper_cls(module, **wrapper_kwargs, **overrides)`` inside.

    Usage::

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, process_group=pg):
            self.layer = wrap(nn.Linear(5, 5))
    """
    with _WRAP_CONTEXT.enabled(wrapper_cls, wrapper_kwargs):
        yield


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` with the active :func:`enable_wrap` settings, ``wrap_overrides`` first.

    Outside an :func:`enable_wrap` block it returns ``module`` unchanged, so a model can be built
    with and without wrapping by the same code.
    """
    if not _WRAP_CONTEXT.active:
        return module
    assert _WRAP_CONTEXT.wrapper_cls is not None
    return _WRAP_CONTEXT.wrapper_cls(module, **{**_WRAP_CONTEXT.kwargs, **wrap_overrides})
