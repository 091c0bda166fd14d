"""Cases that span nodes: ``harness run`` under two torchrun agents, two "nodes" of two gloo ranks on this
machine (torchrun's static rendezvous: agent 0 hosts the store at ``--master-addr``, ``--node-rank`` gives
each agent its ranks). The hybrid strategies' shard group is then a node (``LOCAL_WORLD_SIZE``, by
``harness.placement.default_shard_size``) and the replicas are the other node's ranks; the builtin engine
and torch FSDP1 train against DDP over all four ranks, and rank 0 records."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from harness.collector import read_records

ROOT = Path(__file__).resolve().parents[2]
#: a hybrid_shard case of each FSDP1-API engine against DDP, at world size 4 (two nodes of two ranks).
RUN = ["run", "--matrix", "full", "--engines", "builtin,torch-fsdp", "--references", "ddp", "--world-size", "4",
       "--filter", ":hybrid_shard-fp32-bwd_none-nested-ws4", "--no-progress"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_torchrun_agents_run_hybrid_cases_with_a_node_per_shard_group(tmp_path: Path) -> None:
    out = tmp_path / "nodes.jsonl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "CUDA_VISIBLE_DEVICES": ""}
    env.pop("PYTEST_XDIST_WORKER", None)
    port = _free_port()
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
             "-m", "harness", *RUN, "--out", str(out)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        for node in (1, 0)
    ]
    try:
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:  # a hung agent: SIGTERM, which torchrun passes on to its workers
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGTERM)
                agent.wait(timeout=30)
    assert [a.returncode for a in agents] == [0, 0], "\n".join(outputs)
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
