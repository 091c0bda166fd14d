"""The model zoo: small models with deterministic init, deterministic batches and declared wrap units.

Every model is a :class:`ZooModel` (``harness.cases.model_protocol``). What the harness needs from one:

- ``build_model(name, seed=, rank=, world_size=)``: the same parameters for the same ``seed`` on every
  rank and every call (rank-local parameters, the experts of a mixture of experts, also depend on
  ``rank``), built on CPU in float32 without touching the global RNG;
- ``get_input(seed=, step=, rank=)``: the forward arguments of one rank at one step, a pure function
  of ``(seed, step, rank)`` built on CPU (the caller moves and casts them);
- ``get_loss(inputs, output)`` and ``run_backward(loss)``;
- ``wrap_units()``: the submodules that become their own sharded unit (FSDP1-API engines wrap them
  bottom-up, FSDP2 applies ``fully_shard`` to each), ``wrap_classes`` when the units are "every
  instance of these classes" (a ``ModuleWrapPolicy``-style set);
- ``rank_local_modules()``: submodules whose parameters belong to one rank and are never reduced
  across ranks (the experts): engines put them in a one-rank group, DDP ignores them, and the
  ``local`` reference keeps one copy per rank;
- ``sleeps``: GPU sleeps before the gradient reduction, before the optimizer step and before the
  experts' parameters are freed. They make races between the compute stream and the engine's
  communication streams visible; on CPU there is no asynchronous queue to race, so they are no-ops.

The zoo is one registry, ``MODELS``: the harness's own models (``zoo_names()``: what the matrix, ``harness
models`` and the zoo's tests enumerate) and the models suites add with ``register_model`` (built by
name like any other, never enumerated with the harness's own). The library never imports a suite.

Deliberately the harness's own models (written for this project, shaped after the behaviours the
ported tests describe), so a change in PyTorch's test utilities never changes what a case means.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.cases.model_protocol import (
    SleepPlan,
    ZooModel,
    batch_generator,
    gpu_sleep,
    mix_seed,
    seeded,
    to_device,
    wrap_bottom_up,
)

__all__ = [
    "MODELS",
    "BenchmarkGPT",
    "GPTConfig",
    "ModelSpec",
    "SequentialModel",
    "SleepPlan",
    "ZooModel",
    "build_model",
    "batch_generator",
    "gpu_sleep",
    "mix_seed",
    "register_model",
    "registering_modules",
    "to_device",
    "wrap_bottom_up",
    "zoo_names",
]

# ---------------------------------------------------------------------------------------------------
# Nested linears (units chosen by hand) and the same model with every submodule a unit


class SequentialModel(ZooModel):
    """A model whose layers are one ``nn.Sequential``, ``module``, fed a uniform ``(4, d_input)`` batch;
    its loss is the output's sum. Subclasses build ``module`` and choose the units."""

    #: features of the input batch (the first layer's input width).
    d_input: ClassVar[int] = 8
    module: nn.Sequential

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    def get_input(self, *, seed: int, step: int, rank: int) -> tuple[torch.Tensor, ...]:
        return (torch.rand(4, self.d_input, generator=batch_generator(seed, step, rank)),)

    def get_loss(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return output.sum()


class NestedModel(SequentialModel):
    """Four linears, two of them nested in a sequential; three hand-picked units plus the root.

    The root unit keeps the first and last linear, so it holds parameters used at both ends of the
    forward pass; the nested unit holds a unit of its own.
    """

    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Sequential(
            nn.Linear(8, 4),
            nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16)),
            nn.Linear(16, 4),
            nn.Linear(4, 8),
        )

    def wrap_units(self) -> list[nn.Module]:
        return [self.module[1], self.module[1][0], self.module[2]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Straight-line calls rather than ``nn.Sequential``'s loop: Dynamo before torch 2.13 cannot
        # resume after a graph break (a unit's eager hooks) inside a loop over modules, and gives up
        # the whole frame, so under torch.compile on torch 2.11 this model compiled no graph at all.
        m = self.module
        return m[3](m[2](m[1](m[0](x))))


class AlwaysWrapModel(NestedModel):
    """The nested model with every submodule its own unit (``always_wrap_policy``)."""

    def wrap_units(self) -> list[nn.Module]:
        return [m for m in self.modules() if m is not self]


# ---------------------------------------------------------------------------------------------------
# Transformer with tied input and output embeddings


class TransformerModel(ZooModel):
    """Encoder-decoder transformer whose output projection shares the embedding's weight.

    The tied weight lives in the root unit; the encoder and decoder layers are units. Two buffers
    (a float and an integer one) check that engines leave buffers usable. With ``batch_norm`` a
    BatchNorm normalizes the target embeddings: a module class FSDP1's mixed precision keeps in full
    precision in a unit of its own (built last, so the other parameters are the same either way).
    """

    wrap_classes = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    vocab = 23
    d_model = 16
    batch = 2

    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(self.vocab, self.d_model)
        # dropout=0: a parity case compares two runs element by element.
        with warnings.catch_warnings():
            # The nested-tensor fast path needs batch_first; it is an inference speed-up only.
            warnings.filterwarnings("ignore", message="enable_nested_tensor is True")
            self.transformer = nn.Transformer(
                d_model=self.d_model, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                dim_feedforward=8, dropout=0.0,
            )
        self.output_proj = nn.Linear(self.d_model, self.vocab)
        self.output_proj.weight = self.embed_tokens.weight
        self.register_buffer("vocab_bias", torch.ones(self.d_model))
        self.register_buffer("long_buffer", torch.zeros(self.d_model, dtype=torch.long))
        self.bn = nn.BatchNorm1d(self.d_model) if batch_norm else None

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        emb = self.embed_tokens(src_ids)
        # Buffers join the activations in the activations' dtype, as real models do: a buffer dtype
        # other than the compute dtype (fp16 parameters, bf16 buffers) then rounds the buffer instead
        # of promoting every later matmul input to fp32.
        src = emb + self.vocab_bias.to(emb.dtype) + self.long_buffer.to(emb.dtype)
        tgt = self.embed_tokens(tgt_ids)
        if self.bn is not None:
            # T x B x C -> T x C x B: BatchNorm1d normalizes dim 1.
            tgt = self.bn(tgt.transpose(1, 2)).transpose(1, 2)
        return self.output_proj(self.transformer(src, tgt))

    def get_input(self, *, seed: int, step: int, rank: int) -> tuple[torch.Tensor, ...]:
        g = batch_generator(seed, step, rank)
        src = torch.randint(self.vocab, (6, self.batch), generator=g)  # T x B
        tgt = torch.randint(self.vocab, (4, self.batch), generator=g)
        return (src, tgt)

    def get_loss(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        _, tgt = inputs
        return F.cross_entropy(output.view(-1, output.size(-1)), tgt.view(-1), reduction="sum")


# ---------------------------------------------------------------------------------------------------
# Mixture of experts: the expert is rank-local and reduced by nobody


class MixtureOfExpertsModel(SequentialModel):
    """A shared linear and a rank-local expert between two plain linears.

    The expert's parameters differ per rank (seeded by rank) and its gradient is never reduced:
    the model does its own expert reduction, which is none. The shared linear is an ordinary unit.
    """

    d_input, d_shared, d_expert = 8, 12, 23

    def __init__(self, seed: int, rank: int, sleeps: SleepPlan = SleepPlan()) -> None:
        super().__init__()
        self.sleeps = sleeps
        with seeded(mix_seed(seed, 0xE4, rank)):
            expert = nn.Linear(self.d_expert, self.d_shared)
        # Everything else is the same on every rank (the caller seeded with ``seed``).
        shared = nn.Linear(self.d_shared, self.d_expert)
        self.module = nn.Sequential(
            nn.Linear(self.d_input, self.d_shared), shared, expert, nn.Linear(self.d_shared, self.d_input)
        )
        if sleeps.before_free_ms > 0:
            # A forward hook on the expert itself runs inside the engine's unit, after the expert's
            # compute and before the engine's post-forward frees its unsharded parameters.
            expert.register_forward_hook(self._sleep_before_free)

    def _sleep_before_free(self, module: nn.Module, args: object, output: torch.Tensor) -> None:
        gpu_sleep(self.sleeps.before_free_ms, output.device)

    def wrap_units(self) -> list[nn.Module]:
        return [self.module[1], self.module[2]]

    def rank_local_modules(self) -> list[nn.Module]:
        return [self.module[2]]


# ---------------------------------------------------------------------------------------------------
# LoRA-style: frozen base weights, trainable low-rank adapters


class LoraAdapter(nn.Module):
    """The trainable low-rank update ``B @ A``."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lora_b(self.lora_a(x))


class LoraLinear(nn.Module):
    """A frozen linear plus a trainable adapter."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.adapter = LoraAdapter(dim, rank)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.adapter(x)


class LoraModel(ZooModel):
    """A partly frozen model; every unit holds only frozen or only trainable parameters.

    ``use_orig_params=False`` needs that (one flat parameter has one ``requires_grad``): the frozen
    input projection stays in the root, each frozen base linear is the direct content of its
    ``LoraLinear`` unit, each adapter and the trainable head are units of their own.
    """

    wrap_classes = (LoraLinear, LoraAdapter)

    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(8, 16)
        self.proj_in.requires_grad_(False)
        self.blocks = nn.Sequential(LoraLinear(16, 2), nn.ReLU(), LoraLinear(16, 2))
        self.head = nn.Linear(16, 4)

    def wrap_units(self) -> list[nn.Module]:
        return super().wrap_units() + [self.head]

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.proj_in(x)))

    def get_input(self, *, seed: int, step: int, rank: int) -> tuple[torch.Tensor, ...]:
        g = batch_generator(seed, step, rank)
        return (torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g))

    def get_loss(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, inputs[1].to(output.dtype), reduction="sum")


