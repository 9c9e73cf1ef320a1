"""The one sharding engine behind every strategy."""

from .engine import ShardingEngine, WrapPolicy
from .flat_pieces import FlatPieces
from .spec import FULL_SHARD, REPLICATED, ZERO1, ZERO2, ShardingSpec, UnitOptions
from .units import mark_as_unit

__all__ = [
    "FULL_SHARD",
    "FlatPieces",
    "REPLICATED",
    "ZERO1",
    "ZERO2",
    "ShardingEngine",
    "ShardingSpec", "UnitOptions",
    "WrapPolicy",
    "mark_as_unit",
]
