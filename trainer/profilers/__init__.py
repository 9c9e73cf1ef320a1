"""Profilers, with Lightning's names: `Trainer(profiler="simple" | "pytorch" | a Profiler)`."""

from .base import Profiler
from .pytorch import PyTorchProfiler
from .simple import SimpleProfiler

PROFILERS = {"simple": SimpleProfiler, "pytorch": PyTorchProfiler}

__all__ = ["PROFILERS", "Profiler", "PyTorchProfiler", "SimpleProfiler"]
