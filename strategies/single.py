"""One process, one device: the engine with nothing to communicate."""

from .base import Strategy
from .sharding import REPLICATED


class SingleDeviceStrategy(Strategy):
    """One process on one device: the engine with nothing to communicate.

    `Trainer(strategy="auto")` picks it for one process outside a launcher.

    Takes `compile` and `compile_options` as `Strategy` does (see there).
    """

    name = "single"
    spec = REPLICATED
    reseeds_each_stage = False  # as Lightning's SingleDeviceStrategy
