"""Strategy names accepted by Trainer(strategy=...)."""

from __future__ import annotations

from collections.abc import Callable

from .base import Strategy
from .ddp import DDPStrategy
from .fsdp import FSDPStrategy
from .single import SingleDeviceStrategy
from .zero import ZeroStrategy

STRATEGIES: dict[str, Callable[[], Strategy]] = {
    "single": SingleDeviceStrategy,
    "ddp": DDPStrategy,
    "zero1": lambda: ZeroStrategy(stage=1),
    "zero2": lambda: ZeroStrategy(stage=2),
    "fsdp": FSDPStrategy,
    "hsdp": lambda: FSDPStrategy(hybrid_shard="node"),
}
"""The strategy names `get_strategy` and `Trainer(strategy=...)` accept, each with a function that makes a new
strategy of that name."""


def get_strategy(name: str) -> Strategy:
    """A new strategy with its default options, by name (as `Trainer(strategy=name)` takes it).

    Args:
        name: `"single"` (`SingleDeviceStrategy`), `"ddp"` (`DDPStrategy`), `"zero1"` / `"zero2"`
            (`ZeroStrategy(stage=1 | 2)`), `"fsdp"` (`FSDPStrategy`) or `"hsdp"`
            (`FSDPStrategy(hybrid_shard="node")`).

    Returns:
        The strategy.

    Raises:
        ValueError: for an unknown name.
    """
    if name not in STRATEGIES:
        raise ValueError(f"strategy={name!r} is not known; choose one of {['auto', *STRATEGIES]} or pass a Strategy")
    return STRATEGIES[name]()
