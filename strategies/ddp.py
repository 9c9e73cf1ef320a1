"""Data parallel: everything replicated, gradients averaged by bucketed all-reduce from backward hooks."""

from .base import Strategy
from .sharding import REPLICATED


class DDPStrategy(Strategy):
    """Distributed data parallel: parameters, gradients and optimizer state replicated on every rank; gradients
    averaged by bucketed all-reduces launched from backward hooks, overlapping the backward pass.

    Takes `compile` and `compile_options` as `Strategy` does (see there).
    """

    name = "ddp"
    spec = REPLICATED
