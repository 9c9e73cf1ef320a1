"""Shared fixtures: `rank_pool(world_size)` is the session's pool of real ranks on gloo (tests/ranks.py)."""

from collections.abc import Callable, Iterator

import pytest

from tests.ranks import RankPool


@pytest.fixture(scope="session")
def rank_pool() -> Iterator[Callable[[int], RankPool]]:
    """A factory: `rank_pool(n)` is a pool of n ranks, started at its first use and shared by the session."""
    pools: dict[int, RankPool] = {}

    def get(world_size: int) -> RankPool:
        if world_size not in pools:
            pools[world_size] = RankPool(world_size)
        return pools[world_size]

    yield get
    for pool in pools.values():
        pool.close()
