"""Data parallel: everything replicated, gradients averaged by bucketed all-reduce from backward hooks."""

from typing import Any

from .base import Strategy
from .sharding import REPLICATED


class DDPStrategy(Strategy):
    name = "ddp"
    spec = REPLICATED

    def __init__(self, compile: Any = None, compile_options: dict[str, Any] | None = None) -> None:
        """`compile`: True (the whole model, or each child of the TrainModule holding parameters), a set of module
        classes or a callable (module, name) -> bool; each chosen module's forward is torch.compile'd in place."""
        super().__init__(compile, compile_options)
