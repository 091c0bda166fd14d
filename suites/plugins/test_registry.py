"""The engine registry: specs, entry points, one-line errors, capability rules in the matrix.

In-process and pure apart from imports: plug-in namespaces are small modules written to a temporary
directory (outside the repository) and put on ``sys.path``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harness.cases.capabilities import Rule
from harness.cases.case import CaseConfig
from harness.engines.adapters import EngineAdapter, FSDP1Adapter
from harness.engines.fsdp2_adapter import FSDP2Adapter
from harness.engines.registry import EngineSpecError, check_engines, fsdp1_engines, register, resolve
from harness.selection.matrix import feasible_pairs, generate, invalid_reason, pairs_uncovered
from reports.certificate import Certificate, FamilyResult, Failure, markdown, render_html, to_json

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Plug-in modules outside the repository: a full FSDP1 namespace, one missing a name, factories."""
    (tmp_path / "full_ns.py").write_text("from engine import *\n")
    (tmp_path / "half_ns.py").write_text(
        "from engine import FullyShardedDataParallel, ShardingStrategy, BackwardPrefetch, CPUOffload\n"
    )
    (tmp_path / "factories.py").write_text(textwrap.dedent("""
        from harness.cases.capabilities import Rule
        from harness.engines.adapters import FSDP1Adapter

        class NoOffload(FSDP1Adapter):
            def capability_rules(self):
                return (Rule("no_offload", ("cpu_offload",), "offload is not implemented", lambda c: c["cpu_offload"]),)

        def good(name):
            return NoOffload(name, "engine")

        def broken(name):
            raise RuntimeError("needs the vendor runtime, which is not installed")

        def not_an_adapter():
            return 42

        instance = FSDP1Adapter("ignored", "engine")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    resolve.cache_clear()
    yield tmp_path
    resolve.cache_clear()


def test_builtin_engines_are_ordinary_registrations() -> None:
    assert isinstance(resolve("builtin"), FSDP1Adapter) and resolve("builtin").fsdp1_module == "engine"
    assert resolve("torch-fsdp").fsdp1_module == "torch.distributed.fsdp"
    assert isinstance(resolve("torch-fsdp2"), FSDP2Adapter) and resolve("torch-fsdp2").fsdp1_module is None
    assert fsdp1_engines(["torch-fsdp2", "builtin", "torch-fsdp"]) == ("builtin", "torch-fsdp")


def test_specs_resolve_to_adapters_named_by_the_spec(plugins: Path) -> None:
    fsdp1 = resolve("mine=fsdp1:full_ns")
    assert isinstance(fsdp1, FSDP1Adapter) and fsdp1.name == "mine" and fsdp1.fsdp1_module == "full_ns"
    fsdp2 = resolve("two=fsdp2:torch.distributed.fsdp")
    assert isinstance(fsdp2, FSDP2Adapter) and fsdp2.name == "two"
    made = resolve("f=factories:good")
    assert made.name == "f" and made.unsupported({"cpu_offload": True}) == "offload is not implemented"
    assert resolve("inst=factories:instance").name == "inst"
    assert fsdp1_engines(["mine=fsdp1:full_ns", "two=fsdp2:torch.distributed.fsdp"]) == ("mine=fsdp1:full_ns",)


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ("bogus", ["'bogus'", "not registered", "builtin"]),
        ("mine=fsdp1:no_such_pkg", ["'mine=fsdp1:no_such_pkg'", "'no_such_pkg'"]),
        ("mine=fsdp1:half_ns", ["'mine=fsdp1:half_ns'", "MixedPrecision"]),
        ("mine=fsdp2:full_ns", ["'mine=fsdp2:full_ns'", "fully_shard"]),
        ("mine=factories:broken", ["'mine=factories:broken'", "RuntimeError", "vendor runtime"]),
        ("mine=factories:missing", ["'mine=factories:missing'", "missing"]),
        ("mine=factories:not_an_adapter", ["'mine=factories:not_an_adapter'", "EngineAdapter"]),
        ("mine=nonsense", ["'mine=nonsense'", "fsdp1:MODULE"]),
        # An unknown API kind is named, with the known ones (not "cannot import module 'fsdp3'").
        ("mine=fsdp3:engine", ["'fsdp3' is no API kind", "known: fsdp1, fsdp2"]),
        # A spec reusing a registered name: refused, naming both.
        ("builtin=fsdp1:engine", ["'builtin=fsdp1:engine'", "already the registered engine 'builtin'"]),
    ],
)
def test_a_bad_spec_is_one_line_naming_the_engine_and_what_is_missing(plugins: Path, spec: str, names: list[str]) -> None:
    with pytest.raises(EngineSpecError) as info:
        check_engines([spec], "--engines")
    message = str(info.value)
    assert "\n" not in message and message.startswith("--engines: ")
    for name in names:
        assert name in message


def test_check_engines_refuses_repeats_and_empty_lists() -> None:
    with pytest.raises(EngineSpecError, match="--engine: engine name"):
        check_engines(["builtin", "builtin=fsdp1:engine"], "--engine")
    with pytest.raises(EngineSpecError, match="--engine: give at least one"):
        check_engines([" "], "--engine")


def test_register_adds_a_name_and_refuses_spec_characters() -> None:
    register("also-builtin", lambda name: FSDP1Adapter(name, "engine"))
    assert resolve("also-builtin").name == "also-builtin"
    with pytest.raises(EngineSpecError, match="must be non-empty"):
        register("a=b", lambda name: FSDP1Adapter(name, "engine"))


def test_case_engine_is_a_spec_and_ids_use_its_name() -> None:
    case = CaseConfig(engine="mine=fsdp1:pkg")
    assert case.engine_name == "mine" and case.full_id.startswith("mine:ddp:")
    assert CaseConfig.from_dict(case.to_dict()) == case
    with pytest.raises(ValueError, match="CaseConfig.engine"):
        CaseConfig(engine="")


# --- capabilities in the matrix ------------------------------------------------------------------------


def test_fsdp2_rules_live_on_its_adapter_and_prune_the_matrix() -> None:
    reasons = [r.name for r in resolve("torch-fsdp2").capability_rules()]
    assert reasons == ["fsdp2_has_no_flat_params", "fsdp2_backward_prefetch"]
    # FSDP1's API itself (parameter groups and compile need original parameters), torch FSDP1's own limit besides.
    assert [r.name for r in resolve("builtin").capability_rules()] == [
        "fsdp1_named_optimizers_need_orig_params", "fsdp1_compile_needs_orig_params"]
    assert [r.name for r in resolve("torch-fsdp").capability_rules()][-1] == "fsdp1_accumulation_with_offload"
    assert "use_orig_params=False does not exist" in invalid_reason(CaseConfig(engine="torch-fsdp2", backward_prefetch="pre"))


def test_a_plugged_engines_rules_prune_without_editing_the_matrix(plugins: Path) -> None:
    spec = "nooff=factories:good"
    axes = {"engine": ["builtin", spec], "cpu_offload": [False, True], "precision": ["fp32", "bf16"]}
    cases = generate("full", axes=axes)
    assert not [c for c in cases if c.engine == spec and c.cpu_offload]
    assert [c for c in cases if c.engine == "builtin" and c.cpu_offload]
    assert invalid_reason(CaseConfig(engine=spec, cpu_offload=True)) == "nooff: offload is not implemented"
    # The pairwise generator stays exact: every feasible pair is covered, the infeasible one is not a pair.
    pairs = feasible_pairs(axes=axes)
    assert (("engine", spec), ("cpu_offload", True)) not in pairs
    assert pairs_uncovered(generate("pairwise", axes=axes), axes=axes) == set()


def test_an_unknown_engine_in_the_matrix_fails_at_selection() -> None:
    with pytest.raises(EngineSpecError, match="'nobody'"):
        generate("smoke", axes={"engine": ["nobody"]})


def test_rules_are_plain_data() -> None:
    rule = Rule("r", ("precision",), "why", lambda c: c["precision"] == "bf16")
    assert isinstance(resolve("builtin"), EngineAdapter) and rule.matches({"precision": "bf16"})


# --- front ends: one line, exit status 2 -------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["list", "--engines", "bogus"], "--engines: engine 'bogus' is not registered"),
        (["list", "--engines", "mine=fsdp1:no_such_pkg"], "--engines: engine 'mine=fsdp1:no_such_pkg'"),
        (["certify", "--engine", "mine=fsdp1:no_such_pkg", "--quick"], "--engine: engine 'mine=fsdp1:no_such_pkg'"),
    ],
)
def test_cli_refuses_a_bad_engine_before_running_anything(tmp_path: Path, argv: list[str], needle: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "harness", *argv, *(["--out", str(tmp_path / "c")] if argv[0] == "certify" else [])],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env={**_env()})
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if needle in line]
    assert len(lines) == 1, proc.stderr
    assert not (tmp_path / "c" / "results.jsonl").exists()


def test_pytest_refuses_a_bad_engine_with_one_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "pytest", "suites/seeds/test_fsdp_core.py", "--engine", "mine=fsdp1:half_missing_pkg",
                           "-p", "no:cacheprovider", "--collect-only", "-q"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode != 0
    assert "--engine: engine 'mine=fsdp1:half_missing_pkg'" in proc.stderr
    assert "collected" not in proc.stdout


def _env() -> dict[str, str]:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO)}


# --- the certificate -------------------------------------------------------------------------------


def test_certificate_renders_counts_failures_and_status() -> None:
    families = [
        FamilyResult("seeds", "ported tests' behaviours", passed=3),
        FamilyResult("knobs", "knob propagation", passed=1, failed=1,
                     failures=[Failure("mine:ddp:x", "ignored: reduce in float32", "precision", None)]),
        FamilyResult("checkpoints", "checkpoints", note="not yet available"),
    ]
    cert = Certificate("mine", "mine=fsdp1:pkg", "0.1", {"torch": "2.x", "backend": "gloo"}, families)
    assert not cert.ok and [f.status for f in families] == ["pass", "fail", "unsupported"]
    md = markdown(cert)
    assert "DOES NOT CONFORM" in md and "mine:ddp:x" in md and "not yet available" in md
    assert "mine:ddp:x" in render_html(cert) and "<a href" not in render_html(cert)
    # A failing case with a page in the certification's report links to it.
    cert.pages = {"mine:ddp:x": "report/cases/x.html"}
    assert '<a href="report/cases/x.html"><code>mine:ddp:x</code></a>' in render_html(cert)
    assert "[mine:ddp:x](report/cases/x.html)" in markdown(cert)
    assert '"status": "fail"' in to_json(cert) and '"ok": false' in to_json(cert)


def test_certify_exits_2_when_its_ranks_do_not_run_the_cases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """The generated families run on the runner every front end uses; a pool that cannot start leaves its
    cases not run, which must not read as a certificate with fewer cases."""
    import argparse

    import harness.ranks.pool
    from harness.cli import certify

    class NoRanks:
        def __init__(self, config: object) -> None:
            pass

        def __enter__(self) -> None:
            raise harness.ranks.pool.PoolStartError("RankPool: planted: no rank started")

        def __exit__(self, *exc: object) -> bool:
            return False

    monkeypatch.setattr(harness.ranks.pool, "RankPool", NoRanks)
    parser = argparse.ArgumentParser()
    certify.add_arguments(parser)
    args = parser.parse_args(["--engine", "builtin", "--families", "parity-ddp", "--quick", "--out", str(tmp_path / "c"),
                              "--no-progress", "--device", "cpu"])
    assert certify.main(args) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "did not run the cases" in line]
    assert "planted: no rank started" in line and "not run" in line
    assert not (tmp_path / "c" / "certificate.md").exists()
