"""One process, one device: the engine with nothing to communicate."""

from .base import Strategy
from .sharding import REPLICATED


class SingleDeviceStrategy(Strategy):
    """One process on one device: the engine with nothing to communicate.

    `Trainer(strategy="auto")` picks it for one process outside a launcher.

    Args:
        compile: which modules' `forward` to `torch.compile` in place, the engine's hooks staying outside:
            `None` or `False` (none), `True` (the strategy's units: FSDP's wrapped modules; otherwise the model
            itself if it defines `forward`, else each child of it that holds parameters), a set of module
            classes, or a callable `(module, name) -> bool`.
        compile_options: keyword arguments for `torch.compile` (e.g. `{"mode": "max-autotune"}`).

    Raises:
        TypeError: if `compile` is an int or not one of the forms above, or `compile_options` is not a dict.
    """

    name = "single"
    spec = REPLICATED
