"""What the ranks agree on after each training_step, in the one small all-reduce that the loop makes there:

- training_step returned None: the batch is skipped only if every rank skipped it (a lone skip would leave the
  others waiting in backward), otherwise an error names the ranks;
- the loss is not finite on some rank (unless on_nonfinite="ignore");
- some rank received SIGTERM: every rank stops once this optimizer step is done;
- some rank has no next batch (iterable data): every rank ends the epoch after this batch.

One process needs no all-reduce; there only the finiteness check reads the loss (a sync on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Agreement:
    skip: bool = False
    nonfinite_loss: bool = False
    stop: bool = False
    last_batch: bool = False


def agree(
    strategy: Any, loss: torch.Tensor | None, check_loss: bool, stop: bool, has_next: bool, where: str
) -> Agreement:
    skip = loss is None
    check_loss = check_loss and not skip
    if not strategy.distributed:
        return Agreement(skip, check_loss and not bool(torch.isfinite(loss)), stop, not has_next)
    flags = torch.tensor([skip, False, stop, not has_next], dtype=torch.float32, device=strategy.root_device)
    if check_loss:
        flags[1] = (~torch.isfinite(loss.detach())).float()  # stays on the device: one sync, in the all-reduce
    skipping, nonfinite, stopping, ran_out = (int(n) for n in strategy.all_reduce(flags, op="sum").tolist())
    if skipping not in (0, strategy.world_size):
        ranks = [rank for rank, flag in enumerate(strategy.all_gather_object(skip)) if flag]
        raise RuntimeError(
            f"training_step returned None on rank(s) {ranks} but not on the others at {where}; every rank must "
            "skip the same batch"
        )
    return Agreement(skipping > 0, nonfinite > 0, stopping > 0, ran_out > 0)
