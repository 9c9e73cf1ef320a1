"""ZeRO stage 1 (optimizer state sharded) and stage 2 (gradients sharded too)."""

from .base import Strategy
from .sharding import ZERO1, ZERO2


class ZeroStrategy(Strategy):
    def __init__(self, stage: int = 1) -> None:
        if stage not in (1, 2):
            raise ValueError(f"ZeroStrategy: stage={stage!r}; choose 1 or 2 (use FSDPStrategy for stage 3)")
        super().__init__()
        self.stage = stage
        self.spec = ZERO1 if stage == 1 else ZERO2
        self.name = f"zero{stage}"

    def __repr__(self) -> str:
        return f"ZeroStrategy(stage={self.stage})"
