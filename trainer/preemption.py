"""Compatibility: `trainer.preemption.Preempted`, as the docs name it, now lives in trainer/launch/."""

from .launch.preemption import Preempted

__all__ = ["Preempted"]
