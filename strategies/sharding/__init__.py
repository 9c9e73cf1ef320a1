"""The one sharding engine behind every strategy."""

from . import collectives as observe  # the watching half of collectives.py, public as `strategies.observe`
from .engine import ShardingEngine, WrapPolicy
from .layout import FlatPieces
from .spec import FULL_SHARD, REPLICATED, ZERO1, ZERO2, ShardingSpec, UnitOptions
from .unit import mark_as_unit

__all__ = [
    "FULL_SHARD",
    "FlatPieces",
    "REPLICATED",
    "ZERO1",
    "ZERO2",
    "ShardingEngine",
    "ShardingSpec",
    "UnitOptions",
    "WrapPolicy",
    "mark_as_unit",
    "observe",
]
