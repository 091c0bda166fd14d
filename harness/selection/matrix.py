"""The case matrix: axes, the rules that rule combinations out, and three generators.

Pure logic over plain data: nothing here runs a case. ``generate("full")`` is the cartesian product
of the axes minus the invalid combinations; ``generate("pairwise")`` is a covering array (every pair of
values of every two axes that can occur in a valid case occurs in at least one generated case) built by
a deterministic AETG-style greedy; ``generate("smoke")`` is a handful of cases that touch the main
features of every engine.

Axis values are the ``Literal`` values of ``harness.cases.case``; case ids are ``CaseConfig.case_id`` (qualified
by ``full_id`` where engines and references are mixed).

[Note: invalid versus uncovered]
A combination is *invalid* when an engine cannot express it or raises on it by design (a rule, each with
its reason: ``RULES`` below for what every engine meets, and each engine's own ``capability_rules``,
declared by its adapter and read through ``harness.engines.registry``, so a new engine needs no edit here). Invalid combinations are left out of every generator. A *pair* of axis values is
*feasible* when at least one valid case holds both; the pairwise generator must cover exactly the feasible
pairs. Feasibility is decided by search over the axes that some rule reads (the other axes never make a
case invalid), so it stays exact when rules interact.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence

from typing import Any, Literal

from harness.cases.capabilities import Rule, for_engine
from harness.cases.case import FIELD_VALUES, FSDP_STRATEGIES, CaseConfig, is_hybrid
from harness.engines.registry import DEFAULT_ENGINES, resolve

GeneratorName = Literal["full", "pairwise", "smoke"]

#: One axis value: ``("precision", "bf16")``.
AxisValue = tuple[str, Any]
#: An unordered pair of values of two different axes, stored in ``AXES`` order.
Pair = tuple[AxisValue, AxisValue]

#: The default axes and their values, in the order ids and generators use. The first value of each axis
#: is its baseline (what smoke cases keep unless they exercise that axis).
AXES: dict[str, list[Any]] = {
    # Specs of ``harness.engines.registry``; any registered engine or spec may be given with ``axes``.
    "engine": list(DEFAULT_ENGINES),
    "reference": list(FIELD_VALUES["reference"]),
    # Names from ``harness.cases.models.MODELS``; override with ``axes={"model": [...]}``.
    "model": ["nested", "transformer"],
    # FSDP's strategies; ZeRO-1/2 join for the engines that declare them (``resolve_axes``).
    "sharding_strategy": list(FSDP_STRATEGIES),
    "precision": list(FIELD_VALUES["precision"]),
    "backward_prefetch": list(FIELD_VALUES["backward_prefetch"]),
    "forward_prefetch": [False, True],
    "cpu_offload": [False, True],
    "use_orig_params": [False, True],
    "init_mode": list(FIELD_VALUES["init_mode"]),
    # Hybrid strategies need 4 ranks (see RULES); 2 keeps everything else cheap.
    "world_size": [2, 4],
    # Steps deepen a case rather than change its behaviour: one value by default.
    "steps": [5],
    # Stress delays only make races visible (on CUDA): ``--stress`` pins ``delay``; ``axes=`` may add it.
    "stress": ["none"],
    # What is trained and how it is resumed, not how the engine shards it: one value by default, like
    # steps, so the default products keep their size; WIDE_AXES holds every value (--optimizers,
    # --checkpoints and the checkpoint suite ask for them).
    "optimizer": ["sgd"],
    "checkpoint": ["none"],
    # Cross-engine resume (None: the saving engine resumes); set per case or by the checkpoint suite.
    "resume_engine": [None],
    # What a real training loop adds around the engine: one value each by default, like optimizer;
    # WIDE_AXES holds every value (--clip-grad, --grad-accum, --activation-checkpointing, --compile and
    # the training-loop suite ask for them).
    "clip_grad": ["none"],
    "grad_accum": ["none"],
    "activation_checkpointing": ["none"],
    "compile": ["none"],
}

#: Every value the one-valued axes above can take, for selections and suites that widen them.
WIDE_AXES: dict[str, list[Any]] = {
    "optimizer": list(FIELD_VALUES["optimizer"]),
    "checkpoint": [c for c in FIELD_VALUES["checkpoint"] if c != "dcp-reshard"],
    "resume_engine": [None, *DEFAULT_ENGINES],
    **{axis: list(FIELD_VALUES[axis]) for axis in ("clip_grad", "grad_accum", "activation_checkpointing", "compile")},
}

#: The training-loop axes and the optimizers that split parameters by name: the slice a nightly widens
#: with ``--loop-axes`` and walks pairwise (``LOOP_SLICE``).
LOOP_AXES: tuple[str, ...] = ("optimizer", "clip_grad", "grad_accum", "activation_checkpointing", "compile")
LOOP_SLICE: dict[str, list[Any]] = {axis: WIDE_AXES[axis] for axis in LOOP_AXES}


#: The constraints every engine meets (FSDP's own), whatever the engine. Each reason names the behaviour
#: that makes it invalid; what one engine cannot express is on its adapter (``engine_rules``).
RULES: tuple[Rule, ...] = (
    Rule(
        "offload_after_wrap",
        ("cpu_offload", "init_mode"),
        "CPU offload with the model moved to the GPU after wrapping puts offloaded parameters on the GPU; "
        "FSDP raises ('CPU offloading enabled has parameters on cuda')",
        lambda c: c["cpu_offload"] and c["init_mode"] == "after",
    ),
    Rule(
        "hybrid_world_size",
        ("sharding_strategy", "world_size"),
        "hybrid strategies shard within a group and replicate across groups; both need >= 2 ranks, so "
        "the world size must be >= 4 and even",
        lambda c: is_hybrid(c["sharding_strategy"]) and (c["world_size"] < 4 or c["world_size"] % 2 != 0),
    ),
)

#: What checkpoints can express ([Note: invalid versus uncovered]); kept apart so they can move to the
#: engines' own capability declarations. ``dcp-reshard`` is not an axis value (its world sizes are a
#: case field, ``reshard``); these rules still read it, for cases built by hand.
CHECKPOINT_RULES: tuple[Rule, ...] = (
    Rule(
        "resume_needs_checkpoint",
        ("checkpoint", "resume_engine"),
        "resume_engine names the engine that loads a checkpoint; with checkpoint='none' nothing is saved or loaded",
        lambda c: c["resume_engine"] is not None and c["checkpoint"] == "none",
    ),
    Rule(
        "resume_engine_is_another",
        ("engine", "resume_engine"),
        "resume_engine is for resuming with another engine; the saving engine resumes when it is None",
        lambda c: c["resume_engine"] is not None and c["resume_engine"] == c["engine"],
    ),
    Rule(
        "fsdp2_no_local_state_dict",
        ("engine", "checkpoint", "resume_engine"),
        "FSDP2 has no LOCAL_STATE_DICT (no flat parameters whose local shards it could save); its checkpoints "
        "are full or sharded (torch.distributed.checkpoint)",
        lambda c: c["checkpoint"] == "local" and "torch-fsdp2" in (c["engine"], c["resume_engine"]),
    ),
    Rule(
        "local_state_dict_same_engine",
        ("checkpoint", "resume_engine"),
        "a LOCAL state dict is the saving engine's own flat shards at its own world size: only that engine, "
        "at that world size, can load it (use full or sharded to resume elsewhere)",
        lambda c: c["checkpoint"] == "local" and c["resume_engine"] is not None,
    ),
    Rule(
        "reshard_local_reference",
        ("checkpoint", "reference"),
        "a resharded run changes its world size half-way; DDP trains at one world size, the local reference "
        "replays the change",
        lambda c: c["checkpoint"] == "dcp-reshard" and c["reference"] != "local",
    ),
    Rule(
        "reshard_one_dim",
        ("checkpoint", "sharding_strategy", "resume_engine"),
        "a resharded run saves and resumes on the first ranks of the world with one engine over one flat "
        "group; hybrid strategies (2-D) and cross-engine resume are cases of their own",
        lambda c: c["checkpoint"] == "dcp-reshard" and (is_hybrid(c["sharding_strategy"]) or c["resume_engine"] is not None),
    ),
    Rule(
        "reshard_to_plain_full_precision",
        ("checkpoint", "reshard", "precision"),
        "resuming on one rank trains the plain, unwrapped model, which makes no mixed-precision casts",
        lambda c: c["checkpoint"] == "dcp-reshard" and tuple(c["reshard"])[-1:] == (1,) and c["precision"] not in ("fp32", "fp64"),
    ),
)

#: What the resumed runs (``harness.compare.resume``) cannot yet combine with the training-loop axes: a harness
#: limit, not an engine's, stated so that no such case is generated and silently run without the axis.
LOOP_RULES: tuple[Rule, ...] = (
    Rule(
        "resume_one_optimizer",
        ("checkpoint", "optimizer"),
        "a resumed run saves and loads one optimizer built over the engine's parameters; the optimizers that "
        "split parameters by name (adamw_groups, two_optimizers) are not resumed",
        lambda c: c["checkpoint"] != "none" and c["optimizer"] in ("adamw_groups", "two_optimizers"),
    ),
    Rule(
        "resume_not_compiled",
        ("checkpoint", "compile"),
        "a resumed run rebuilds the engine mid-run and does not compile the rebuilt model",
        lambda c: c["checkpoint"] != "none" and c["compile"] != "none",
    ),
)

RULES = RULES + CHECKPOINT_RULES + LOOP_RULES

_FIELDS = {f.name for f in dataclasses.fields(CaseConfig)}
_DEFAULTS: dict[str, Any] = {f.name: getattr(CaseConfig(), f.name) for f in dataclasses.fields(CaseConfig)}


def _as_mapping(case: CaseConfig | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(case, CaseConfig):
        return {name: getattr(case, name) for name in _FIELDS}
    return {**_DEFAULTS, **case}


def engine_rules(engines: Sequence[str]) -> tuple[Rule, ...]:
    """The capability rules of every engine in ``engines`` (specs), as matrix rules reading ``engine``.

    Resolving an engine checks it (``harness.engines.registry.resolve``): a bad spec raises here, at selection.
    """
    out: list[Rule] = []
    for engine in dict.fromkeys(engines):
        adapter = resolve(engine)
        out.extend(for_engine(engine, adapter.name, rule) for rule in adapter.all_rules())
    return tuple(out)


def rules_for(engines: Sequence[str]) -> tuple[Rule, ...]:
    """``RULES`` and the capability rules of ``engines``: every rule cases on those engines obey."""
    return (*RULES, *engine_rules(engines))


def invalid_reasons(case: CaseConfig | Mapping[str, Any], rules: Sequence[Rule] | None = None) -> list[str]:
    """The reason of every rule the case breaks (default: ``RULES`` and its engine's rules); a mapping
    is completed with ``CaseConfig`` defaults."""
    values = _as_mapping(case)
    if rules is None:
        rules = rules_for([values["engine"]])
    return [rule.reason for rule in rules if rule.matches(values)]


def invalid_reason(case: CaseConfig | Mapping[str, Any]) -> str | None:
    """Why no engine run should be made of this case, or None when it is valid."""
    reasons = invalid_reasons(case)
    return "; ".join(reasons) if reasons else None


# ---------------------------------------------------------------------------------------------------
# Axes


def declared_strategies(engines: Sequence[str]) -> list[str]:
    """The default strategy axis, and after it every strategy off it that one of ``engines`` declares
    (ZeRO-1/2), in ``ShardingName`` order: a selection without such an engine keeps exactly its cases."""
    extra = {s for engine in dict.fromkeys(engines) for s in resolve(engine).strategies if s not in AXES["sharding_strategy"]}
    return [*AXES["sharding_strategy"], *(s for s in FIELD_VALUES["sharding_strategy"] if s in extra)]


def resolve_axes(axes: Mapping[str, Sequence[Any]] | None = None, **fixed: Any) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """The axes to vary and the fixed field values every case shares.

    ``axes`` overrides the values of the named axes of ``AXES`` (the others keep their defaults); a
    keyword in ``fixed`` pins a field, which removes it from the axes.
    """
    merged = {name: list(values) for name, values in AXES.items()}
    for name, values in (axes or {}).items():
        if name not in AXES:
            raise ValueError(
                f"axes: unknown axis {name!r}; axes are {list(AXES)} (pin other CaseConfig fields as keywords)"
            )
        values = list(values)
        if not values:
            raise ValueError(f"axes[{name!r}] is empty; give at least one value or pin it as a keyword")
        if len(set(values)) != len(values):
            raise ValueError(f"axes[{name!r}]={values} repeats a value")
        merged[name] = values
    for name, value in fixed.items():
        if name not in _FIELDS:
            raise ValueError(f"generate: {name!r} is not a CaseConfig field; fields are {sorted(_FIELDS)}")
        if axes and name in axes:
            raise ValueError(f"generate: {name!r} is both an axis and pinned to {value!r}; give it only once")
        merged.pop(name, None)
    if "sharding_strategy" in merged and not (axes and "sharding_strategy" in axes):
        merged["sharding_strategy"] = declared_strategies(merged.get("engine", [fixed.get("engine", _DEFAULTS["engine"])]))
    for name, values in merged.items():
        for value in values:
            CaseConfig(**{name: value})  # the contract's own validation names the bad value
    base = {**_DEFAULTS, **fixed}
    CaseConfig(**base)
    return merged, base


class _Space:
    """The varying axes over a fixed base, with the feasibility search the generators share."""

    def __init__(self, axes: dict[str, list[Any]], base: dict[str, Any], rules: Sequence[Rule] | None = None) -> None:
        self.axes = axes
        self.base = base
        if rules is None:
            rules = rules_for(axes["engine"] if "engine" in axes else [base["engine"]])
        # A rule no combination of these values can match invalidates nothing here; leaving it out keeps
        # its axes out of the feasibility search (the one-valued checkpoint axes would widen it tenfold).
        self.rules = tuple(r for r in rules if self._can_match(r))
        self.order = list(axes)
        #: axes some rule reads: only these can make a case invalid, so only these are searched.
        self.constrained = [a for a in self.order if any(a in r.axes for r in self.rules)]
        #: feasibility of partial assignments to constrained axes, keyed by their sorted items.
        self._memo: dict[tuple[AxisValue, ...], dict[str, Any] | None] = {}

    def _can_match(self, rule: Rule) -> bool:
        domains = [self.axes.get(a, [self.base[a]]) for a in rule.axes]
        return any(rule.matches({**self.base, **dict(zip(rule.axes, values))}) for values in itertools.product(*domains))

    def violates(self, assign: Mapping[str, Any]) -> bool:
        """True if a rule whose axes are all known (assigned or fixed) matches."""
        known = {**self.base, **assign}
        for rule in self.rules:
            if all(a in assign or a not in self.axes for a in rule.axes) and rule.matches(known):
                return True
        return False

    def complete(self, assign: Mapping[str, Any]) -> dict[str, Any] | None:
        """A valid full assignment extending ``assign``, preferring earlier values; None if none exists."""
        if self.violates(assign):
            return None
        key = tuple((a, assign[a]) for a in self.constrained if a in assign)
        if key not in self._memo:
            self._memo[key] = self._search(dict(key))
        found = self._memo[key]
        if found is None:
            return None
        # Unconstrained axes take their first value unless given.
        return {a: assign.get(a, found.get(a, self.axes[a][0])) for a in self.order}

    def _search(self, assign: dict[str, Any]) -> dict[str, Any] | None:
        free = [a for a in self.constrained if a not in assign]
        if not free:
            return assign
        # Most constrained first: an axis sharing a rule with an assigned one fails fastest.
        def pressure(a: str) -> int:
            return -sum(1 for r in self.rules if a in r.axes and any(b in assign for b in r.axes))

        axis = min(free, key=lambda a: (pressure(a), self.order.index(a)))
        for value in self.axes[axis]:
            trial = {**assign, axis: value}
            if not self.violates(trial):
                found = self._search(trial)
                if found is not None:
                    return found
        return None

    def pairs(self) -> list[Pair]:
        """Every feasible pair, in axis order then value order."""
        out: list[Pair] = []
        for i, a in enumerate(self.order):
            for b in self.order[i + 1 :]:
                for va in self.axes[a]:
                    for vb in self.axes[b]:
                        if self.complete({a: va, b: vb}) is not None:
                            out.append(((a, va), (b, vb)))
        return out

    def case(self, assign: Mapping[str, Any]) -> CaseConfig:
        return CaseConfig(**{**self.base, **assign})


def _pairs_of(assign: Mapping[str, Any], order: Sequence[str]) -> Iterable[Pair]:
    present = [a for a in order if a in assign]
    for i, a in enumerate(present):
        for b in present[i + 1 :]:
            yield ((a, assign[a]), (b, assign[b]))


# ---------------------------------------------------------------------------------------------------
# Generators


def _full(space: _Space) -> list[CaseConfig]:
    cases = []
    for values in itertools.product(*(space.axes[a] for a in space.order)):
        assign = dict(zip(space.order, values))
        if not space.violates(assign):
            cases.append(space.case(assign))
    return cases


def _pairwise(space: _Space) -> list[CaseConfig]:
    """AETG-style greedy: each new case starts from the most-needed uncovered pair, then fills the other
    axes one at a time with the value covering the most uncovered pairs, keeping the case completable.

    Every loop covers at least its starting pair (feasible by construction), so it terminates; ties break
    by axis and value order, so the result never depends on hashing.
    """
    order = space.order
    rank = {pair: i for i, pair in enumerate(space.pairs())}
    uncovered = set(rank)
    cases: list[CaseConfig] = []
    while uncovered:
        # How many uncovered pairs each axis value still takes part in.
        need: dict[AxisValue, int] = {}
        for pair in uncovered:
            for av in pair:
                need[av] = need.get(av, 0) + 1
        start = min(uncovered, key=lambda p: (-(need[p[0]] + need[p[1]]), rank[p]))
        assign = dict(start)
        rest = sorted(
            (a for a in order if a not in assign),
            key=lambda a: (-sum(need.get((a, v), 0) for v in space.axes[a]), order.index(a)),
        )
        for axis in rest:
            best: tuple[int, int] | None = None
            choice = None
            for vi, value in enumerate(space.axes[axis]):
                trial = {**assign, axis: value}
                if space.complete(trial) is None:
                    continue
                gain = sum(
                    1 for other in assign
                    if _ordered_pair(order, (other, assign[other]), (axis, value)) in uncovered
                )
                score = (gain, need.get((axis, value), 0))
                if best is None or score > best:
                    best, choice = score, value
            assert best is not None, "a completable partial case has a completable value on every axis"
            assign[axis] = choice
        uncovered.difference_update(_pairs_of(assign, order))
        cases.append(space.case(assign))
    return cases


def _ordered_pair(order: Sequence[str], x: AxisValue, y: AxisValue) -> Pair:
    return (x, y) if order.index(x[0]) < order.index(y[0]) else (y, x)


#: The smoke cases of the training-loop axes (``LOOP_SLICE``): every value once, on original parameters
#: (FSDP1 needs them for parameter groups and compile).
LOOP_SMOKE_VARIANTS: tuple[dict[str, Any], ...] = (
    {"optimizer": "adamw_groups", "clip_grad": "norm", "grad_accum": "no_sync", "use_orig_params": True},
    {"optimizer": "two_optimizers", "grad_accum": "sync", "activation_checkpointing": "non_reentrant",
     "use_orig_params": True},
    {"activation_checkpointing": "reentrant", "clip_grad": "norm", "use_orig_params": True},
    {"compile": "compiled", "use_orig_params": True},
)

#: What each smoke case exercises on top of the baseline (the first value of every axis). Other axes are
#: moved off the baseline only where an engine needs it (e.g. FSDP2 always uses original parameters).
SMOKE_VARIANTS: tuple[dict[str, Any], ...] = (
    {},
    {"sharding_strategy": "shard_grad_op", "precision": "bf16", "backward_prefetch": "pre", "use_orig_params": True},
    {"sharding_strategy": "no_shard", "precision": "fp16", "forward_prefetch": True},
    {"precision": "reduce_only", "cpu_offload": True, "backward_prefetch": "post", "init_mode": "never"},
    # Seen only where the axes hold these values (WIDE_AXES); elsewhere they fall back to the baseline.
    {"checkpoint": "full"},
    {"checkpoint": "sharded", "optimizer": "adamw"},
    {"checkpoint": "local", "optimizer": "adamw"},
)


#: Why a case cannot be run and judged where the ranks are (``harness.compare.parity.smoke_refusal``), or None.
Refusal = Callable[[CaseConfig], "str | None"]


def _smoke(space: _Space, refuse: Refusal | None = None) -> list[CaseConfig]:
    cases: dict[str, CaseConfig] = {}
    engines = space.axes.get("engine", [None])
    for engine in engines:
        for variant in (*SMOKE_VARIANTS, *LOOP_SMOKE_VARIANTS):
            wanted = {k: v for k, v in variant.items() if k in space.axes}
            if any(v not in space.axes[k] for k, v in wanted.items()):
                continue  # this run's axes leave the variant out
            if any(k not in space.axes and space.base[k] != v for k, v in variant.items()):
                continue  # a pinned field contradicts the variant
            case = _closest_valid(space, wanted, engine, refuse)
            if case is not None:
                cases.setdefault(case.full_id, case)
    return list(cases.values())


def _closest_valid(space: _Space, wanted: dict[str, Any], engine: Any, refuse: Refusal | None = None) -> CaseConfig | None:
    """``wanted`` on ``engine`` with as few of its values dropped as validity needs (e.g. FSDP2 has no
    BACKWARD_POST, but its offload case is still worth running); the rest stays at the baseline.

    With ``refuse``, also as few as the ranks need to run it and a reference to judge it: the first
    reference of the axis that can (mixed precision at two ranks: ``local``), a value dropped only where
    no reference can (torch FSDP1's CPU offload on CPU ranks, FSDP2's NO_SHARD), so a smoke run judges
    every case it holds. A variant nothing can save is left out."""
    keys = list(wanted)
    references = space.axes.get("reference", [None]) if refuse is not None else [None]
    for n_dropped in range(len(keys) + 1):
        for dropped in itertools.combinations(keys, n_dropped):
            trial = {k: v for k, v in wanted.items() if k not in dropped}
            if engine is not None:
                trial["engine"] = engine
            for reference in references:
                assign = space.complete({**trial, "reference": reference} if reference is not None else trial)
                if assign is None:
                    continue
                case = space.case(assign)
                if refuse is None or refuse(case) is None:
                    return case
    return None


_GENERATORS: dict[str, Callable[[_Space], list[CaseConfig]]] = {
    "full": _full, "pairwise": _pairwise, "smoke": _smoke,
}


def generate(name: GeneratorName, axes: Mapping[str, Sequence[Any]] | None = None, *, refuse: Refusal | None = None,
             **fixed: Any) -> list[CaseConfig]:
    """The cases of generator ``name`` over ``AXES`` (values overridden by ``axes``; keywords pin fields).

    ``refuse`` (smoke only; ``harness.compare.parity.smoke_refusal``): why a case cannot be run and judged where the
    ranks are; the smoke generator then holds only cases that can (``_closest_valid``). Pairwise and full
    keep every valid case: those the ranks refuse are ``unsupported`` with the reason.

    Deterministic: the same arguments (and refusals) give the same cases in the same order.
    """
    if name not in _GENERATORS:
        raise ValueError(f"generate: name={name!r} is not one of {list(_GENERATORS)}")
    space = _Space(*resolve_axes(axes, **fixed))
    if name == "smoke":
        return _smoke(space, refuse)
    return _GENERATORS[name](space)


def feasible_pairs(axes: Mapping[str, Sequence[Any]] | None = None, **fixed: Any) -> set[Pair]:
    """Every pair of values of two axes that occurs in at least one valid case."""
    return set(_Space(*resolve_axes(axes, **fixed)).pairs())


def pairs_uncovered(cases: Iterable[CaseConfig], axes: Mapping[str, Sequence[Any]] | None = None, **fixed: Any) -> set[Pair]:
    """The feasible pairs (same ``axes``/keywords as ``generate``) that no valid case in ``cases`` holds."""
    space = _Space(*resolve_axes(axes, **fixed))
    uncovered = set(space.pairs())
    for case in cases:
        if invalid_reason(case) is None:
            uncovered.difference_update(_pairs_of({a: getattr(case, a) for a in space.order}, space.order))
    return uncovered
