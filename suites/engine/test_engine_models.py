"""The checks' own models draw their initial weights from the CPU's generator wherever they live, so a
twin built on the CPU and moved to a GPU after wrapping (the torch tests' CUDA_AFTER) starts from the weights
of one built on the GPU (DDP's side): on two NCCL GPUs the use_orig_params ported check failed at its first loss
without it."""

from __future__ import annotations

import pytest
from torch.testing import assert_close

from harness.conformance.engine_models import MixtureOfExperts, NestedWrapped, SharedTransformer
from harness.pytest_plugin import needs_gpus

BUILDERS = {
    "nested": NestedWrapped,
    "transformer": SharedTransformer,
    "moe": lambda device: MixtureOfExperts(1, device),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_meta_model_stays_on_meta(name: str) -> None:
    model = BUILDERS[name]("meta")
    assert {p.device.type for p in model.parameters()} == {"meta"}


def test_the_tied_projection_stays_tied() -> None:
    model = SharedTransformer("cpu")
    assert model.proj.weight is model.embed.weight


@needs_gpus(1, "a model built on a CUDA device")
@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_model_built_on_a_gpu_has_the_cpu_built_weights(name: str) -> None:
    on_gpu, on_cpu = BUILDERS[name]("cuda"), BUILDERS[name]("cpu")
    pairs = list(zip(on_gpu.state_dict().items(), on_cpu.state_dict().items()))
    assert pairs and all(g.device.type == "cuda" for (_, g), _ in pairs)
    for (name_gpu, g), (name_cpu, c) in pairs:
        assert name_gpu == name_cpu
        assert_close(g.cpu(), c, rtol=0, atol=0, msg=lambda m, n=name_gpu: f"{n}: {m}")
