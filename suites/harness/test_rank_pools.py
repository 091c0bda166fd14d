"""A pytest process's rank pools: a failed start fails its test, a second one every later test of the key at
once (``harness.pytest_plugin.pools.START_ATTEMPTS``), without waiting for a third start-up to fail."""

from __future__ import annotations

import pytest

from harness.pytest_plugin import pools
from harness.ranks.pool import PoolConfig, PoolStartError, RankPool


def test_a_failed_start_is_tried_once_more_then_fails_every_later_test_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    starts: list[int] = []

    def start(self: RankPool) -> None:
        starts.append(self.config.world_size)
        raise PoolStartError("RankPool: ranks [0, 1] did not join the process group within 180 s")

    monkeypatch.setattr(RankPool, "start", start)
    held = pools.RankPools(lambda key: PoolConfig(world_size=2), make_room=False)
    with held:
        for attempt in range(4):
            with pytest.raises(pytest.fail.Exception, match="the 2 ranks did not start: RankPool: ranks"):
                held.pool_for(2)
            assert len(starts) == min(attempt + 1, pools.START_ATTEMPTS), f"attempt {attempt}: {len(starts)} starts"
