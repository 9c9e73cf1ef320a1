"""Precision settings: autocast for the mixed modes, a loss scaler for fp16, bf16 or fp16 weights for "-true"."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

PRECISIONS = ("32", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}  # weights and batches in this dtype
_ALIASES = {"32-true": "32", 32: "32", "16": "16-mixed", 16: "16-mixed", "bf16": "bf16-mixed"}


def check_precision(precision: Any) -> str:
    precision = _ALIASES.get(precision, precision)
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision={precision!r} is not supported; choose one of {list(PRECISIONS)} (or "
            f"Lightning's names {[k for k in _ALIASES if isinstance(k, str)]})"
        )
    return precision


class Precision:
    def __init__(self, precision: str, device_type: str) -> None:
        self.precision = check_precision(precision)
        self.device_type = device_type
        self.scaler = LossScaler() if self.precision == "16-mixed" else None

    def autocast(self) -> Any:
        if self.precision == "bf16-mixed":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        if self.precision == "16-mixed":
            return torch.autocast(self.device_type, dtype=torch.float16)
        return nullcontext()

    def convert_module(self, module: nn.Module) -> nn.Module:
        dtype = TRUE_DTYPES.get(self.precision)
        return module.to(dtype) if dtype is not None else module

    def convert_input(self, batch: Any) -> Any:
        """ "bf16-true", "16-true": the batch's floating-point tensors in the weights' dtype (integer ones, such as
        token ids and labels, stay as they are), like Lightning's precision plugins do."""
        dtype = TRUE_DTYPES.get(self.precision)
        return tree_map(lambda value: _to(value, dtype), batch) if dtype is not None else batch

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler else loss

    def unscale_and_check(self, gradients: list[torch.Tensor], any_rank: Any) -> bool:
        """Unscale gradients in place; False if they overflowed on any rank (the step is then skipped)."""
        return self.scaler.unscale_and_check(gradients, any_rank) if self.scaler else True

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict() if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler and state:
            self.scaler.load_state_dict(state)


def _to(value: Any, dtype: torch.dtype) -> Any:
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


class LossScaler:
    """Dynamic loss scaling for fp16 whose overflow check agrees across ranks (each may hold only a shard)."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale_value = scale
        self.growth_interval = growth_interval
        self.good_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def unscale_and_check(self, gradients: list[torch.Tensor], any_rank: Any) -> bool:
        found_inf = any(not torch.isfinite(g).all() for g in gradients)
        if any_rank(found_inf):
            self.scale_value /= 2.0
            self.good_steps = 0
            return False
        for g in gradients:
            g.mul_(1.0 / self.scale_value)
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale_value *= 2.0
            self.good_steps = 0
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale_value, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scale_value, self.good_steps = state["scale"], state["good_steps"]
