"""Cases that span nodes: ``harness run`` under two torchrun agents, two "nodes" of two gloo ranks on this
machine (torchrun's static rendezvous: agent 0 hosts the store at ``--master-addr``, ``--node-rank`` gives
each agent its ranks). The hybrid strategies' shard group is then a node (``LOCAL_WORLD_SIZE``, by
``harness.ranks.placement.default_shard_size``) and the replicas are the other node's ranks; the builtin engine
and torch FSDP1 train against DDP over all four ranks, and rank 0 records. A SIGKILLed agent is a lost
node: the case in flight is a ``crash`` naming it, and no rank of the run outlives it; a case past its
timeout is a ``timeout`` with every rank's stack (``harness.ranks.torchrun_watch``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.collect.collector import read_records
from harness.ranks.torchrun_watch import Site, lost_text

ROOT = Path(__file__).resolve().parents[2]
#: a hybrid_shard case of each FSDP1-API engine against DDP, at world size 4 (two nodes of two ranks).
#: A case that hangs is a ``timeout`` with every rank's stack well before the test gives up on the agents.
RUN = ["run", "--matrix", "full", "--engines", "builtin,torch-fsdp", "--references", "ddp", "--world-size", "4",
       "--filter", ":hybrid_shard-fp32-bwd_none-nested-ws4", "--case-timeout", "120", "--no-progress"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


def _agents(run: list[str], out: Path) -> dict[int, subprocess.Popen[str]]:
    """Node rank -> its torchrun agent running ``harness run`` into ``out`` (node 1 starts first)."""
    env, port = _env(), _free_port()
    return {
        node: subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
             "-m", "harness", *run, "--out", str(out)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for node in (1, 0)
    }


def _stop(agents: dict[int, subprocess.Popen[str]]) -> None:
    for agent in agents.values():  # a hung agent: SIGTERM, which torchrun passes on to its workers
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGTERM)
            agent.wait(timeout=30)


def _outputs(agents: dict[int, subprocess.Popen[str]], timeout_s: float) -> list[str]:
    """Every agent's output once all have ended; past ``timeout_s`` the agents are stopped and the test
    fails with what they printed (a bare ``TimeoutExpired`` would lose it)."""
    deadline = time.monotonic() + timeout_s
    try:
        return [agent.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0] for agent in agents.values()]
    except subprocess.TimeoutExpired:
        _stop(agents)
        said = [f"--- node {node} (exit {agent.returncode}):\n{(agent.communicate()[0] or '')[-3000:]}"
                for node, agent in agents.items()]
        pytest.fail(f"the agents ran past {timeout_s:.0f} s:\n" + "\n".join(said))


def _running(marker: str) -> list[str]:
    """Command lines of the live (not zombie) processes whose command line holds ``marker``."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # not a process, or gone meanwhile
        if marker in cmdline and state != "Z":
            found.append(f"{proc.name}: {cmdline}")
    return found


def test_two_torchrun_agents_run_hybrid_cases_with_a_node_per_shard_group(tmp_path: Path) -> None:
    out = tmp_path / "nodes.jsonl"
    agents = _agents(RUN, out)
    try:
        outputs = _outputs(agents, 270)
    finally:
        _stop(agents)
    assert [a.returncode for a in agents.values()] == [0, 0], "\n".join(outputs)
    records, bad = read_records(out)
    assert not bad and sorted(r.case["engine"] for r in records) == ["builtin", "torch-fsdp"]
    assert all(r.case["world_size"] == 4 and r.case["reference"] == "ddp" and r.case["sharding_strategy"] == "hybrid_shard"
               for r in records)
    assert [r.verdict for r in records] == ["pass", "pass"], [r.reason for r in records]
    # The hybrid check passes only if gradients were all-reduced across 2 replicas: shard groups of a
    # node's 2 ranks. (On 2 x 2 a node is also half the world, a single host's split; which of the two
    # the launcher's local world size picks is test_harness_logic's test_default_shard_size.)
    for record in records:
        sharding = next(k for k in record.detail["knobs"] if k["knob"] == "sharding_strategy")
        assert sharding["status"] == "ok", sharding
        assert record.detail["collectives"].get("all_reduce"), record.detail["collectives"]


#: the selection of the tests that kill an agent: enough cases that one is in flight at the kill.
KILLED_RUN = ["run", "--matrix", "full", "--engines", "builtin", "--references", "ddp", "--world-size", "4",
              "--filter", ":hybrid_shard-fp32-bwd_none-", "--limit", "6", "--no-progress"]
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="a worker dies with its agent through Linux's PR_SET_PDEATHSIG")