# ---------------------------------------------------------------------------------------------------
# BatchNorm


class BatchNormModel(ZooModel):
    """Linear, BatchNorm, ReLU, linear; the BatchNorm is its own unit.

    In training mode BatchNorm normalizes with the batch's statistics, so each rank's output
    depends only on its own batch; the running statistics (buffers) differ per rank and are not
    compared.
    """

    wrap_classes = (nn.BatchNorm1d,)

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.relu(self.bn(self.fc1(x))))

    def get_input(self, *, seed: int, step: int, rank: int) -> tuple[torch.Tensor, ...]:
        g = batch_generator(seed, step, rank)
        return (torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g))

    def get_loss(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, inputs[1].to(output.dtype), reduction="sum")


# ---------------------------------------------------------------------------------------------------
# Tiny GPT with tied embeddings


class GPTBlock(nn.Module):
    """Pre-norm block: causal self-attention and a 4x MLP.

    ``bias=False`` drops the linears' biases (the LayerNorms keep theirs): the benchmark's GPT
    (``harness.perf.benchmark``) is built of these blocks, and its parameter count is the measured anchors'.
    """

    def __init__(self, dim: int, heads: int, bias: bool = True) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"GPTBlock: heads={heads} must divide dim={dim}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=bias), nn.GELU(), nn.Linear(4 * dim, dim, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(ZooModel):
    """Token and position embeddings, two blocks, final norm, LM head tied to the token embedding."""

    wrap_classes = (GPTBlock,)
    vocab, dim, heads, layers, seq, batch = 32, 16, 2, 2, 8, 2

    def __init__(self) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(self.vocab, self.dim)
        self.pos_emb = nn.Embedding(self.seq, self.dim)
        self.blocks = nn.ModuleList(GPTBlock(self.dim, self.heads) for _ in range(self.layers))
        self.ln_f = nn.LayerNorm(self.dim)
        self.lm_head = nn.Linear(self.dim, self.vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def get_input(self, *, seed: int, step: int, rank: int) -> tuple[torch.Tensor, ...]:
        tokens = torch.randint(self.vocab, (self.batch, self.seq + 1), generator=batch_generator(seed, step, rank))
        return (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def get_loss(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.reshape(-1, self.vocab), inputs[1].reshape(-1))


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the benchmark's GPT; the defaults are the measured anchors' model (936.5M parameters)."""

    #: vocabulary size (token embedding rows, LM-head columns).
    vocab: int = 32000
    #: model width.
    d_model: int = 2048
    #: transformer blocks (each one unit).
    layers: int = 16
    #: attention heads; must divide ``d_model``.
    heads: int = 16
    #: tokens per sequence.
    seq: int = 2048
    #: sequences per rank per step.
    batch: int = 8

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "layers", "heads", "seq", "batch"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)} must be at least 1")
        if self.d_model % self.heads:
            raise ValueError(f"GPTConfig.heads={self.heads} must divide d_model={self.d_model}")

    @property
    def tokens_per_rank(self) -> int:
        return self.batch * self.seq


class BenchmarkGPT(ZooModel):
    """The benchmark's GPT: token embedding, bias-free ``GPTBlock`` blocks, final norm, untied LM head.

    No learned positions and no tie: the benchmark measures engines, and the anchors' parameter count
    has neither. Every block is a unit. The loss is taken in float32 whatever the compute dtype.
    """

    wrap_classes = (GPTBlock,)

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(GPTBlock(cfg.d_model, cfg.heads, bias=False) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def get_input(self, *, seed: int, step: int, rank: int) -> tuple[torch.Tensor, ...]:
        cfg = self.cfg
        tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=batch_generator(seed, step, rank))
        return (tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())

    def get_loss(self, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.float().reshape(-1, output.size(-1)), inputs[1].reshape(-1))


#: the benchmark GPT small enough for two gloo ranks on two CPU cores (``harness perf`` on CPU).
CPU_GPT = GPTConfig(vocab=512, d_model=64, layers=2, heads=4, seq=64, batch=4)


# ---------------------------------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class ModelSpec:
    """One entry of the zoo."""

    #: the ``CaseConfig.model`` value.
    name: str
    #: one line for listings and reports.
    description: str
    #: builds the model from ``(seed, rank, world_size)``; ``build_model`` calls it under a seed of its own.
    factory: Callable[[int, int, int], ZooModel]
    #: enumerated with the harness's own models (``zoo_names()``: the matrix, ``harness models``, the
    #: zoo's tests); False for models built by name only (the benchmark's GPT, suites' registrations).
    listed: bool = True


#: Sleep length of the ``moe_sleep_*`` models: long next to the microseconds the kernels of these
#: models take, so a missing stream wait shows, short enough for a matrix run.
SLEEP_MS = 50.0


def _moe(sleeps: SleepPlan) -> Callable[[int, int, int], ZooModel]:
    return lambda seed, rank, world_size: MixtureOfExpertsModel(seed, rank, sleeps)


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec("nested", "four linears, three hand-picked nested units", lambda s, r, w: NestedModel()),
        ModelSpec("always_wrap", "the nested model with every submodule a unit", lambda s, r, w: AlwaysWrapModel()),
        ModelSpec("transformer", "encoder-decoder transformer, output projection tied to the embedding",
                  lambda s, r, w: TransformerModel()),
        ModelSpec("moe", "mixture of experts: rank-local expert, never reduced", _moe(SleepPlan())),
        ModelSpec("moe_sleep_reduce", "moe with a GPU sleep before each gradient reduction",
                  _moe(SleepPlan(before_reduce_ms=SLEEP_MS))),
        ModelSpec("moe_sleep_step", "moe with a GPU sleep before the optimizer step",
                  _moe(SleepPlan(before_step_ms=SLEEP_MS))),
        ModelSpec("moe_sleep_free", "moe with a GPU sleep before the expert's parameters are freed",
                  _moe(SleepPlan(before_free_ms=SLEEP_MS))),
        ModelSpec("lora", "LoRA-style: frozen base linears, trainable adapters and head", lambda s, r, w: LoraModel()),
        ModelSpec("batchnorm", "linear, BatchNorm (its own unit), linear", lambda s, r, w: BatchNormModel()),
        ModelSpec("gpt", "tiny GPT, LM head tied to the token embedding", lambda s, r, w: TinyGPT()),
        # The perf benchmark's model at its CPU size; ``harness perf`` builds its sizes from ``GPTConfig``.
        ModelSpec("perf_gpt", "the perf benchmark's bias-free GPT at its CPU size", lambda s, r, w: BenchmarkGPT(CPU_GPT),
                  listed=False),
    )
}


def zoo_names() -> list[str]:
    """The harness's own models, in registry order: what the matrix, listings and the zoo's tests
    enumerate (models added by ``register_model`` are built by name only)."""
    return [name for name, spec in MODELS.items() if spec.listed]


Factory = Callable[[int, int, int], ZooModel]
#: where each registered model was defined: a second registration from the same place is the same model.
_origins: dict[str, tuple[str | None, str | None]] = {}


def register_model(name: str, description: str, factory: Factory | None = None) -> Any:
    """Add a model to the zoo under ``name``; suites call it for the models their own tests need.

    ``register_model(name, description, factory)`` registers ``factory(seed, rank, world_size)``;
    without ``factory`` it returns a decorator for a factory or for a ``ZooModel`` subclass built
    without arguments. ``build_model`` seeds the construction; the model is never enumerated with the
    harness's own (``zoo_names()``). Registering the same definition again (a module imported twice)
    is a no-op; another definition under a taken name is refused.
    """
    def add(target: Any) -> Any:
        build: Factory = (lambda s, r, w: target()) if isinstance(target, type) else target
        spec = ModelSpec(name, description, build, listed=False)
        taken = MODELS.get(name)
        origin = (getattr(target, "__module__", None), getattr(target, "__qualname__", None))
        if taken is not None and (taken.listed or taken.description != description
                                  or _origins.get(name) != origin):
            raise ValueError(f"register_model: name={name!r} is taken in harness.cases.models.MODELS "
                             f"({taken.description!r}); register this model under another name")
        if taken is None:
            MODELS[name] = spec
            _origins[name] = origin
        return target

    return add if factory is None else add(factory)


def registering_modules() -> tuple[str, ...]:
    """The modules that registered models with ``register_model``, importable by name: a spawned rank
    process imports them (``harness.ranks.rank_process``) to build those models by name as this process does."""
    return tuple(sorted({module for module, _ in _origins.values() if module and module != "__main__"}))


def build_model(name: str, *, seed: int = 0, rank: int = 0, world_size: int = 1) -> ZooModel:
    """Build zoo model ``name`` on CPU in float32, deterministically in ``seed`` (and ``rank`` for
    rank-local parameters), leaving the global RNG as it was."""
    try:
        spec = MODELS[name]
    except KeyError:
        raise ValueError(f"model={name!r} is not in harness.cases.models.MODELS; choose one of {sorted(MODELS)}") from None
    with seeded(mix_seed(seed, 0x5EED)):
        return spec.factory(seed, rank, world_size)
