"""One process, one device: the engine with nothing to communicate."""

from .base import Strategy
from .sharding import REPLICATED


class SingleDeviceStrategy(Strategy):
    name = "single"
    spec = REPLICATED