def _kill_mid_run(node: int, out: Path) -> tuple[subprocess.Popen[str], str, float]:
    """Start both agents, SIGKILL ``node``'s agent once the first case is recorded (the agent alone, as a
    node's loss takes it: not its workers), and wait for the other: (that agent, its output, seconds
    from the kill to its end)."""
    agents = _agents(KILLED_RUN, out)
    other = agents[1 - node]
    try:
        deadline = time.monotonic() + 120
        while not (out.is_file() and read_records(out)[0]):  # the first case is recorded: the second runs
            assert all(a.poll() is None for a in agents.values()) and time.monotonic() < deadline, "no case recorded"
            time.sleep(0.2)
        os.kill(agents[node].pid, signal.SIGKILL)
        killed = time.monotonic()
        output = other.communicate(timeout=60)[0]
        return other, output, time.monotonic() - killed
    finally:
        _stop(agents)


def _assert_no_rank_left(out: Path) -> None:
    deadline = time.monotonic() + 10
    while _running(str(out)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _running(str(out))


@linux_only
def test_a_killed_agent_is_a_crash_naming_its_node_and_no_rank_outlives_the_run(tmp_path: Path) -> None:
    out = tmp_path / "lost.jsonl"
    survivor, output, ended_after = _kill_mid_run(1, out)
    assert survivor.returncode != 0 and ended_after < 40, output
    records, bad = read_records(out)
    assert not bad and len(records) < 6, [r.verdict for r in records]
    *before, lost = records
    assert before and [r.verdict for r in before] == ["pass"] * len(before), [r.reason for r in before]
    assert lost.verdict == "crash", (lost.reason, output)
    assert "node 1 lost (host " in lost.reason and "ranks [2, 3])" in lost.reason, lost.reason
    assert "stacks are lost with it" in lost.reason, lost.reason
    # The stacks of the ranks that are left come back; the lost ones' exit codes are unknown.
    assert sorted(lost.detail["stacks"]) == ["0", "1"] and lost.detail["exit_codes"] == {"2": -999, "3": -999}
    # No rank of the run is left: node 1's workers died with their agent, node 0's ended the run.
    _assert_no_rank_left(out)


@linux_only
def test_a_killed_recording_node_costs_the_case_in_flight_and_no_rank_outlives_it(tmp_path: Path) -> None:
    out = tmp_path / "lost0.jsonl"
    survivor, output, ended_after = _kill_mid_run(0, out)  # agent 0: rank 0, which records, and the store
    assert survivor.returncode != 0 and ended_after < 40, output
    records, bad = read_records(out)
    # What was recorded stays; the case in flight has no record (--resume reruns it).
    assert not bad and 1 <= len(records) < 6 and {r.verdict for r in records} == {"pass"}, [r.reason for r in records]
    _assert_no_rank_left(out)


def test_a_case_past_its_timeout_under_torchrun_brings_back_every_rank_s_stack(tmp_path: Path) -> None:
    out = tmp_path / "timeout.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "harness",
         "run", "--matrix", "smoke", "--engines", "torch-fsdp", "--references", "ddp", "--limit", "1",
         # Rank 0 looks at the clock once a beat (a second): the case must outlast one, idle host or not.
         "--steps", "1000", "--timeout", "0.01", "--out", str(out), "--no-progress"],
        cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode != 0, done.stdout + done.stderr
    records, bad = read_records(out)
    assert not bad and [r.verdict for r in records] == ["timeout"], done.stderr  # the run ends with the case
    assert "within 0.01 s" in records[0].reason and records[0].reason.endswith("under torchrun (run ended)")
    assert sorted(records[0].detail["stacks"]) == ["0", "1"]
    # Rank 0's stack is the thread running the case (a runner's lane), not its main thread waiting on it.
    assert all("run_case_on_rank" in stack for stack in records[0].detail["stacks"].values()), records[0].detail["stacks"]


def test_a_lost_node_is_named_whole_or_by_its_lost_ranks() -> None:
    sites = [Site(r, r // 2, f"host{r // 2}") for r in range(6)]
    assert lost_text([2, 3], sites, 10) == (
        "node 1 lost (host host1, ranks [2, 3]): no heartbeat for 10 s; their stacks are lost with it")
    assert lost_text([2, 3, 5], sites, 10).startswith(
        "node 1 lost (host host1, ranks [2, 3]); rank(s) [5] of node 2 (host host2) lost:")
