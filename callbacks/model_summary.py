"""ModelSummary (Lightning's name; on by default, `enable_model_summary=False` turns it off): a table of the
model's top-level layers with their parameter counts and, under a strategy that shards parameters, the bytes each
rank holds, printed on rank 0 when fit starts."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainModule


def _size(count: float, units: tuple[str, ...] = ("", "K", "M", "B", "T")) -> str:
    for unit in units:
        if abs(count) < 1000 or unit == units[-1]:
            return f"{count:.1f} {unit}".rstrip() if unit else f"{int(count)}"
        count /= 1000
    return str(count)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:,.1f} MiB"


class ModelSummary(Callback):
    """Prints a table of the model's layers when `fit` starts, on rank 0 (Lightning's name).

    The table lists each layer's name, type and parameter count and, under a strategy that shards parameters over
    more than one rank, the bytes each rank holds of it; then the trainable and total parameter counts and the
    parameter bytes per rank. The Trainer adds one unless `enable_model_summary=False`.

    Args:
        max_depth: how deep in the module tree to list layers: `1` for the top-level layers, `0` for the totals
            only.

    Raises:
        ValueError: if `max_depth` is not an int >= 0.
    """

    def __init__(self, max_depth: int = 1) -> None:
        if not isinstance(max_depth, int) or max_depth < 0:
            raise ValueError(f"ModelSummary: max_depth={max_depth!r}; use an int >= 0 (0: totals only)")
        self.max_depth = max_depth

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        table = self.table(trainer, module)
        if trainer.is_global_zero:
            print(table, flush=True)

    def table(self, trainer: Trainer, module: TrainModule) -> str:
        """The summary table as text (called on every rank: it reads the strategy's per-rank sizes).

        Args:
            trainer: the Trainer, with the strategy set up.
            module: the TrainModule.

        Returns:
            The table.
        """
        held = trainer.strategy.parameter_bytes()  # by the first name of each parameter
        first_names = {id(p): name for name, p in module.named_parameters()}
        shapes = trainer.strategy.model_state().shapes()  # whole tensors' (under tensor parallel, not the pieces')
        numel = {id(p): math.prod(shapes[name][0]) for name, p in module.named_parameters()}
        sharded = (
            trainer.strategy.spec.shard_parameters or trainer.strategy.tensor_parallel_size > 1
        ) and trainer.world_size > 1
        rows = []
        for name, layer in module.named_modules():
            depth = name.count(".") + 1 if name else 0
            if not name or depth > self.max_depth:
                continue
            params = {id(p): p for p in layer.parameters()}
            count = sum(numel[i] for i in params)
            nbytes = sum(held[first_names[i]] for i in params)
            rows.append([name, type(layer).__name__, _size(count)] + ([_mib(nbytes)] if sharded else []))
        header = ["Name", "Type", "Params"] + ([f"Per rank (of {trainer.world_size})"] if sharded else [])
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in [header, *rows]]
        if rows:
            lines.insert(1, "-" * len(lines[0]))
        trainable = sum(numel[id(p)] for p in module.parameters() if p.requires_grad)
        total = sum(numel[id(p)] for p in module.parameters())
        lines += [
            f"{_size(trainable)} trainable params, {_size(total - trainable)} non-trainable, {_size(total)} total",
            f"parameters held per rank ({trainer.strategy.describe()}): {_mib(sum(held.values()))}",
        ]
        return "\n".join(lines)
