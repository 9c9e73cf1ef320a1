"""Shared fixtures: `rank_pool(world_size)` is the session's pool of real ranks on gloo (tests/ranks.py)."""

import os
import signal
from collections.abc import Callable, Iterator

import pytest

from tests.ranks import RankPool, restore_environment

# The processes the tests start (rank programs in tests/scripts under torchrun, srun's variables or the Trainer's own
# launcher) compute with one thread each, so that their arithmetic is the same under any launcher: torchrun sets
# one thread only for several ranks per node, the Trainer's launcher the cores shared by its ranks.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Some tests send SIGINT as Ctrl-C would. A test run started as a background job of a script inherits SIGINT
# ignored, and so would every process it starts (Python then installs no KeyboardInterrupt handler): give the
# processes the tests start the disposition they have when started from a terminal.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Each test finds the environment as the session started it, whatever an earlier test's libraries set in it
    (Lightning's Trainer sets rank variables); the rank pool's bodies get the same (tests/ranks.py)."""
    environment = dict(os.environ)
    yield
    restore_environment(environment)


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests on real ranks (those that use the rank pool, or start processes of their own: marked in their module)
    carry the `distributed` marker: `pytest -m "not distributed"` runs the others, in this process."""
    for item in items:
        if "rank_pool" in item.fixturenames:
            item.add_marker(pytest.mark.distributed)
