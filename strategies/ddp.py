"""Data parallel: everything replicated, gradients averaged by bucketed all-reduce from backward hooks."""

from .base import Strategy
from .sharding import REPLICATED


class DDPStrategy(Strategy):
    """Distributed data parallel: parameters, gradients and optimizer state replicated on every rank; gradients
    averaged by bucketed all-reduces launched from backward hooks, overlapping the backward pass.

    Args:
        compile: which modules' `forward` to `torch.compile` in place, the engine's hooks staying outside:
            `None` or `False` (none), `True` (the strategy's units: FSDP's wrapped modules; otherwise the model
            itself if it defines `forward`, else each child of it that holds parameters), a set of module
            classes, or a callable `(module, name) -> bool`.
        compile_options: keyword arguments for `torch.compile` (e.g. `{"mode": "max-autotune"}`).

    Raises:
        TypeError: if `compile` is an int or not one of the forms above, or `compile_options` is not a dict.
    """

    name = "ddp"
    spec = REPLICATED
