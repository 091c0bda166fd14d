"""The adapter contract for engines we did not write (issue 38), without DeepSpeed itself: the
registry's ``deepspeed`` kind and its config file, the strategies by what they shard, the launcher
environment of the rank processes, the checkpoint declarations and the certificate's coverage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cases.case import FSDP_STRATEGIES, ZERO_STRATEGIES
from harness.collect.coverage import coverage_lines, family_coverage, verdict
from harness.engines.checkpoint import unsupported_checkpoint
from harness.engines.deepspeed_adapter import DEFAULT_REDUCE_BUCKET, bucket_sized_to_model, merged_config, neutral_config
from harness.engines.registry import EngineSpecError, check_engines, resolve
from harness.ranks.placement import hybrid_shard_size
from harness.ranks.pool import PoolConfig, RankPool
from harness.selection.matrix import AXES, generate, invalid_reason
from suites.plugins import contract_jobs

DEEPSPEED = ("deepspeed-zero1", "deepspeed-zero2", "deepspeed-zero3")


def test_each_stage_maps_the_strategy_of_what_it_shards() -> None:
    assert [resolve(e).strategies for e in DEEPSPEED] == [("zero1",), ("zero2",), ("full_shard",)]
    assert resolve("builtin").strategies == FSDP_STRATEGIES


def test_zero_strategies_join_the_axis_only_for_engines_that_declare_them() -> None:
    assert not set(ZERO_STRATEGIES) & set(AXES["sharding_strategy"])
    assert {c.sharding_strategy for c in generate("pairwise")} <= set(FSDP_STRATEGIES)
    mixed = generate("pairwise", axes={"engine": ["builtin", "deepspeed-zero1"]})
    assert {c.sharding_strategy for c in mixed if c.engine == "deepspeed-zero1"} == {"zero1"}
    assert not any(c.sharding_strategy in ZERO_STRATEGIES for c in mixed if c.engine == "builtin")
    reason = invalid_reason({"engine": "builtin", "sharding_strategy": "zero2"})
    assert reason is not None and "maps only the strategies" in reason


def test_a_config_file_overrides_the_neutral_defaults_key_by_key(tmp_path: Path) -> None:
    assert neutral_config(2)["gradient_clipping"] == 0.0  # DeepSpeed's own default clips to 1.0
    merged = merged_config(neutral_config(3), {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0})
    assert merged["zero_optimization"] == {"stage": 2} and merged["gradient_clipping"] == 1.0
    config = tmp_path / "mine.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    (spec,) = check_engines([f"mine=deepspeed:{config}"])
    adapter = resolve(spec)
    assert adapter.name == "mine" and adapter.strategies == ("zero1",) and adapter.config["gradient_clipping"] == 0.0


def test_the_reduce_bucket_is_no_larger_than_the_model_unless_the_config_says() -> None:
    config = neutral_config(3)
    # DeepSpeed allocates its whole reduce bucket: a model of 1,000 elements gets a bucket of 1,000, which
    # holds every gradient as the default's does.
    assert bucket_sized_to_model(config, {}, 1_000)["zero_optimization"] == {"stage": 3, "reduce_bucket_size": 1_000}
    assert bucket_sized_to_model(config, {}, 10**10)["zero_optimization"]["reduce_bucket_size"] == DEFAULT_REDUCE_BUCKET
    assert config["zero_optimization"] == {"stage": 3}, "the engine's own config is left as it was"
    mine = {"zero_optimization": {"reduce_bucket_size": 123}}
    assert bucket_sized_to_model(merged_config(config, mine), mine, 1_000)["zero_optimization"]["reduce_bucket_size"] == 123


def test_the_deepspeed_kind_wins_over_module_object_and_refuses_bad_files(tmp_path: Path) -> None:
    # "deepspeed" is an API kind: never imported as a module for MODULE:OBJECT, even where it is installed.
    with pytest.raises(EngineSpecError, match="does not exist"):
        check_engines([f"mine=deepspeed:{tmp_path / 'missing.json'}"])
    bad = tmp_path / "stage0.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    with pytest.raises(EngineSpecError, match="zero_optimization.stage=0"):
        check_engines([f"mine=deepspeed:{bad}"])


def test_a_config_path_with_a_comma_is_refused_in_one_line(tmp_path: Path) -> None:
    path = tmp_path / "a,b.json"
    path.write_text("{}")
    with pytest.raises(EngineSpecError, match="comma") as info:
        check_engines(f"builtin,mine=deepspeed:{path}".split(","))
    assert "\n" not in str(info.value)
    with pytest.raises(EngineSpecError, match="comma"):
        resolve(f"mine2=deepspeed:{path}")


def test_engines_that_own_their_step_declare_checkpoints_never_error() -> None:
    ds, builtin = resolve("deepspeed-zero3"), resolve("builtin")
    assert unsupported_checkpoint(ds, ds, "sharded", True) is None
    assert unsupported_checkpoint(ds, builtin, "full", True) is None  # the neutral full state dict
    assert "own format" in (unsupported_checkpoint(ds, builtin, "sharded", True) or "")
    assert "no local checkpoint" in (unsupported_checkpoint(ds, ds, "local", True) or "")


def test_rank_processes_carry_torchruns_one_node_environment() -> None:
    with RankPool(PoolConfig(world_size=2, case_timeout_s=120.0)) as pool:
        outcome = pool.run(contract_jobs.launcher_environment, None)
    assert outcome.status == "ok", outcome.reason
    for rank, seen in enumerate(outcome.values):
        env = seen["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(rank), str(rank), "2", "2")
        assert env["MASTER_ADDR"] and env["MASTER_PORT"] and seen["ctx"] == (rank, rank, 2, 2)
        # Our engine's default hybrid groups read LOCAL_WORLD_SIZE: one node of every rank, as under torchrun.
        assert seen["node_size"] == 2
    # The harness's hybrid cases pass their groups explicitly, from the context (local world = world): at 4
    # ranks two shard groups of 2, as before the launcher variables.
    assert hybrid_shard_size({}, 4, 4) == 2 and hybrid_shard_size({}, 8, 8) == 4


def test_coverage_names_what_never_ran_and_makes_the_certificate_partial() -> None:
    declared = {"sharding_strategy": ["full_shard", "no_shard"], "precision": ["fp32", "bf16"]}
    ran = [{"sharding_strategy": "full_shard", "precision": "fp32"}]
    ddp = family_coverage("parity-ddp", ran, declared)
    local = family_coverage("parity-local", ran, declared)
    # DDP cannot judge mixed precision by design: bf16 is out of its scope, not missing.
    assert ddp == {"sharding_strategy": ["no_shard"], "precision": []}
    assert local == {"sharding_strategy": ["no_shard"], "precision": ["bf16"]}
    assert verdict(True, {"parity-local": local}) == "PARTIAL" and verdict(False, {}) == "DOES NOT CONFORM"
    full = [{"sharding_strategy": s, "precision": p} for s in declared["sharding_strategy"] for p in declared["precision"]]
    assert verdict(True, {"parity-local": family_coverage("parity-local", full, declared)}) == "CONFORMS"
    assert coverage_lines({"parity-local": local}) == ["parity-local: never exercised sharding_strategy no_shard; precision bf16"]


def test_the_neutral_full_state_holds_every_name_of_the_unwrapped_models_state_dict() -> None:
    """A neutral full checkpoint saved from parameters alone missed the transformer's tied head and its
    buffers, and our engine's strict load refused it (Megatron-FSDP saved, on two GPUs): the saved state
    names what the unwrapped model's ``state_dict`` names, a tied name with its source's value."""
    import torch

    from harness.cases.models import build_model
    from harness.engines.adapters import canonical_name
    from harness.engines.owned_step import neutral_model_state

    model = build_model("transformer", seed=0, rank=0, world_size=2)
    params = {canonical_name(n): p.detach().clone() for n, p in model.named_parameters()}
    state = neutral_model_state(model, params, canonical_name)
    expected = model.state_dict()
    assert set(state) == set(expected) > set(params), sorted(set(expected) ^ set(state))
    assert all(torch.equal(state[k], v.cpu()) for k, v in expected.items())
    tied = sorted(set(expected) - set(params) - {n for n, _ in model.named_buffers()})
    assert tied and all(any(state[t] is state[p] for p in params) for t in tied), tied
