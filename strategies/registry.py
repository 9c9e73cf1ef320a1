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


def get_strategy(name: str) -> Strategy:
    """A new strategy by name: one of "single", "ddp", "zero1", "zero2", "fsdp", "hsdp"."""
    if name not in STRATEGIES:
        raise ValueError(
            f"strategy={name!r} is not known; choose one of {['auto', *STRATEGIES]} or pass a Strategy"
        )
    return STRATEGIES[name]()
