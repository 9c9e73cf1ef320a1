"""Compatibility: `trainer.divergence.DivergenceError`, as the docs name it, now lives in trainer/observe/."""

from .observe.divergence import DivergenceError

__all__ = ["DivergenceError"]
