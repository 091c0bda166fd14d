"""Where the gradient average is taken: inside NCCL's collective (``ReduceOp.AVG``) for fp32 and bf16
reductions, as torch FSDP2 does, and FSDP1's division before and after the sum elsewhere (gloo has no AVG;
fp16 sums would overflow). Both give bitwise the same gradients at world sizes that are powers of two (each
division is then exact), so the choice changes the kernels on the reduction stream, never the numbers.

On CPU ranks (gloo) the check holds the division path; on GPUs with one per rank (NCCL) it holds AVG.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from engine import FSDP, MixedPrecision, ShardingStrategy
from engine import collectives
from harness.cases.model_protocol import wrap_bottom_up
from harness.conformance.engine_models import NestedWrapped
from harness.pytest_plugin.rank_checks import rank_check_tests


@contextlib.contextmanager
def _ops_recorded(ops: list[object], average_in_collective: bool) -> Iterator[None]:
    """The reduce ops of the engine's gradient collectives go to ``ops``; without
    ``average_in_collective`` the engine takes the division path wherever it runs."""
    reduce_scatter, all_reduce, rule = dist.reduce_scatter_tensor, dist.all_reduce, collectives.averages_in_the_collective

    def recording_reduce_scatter(output, input, op=dist.ReduceOp.SUM, **kw):  # type: ignore[no-untyped-def]
        ops.append(op)
        return reduce_scatter(output, input, op=op, **kw)

    def recording_all_reduce(tensor, op=dist.ReduceOp.SUM, **kw):  # type: ignore[no-untyped-def]
        ops.append(op)
        return all_reduce(tensor, op=op, **kw)

    dist.reduce_scatter_tensor, dist.all_reduce = recording_reduce_scatter, recording_all_reduce
    if not average_in_collective:
        collectives.averages_in_the_collective = lambda group, tensor: False
    try:
        yield
    finally:
        dist.reduce_scatter_tensor, dist.all_reduce = reduce_scatter, all_reduce
        collectives.averages_in_the_collective = rule


def _grads(device: torch.device, strategy: ShardingStrategy, reduce_dtype: torch.dtype, rank: int,
           average_in_collective: bool) -> tuple[list[torch.Tensor], list[object]]:
    ops: list[object] = []
    model = wrap_bottom_up(NestedWrapped(device), FSDP, sharding_strategy=strategy,
                           mixed_precision=MixedPrecision(reduce_dtype=reduce_dtype))
    torch.manual_seed(rank)  # each rank its own batch: the average is of different gradients
    x = torch.randn(4, 8, device=device)
    with _ops_recorded(ops, average_in_collective):
        model(x).pow(2).sum().backward()
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None], ops


def check_the_average_is_nccls_own_for_fp32_and_bf16(rank: int, world_size: int) -> None:
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    nccl = "nccl" in str(dist.get_backend())
    assert world_size & (world_size - 1) == 0, f"world_size={world_size}: the bitwise claim needs a power of two"
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD):
        for reduce_dtype in (torch.float32, torch.bfloat16, torch.float16):
            if reduce_dtype == torch.float16 and device.type == "cpu":
                continue  # gloo sums no fp16 on CPU
            grads, ops = _grads(device, strategy, reduce_dtype, rank, average_in_collective=True)
            divided, divided_ops = _grads(device, strategy, reduce_dtype, rank, average_in_collective=False)
            in_collective = nccl and reduce_dtype != torch.float16
            want = dist.ReduceOp.AVG if in_collective else dist.ReduceOp.SUM
            where = f"{strategy.name}, reduce_dtype={reduce_dtype}, backend {dist.get_backend()}"
            assert ops and all(op == want for op in ops), f"{where}: ops {ops}, want all {want}"
            assert divided_ops and all(op == dist.ReduceOp.SUM for op in divided_ops), f"{where}: {divided_ops}"
            torch.testing.assert_close(grads, divided, rtol=0, atol=0, msg=lambda m: f"{where}: {m}")


CHECKS = [check_the_average_is_nccls_own_for_fp32_and_bf16]
rank_checks, test_check = rank_check_tests(CHECKS, device=("cpu", "cuda"))
