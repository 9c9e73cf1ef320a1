"""A loss or gradient norm that is not finite: stop with an error (the default), skip the step, or ignore it.

The checks add no collective of their own: whether the loss is finite travels in the all-reduce that the loop
makes after every training_step anyway (agreement.py), and the gradient norm is the one gradient clipping
computes, which is the same on every rank. Without `gradient_clip_val` the gradients themselves are not checked.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from ..arguments import check_choice

ON_NONFINITE = ("error", "skip", "ignore")


def nonfinite_losses(strategy: Any, loss: torch.Tensor | None) -> str:
    """'rank 1: nan, rank 3: inf': the ranks whose loss is not finite. Collective."""
    values = strategy.all_gather_object(None if loss is None else loss.item())
    return ", ".join(f"rank {r}: {v}" for r, v in enumerate(values) if v is not None and not math.isfinite(v))


class NonFiniteGuard:
    """Applies `on_nonfinite` and counts the steps it skipped. Every rank calls it alike (the finding is agreed)."""

    def __init__(self, mode: str) -> None:
        self.mode = check_choice("on_nonfinite", mode, ON_NONFINITE)
        self.skipped = 0

    @property
    def checks(self) -> bool:
        return self.mode != "ignore"

    def found(self, what: str, where: str, is_global_zero: bool) -> None:
        """A non-finite `what` ("loss (rank 1: nan)") at `where`: raise, or count a skipped step."""
        if self.mode == "error":
            raise FloatingPointError(
                f"non-finite {what} at {where}; training stopped on every rank before the weights changed. "
                "Find the cause (learning rate, data, a log or division by zero, fp16 range), or pass "
                "Trainer(on_nonfinite='skip') to skip such steps"
            )
        self.skipped += 1
        if is_global_zero:
            warnings.warn(
                f"non-finite {what} at {where}: the step is skipped on every rank ({self.skipped} skipped so far)",
                stacklevel=3,
            )
