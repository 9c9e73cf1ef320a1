"""Data parallel: everything replicated, gradients averaged by bucketed all-reduce from backward hooks."""

from .base import Strategy
from .sharding import REPLICATED


class DDPStrategy(Strategy):
    name = "ddp"
    spec = REPLICATED
