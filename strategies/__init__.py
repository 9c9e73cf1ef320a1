"""Strategies: how a model is spread over data-parallel ranks. Each is a sharding spec on one engine."""

from . import _torch_version  # noqa: F401  (first: an older torch is refused by name before anything fails)
from .base import Strategy
from .context_parallel import sequence_positions
from .ddp import DDPStrategy
from .fsdp import FSDPStrategy
from .options import MixedPrecision
from .registry import STRATEGIES, get_strategy
from .sharding import FlatPieces, mark_as_unit, observe
from .single import SingleDeviceStrategy
from .zero import ZeroStrategy

__all__ = [
    "DDPStrategy",
    "FSDPStrategy",
    "FlatPieces",
    "MixedPrecision",
    "STRATEGIES",
    "SingleDeviceStrategy",
    "Strategy",
    "ZeroStrategy",
    "get_strategy",
    "mark_as_unit",
    "observe",
    "sequence_positions",
]
