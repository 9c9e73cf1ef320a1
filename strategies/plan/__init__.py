"""The plan: bytes per rank under ddp, zero1, zero2 and fsdp, and each one's step time, known before launch.

python -m strategies.plan examples.gpt:gpt_100m --world-size 2 --batch-size 2
trainer.plan(module)                  # the same table, for the Trainer's world size and strategy options
"""

from .hardware import HARDWARE, Hardware, Link, get_hardware
from .model_bytes import OPTIMIZER_STATES, model_state_bytes, optimizer_kind
from .planner import meta_copy, plan_memory
from .report import FORECAST_KEYS, STRATEGY_ORDER, MemoryPlan, StepForecast, StrategyMemory
from .sizes import device_memory_per_rank, format_bytes, parse_bytes

__all__ = [
    "FORECAST_KEYS",
    "HARDWARE",
    "Hardware",
    "Link",
    "StepForecast",
    "get_hardware",
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
