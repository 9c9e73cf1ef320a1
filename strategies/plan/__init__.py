"""The memory plan: bytes per rank under ddp, zero1, zero2 and fsdp, known before launch.

    python -m strategies.plan examples.gpt:gpt_100m --world-size 2 --batch-size 2
    trainer.plan(module)                  # the same table, for the Trainer's world size and strategy options
"""

from .model_state import OPTIMIZER_STATES, model_state_bytes, optimizer_kind
from .planner import meta_copy, plan_memory
from .report import STRATEGY_ORDER, MemoryPlan, StrategyMemory
from .sizes import device_memory_per_rank, format_bytes, parse_bytes

__all__ = [
    "OPTIMIZER_STATES",
    "STRATEGY_ORDER",
    "MemoryPlan",
    "StrategyMemory",
    "device_memory_per_rank",
    "format_bytes",
    "meta_copy",
    "model_state_bytes",
    "optimizer_kind",
    "parse_bytes",
    "plan_memory",
]
