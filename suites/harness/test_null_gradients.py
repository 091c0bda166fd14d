"""Null-gradient elements under Adam (``harness.compare.tolerance``): what a model declares, the bound Adam's
drift is held to, and the comparison that holds those elements, and only those, to it."""

from __future__ import annotations

import torch

from harness.cases.models import build_model
from harness.compare.compare import Observation, compare_observations
from harness.compare.tolerance import TolerancePolicy, adam_drift_bound
from harness.engines.adapters import ParamSlice
from harness.engines.optim import ADAMW_BETAS


def test_the_transformer_declares_every_attention_key_bias_and_their_gradient_is_zero() -> None:
    model = build_model("transformer", seed=0, rank=0, world_size=1).double()
    ranges = model.null_gradient_ranges()
    assert len(ranges) == 6, sorted(ranges)  # 2 encoder self, 2 decoder self, 2 decoder cross attentions
    inputs = model.get_input(seed=0, step=0, rank=0)
    model.get_loss(inputs, model(*inputs)).backward()
    params = dict(model.named_parameters())
    for name, (start, stop) in ranges.items():
        grad = params[name].grad
        assert grad[start:stop].abs().max() < 1e-12, name
        assert grad[:start].abs().max() > 1e-6, f"{name}: the query bias trains"
    assert build_model("nested", seed=0, rank=0, world_size=1).null_gradient_ranges() == {}


def test_two_adam_trajectories_on_noise_stay_within_the_drift_bound() -> None:
    torch.manual_seed(0)
    lr, steps = 0.01, 5
    bound = adam_drift_bound(lr, steps, ADAMW_BETAS)
    worst = 0.0
    for trial in range(200):
        a, b = torch.zeros(64, requires_grad=True), torch.zeros(64, requires_grad=True)
        opts = [torch.optim.Adam([p], lr=lr, betas=ADAMW_BETAS) for p in (a, b)]
        for _ in range(steps):
            for p, opt in zip((a, b), opts):
                # Noise of any scale, the two sides unrelated: the worst case the bound must cover.
                p.grad = torch.randn(64) * 10.0 ** torch.randint(-12, 2, (64,))
                opt.step()
        worst = max(worst, float((a - b).detach().abs().max()))
    assert worst <= bound
    assert worst > 0.5 * bound, "the bound is about as tight as the noise lets it be"
    assert adam_drift_bound(1.0, 1, ADAMW_BETAS) == 2.0  # the first step moves by lr at most


def _obs(param: list[float]) -> Observation:
    return Observation(losses=[1.0], params=[ParamSlice("attn.in_proj_bias", 0, torch.tensor(param))])


def test_only_the_held_elements_get_the_bound() -> None:
    reference = _obs([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    policy = TolerancePolicy(0.0, 1e-6).with_null_gradients({"attn.in_proj_bias": (2, 4)}, 0.05)

    def found(engine: Observation) -> dict[str, bool]:
        return {f.error.name: f.error.passed for f in compare_observations(engine, reference, policy) if f.error.name.startswith("param")}

    assert found(_obs([1.0, 2.0, 3.04, 3.96, 5.0, 6.0])) == {"param:attn.in_proj_bias[2:4]": True, "param:attn.in_proj_bias": True}
    assert found(_obs([1.0, 2.0, 3.06, 4.0, 5.0, 6.0]))["param:attn.in_proj_bias[2:4]"] is False
    assert found(_obs([1.001, 2.0, 3.0, 4.0, 5.0, 6.0]))["param:attn.in_proj_bias"] is False
    # A shard that holds only part of the range, or none of it.
    shard = Observation(losses=[1.0], params=[ParamSlice("attn.in_proj_bias", 3, torch.tensor([4.04, 5.0, 6.0]))])
    assert found(shard) == {"param:attn.in_proj_bias[2:4]": True, "param:attn.in_proj_bias": True}
    tail = Observation(losses=[1.0], params=[ParamSlice("attn.in_proj_bias", 4, torch.tensor([5.0, 6.01]))])
    assert found(tail) == {"param:attn.in_proj_bias": False}
    # Without the policy's ranges the same engine fails on the held elements.
    plain = {f.error.name: f.error.passed for f in compare_observations(_obs([1.0, 2.0, 3.04, 4.0, 5.0, 6.0]), reference, TolerancePolicy(0.0, 1e-6))}
    assert plain["param:attn.in_proj_bias"] is False
