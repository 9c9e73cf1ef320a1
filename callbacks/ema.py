"""EMA: an exponential moving average of the weights, kept on each rank's own shard and never gathered (Lightning's
EMAWeightAveraging, for sharded training).

Each rank averages only its pieces of the weights (`strategy.master_pieces()`): under zero1, zero2, fsdp and hsdp
the slices of the master its optimizer steps, under ddp the slice of the replicated parameters it writes in
checkpoints; frozen parameters are left out (their average is themselves). After an optimizer step the average
moves towards the weights, `avg += (1 - decay) * (w - avg)` in one `torch._foreach_lerp_`, in the master's precision
(float32 when the weights are bfloat16 or float16); the first update copies the weights, as torch's AveragedModel.
Validation, test and predict run with the average: it is swapped with the master pieces in place and the strategy
brings every copy up to date; the trained weights are swapped back when they end. Checkpoints hold it as
"ema.<name>", written by every rank like the weights and read back resharded under any strategy and world size.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from callbacks.base import Callback
from strategies import FlatPieces

if TYPE_CHECKING:
    from strategies import Strategy
    from trainer import Trainer, TrainModule

KEY = "ema"  # checkpoint entries "ema.<name>" (strategies.checkpoint.format.EMA)
SWAP_CHUNK = 1 << 22  # elements swapped at a time: the transient memory of a swap


class EMA(Callback):
    """An exponential moving average of the weights, kept on each rank's own shard and never gathered
    (Lightning's `EMAWeightAveraging`, for sharded training).

    After an optimizer step the average moves towards the weights, `avg += (1 - decay) * (w - avg)`, in the
    master's precision; the first update copies the weights. Frozen parameters are left out. Checkpoints hold the
    average as `"ema.<name>"`, written by every rank and read back resharded under any strategy and world size.
    `python -m trainer.checkpoint export CKPT OUT --ema` and `load_full_state_dict(path, ema=True)` give the
    averaged model; `with ema.applied(trainer):` puts it in the model for a while.

    Args:
        decay: the weight of the old average at each update, in [0, 1].
        update_every_n_steps: update after the optimizer steps whose (0-based) index divides by n.
        update_starting_at_step: update only from this optimizer step (0-based) on; `None` from the first.
        evaluate_with_ema: validation, test and predict run with the average (training goes on with the trained
            weights); also `trainer.validate()` after fit.

    Raises:
        TypeError: if `decay` is not a number or `evaluate_with_ema` not a bool.
        ValueError: if `decay` is outside [0, 1], `update_every_n_steps` is not an int >= 1, or
            `update_starting_at_step` is not None or an int >= 0.
    """

    def __init__(
        self,
        decay: float = 0.999,
        update_every_n_steps: int = 1,
        update_starting_at_step: int | None = None,
        evaluate_with_ema: bool = True,
    ) -> None:
        if isinstance(decay, bool) or not isinstance(decay, (int, float)):
            raise TypeError(f"EMA(decay={decay!r}) must be a number in [0, 1], e.g. 0.999")
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA(decay={decay!r}) must be in [0, 1], e.g. 0.999")
        if not isinstance(update_every_n_steps, int) or update_every_n_steps < 1:
            raise ValueError(f"EMA(update_every_n_steps={update_every_n_steps!r}) must be an int >= 1")
        start = update_starting_at_step
        if start is not None and (not isinstance(start, int) or start < 0):
            raise ValueError(f"EMA(update_starting_at_step={start!r}) must be None or an int >= 0")
        if not isinstance(evaluate_with_ema, bool):
            raise TypeError(f"EMA(evaluate_with_ema={evaluate_with_ema!r}) must be a bool")
        self.decay, self.update_every_n_steps = float(decay), update_every_n_steps
        self.update_starting_at_step, self.evaluate_with_ema = start, evaluate_with_ema
        self.updates = 0  # since the average started; 0: it holds nothing yet
        self._latest_step = 0  # the global step last considered for an update
        self._strategy: Strategy | None = None  # whose master pieces the average follows
        self._pieces: list[Any] = []  # the trainable master pieces (strategy.master_pieces)
        self._average: list[torch.Tensor] | None = None  # one per piece
        self._stash: list[torch.Tensor | None] = []  # trained pieces during evaluation, where dtypes differ
        self._swapped = False
        self._warned = False

    def should_update(self, step_idx: int) -> bool:
        """Whether to update after optimizer step `step_idx`; override it for another schedule.

        Args:
            step_idx: the optimizer step's index, 0-based.

        Returns:
            Whether to update the average.
        """
        start = self.update_starting_at_step
        return (start is None or step_idx >= start) and step_idx % self.update_every_n_steps == 0

    # -- hooks ----------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        self._bind(trainer.strategy)
        if stage == "fit":  # a checkpoint without the average resumes at its step: count from there
            self._latest_step = max(self._latest_step, trainer.global_step)

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._catch_up(trainer)

    def on_validation_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._swap_in(trainer)

    def on_validation_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._swap_out(trainer)  # before on_validation_end, where ModelCheckpoint saves

    def on_test_epoch_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._swap_in(trainer)

    def on_test_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._swap_out(trainer)

    def on_predict_start(self, trainer: Trainer, module: TrainModule) -> None:
        self._swap_in(trainer)

    def on_predict_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._swap_out(trainer)

    def on_exception(self, trainer: Trainer, module: TrainModule, exception: BaseException) -> None:
        """The trained pieces come back (other ranks may be gone: no collective, so under ddp and ZeRO the other
        ranks' slices of the replicated parameters stay those of the average on this rank)."""
        if self._swapped:
            self._exchange(back=True)
            self._swapped = False

    @contextmanager
    def applied(self, trainer: Trainer) -> Iterator[None]:
        """A context in which the model holds the average; the trained weights come back after it. Call it on
        every rank.

        Args:
            trainer: the Trainer this callback belongs to.

        Raises:
            RuntimeError: if the average holds nothing yet (no update since fit started, and no checkpoint with
                one was loaded).
        """
        if self.updates == 0:
            raise RuntimeError(
                "EMA.applied: the average holds nothing yet (no update since fit started, and no "
                "checkpoint with one was loaded)"
            )
        swapped = not self._swapped
        if swapped:
            self._apply(trainer)
        try:
            yield
        finally:
            if swapped:
                self._swap_out(trainer)

    # -- the average ----------------------------------------------------------------------------------------
    def _bind(self, strategy: Strategy) -> None:
        """Follow `strategy`'s pieces; an average of another strategy's (an earlier Trainer's) is dropped."""
        if strategy is self._strategy:
            return
        self._strategy, self._average, self._stash, self._swapped = strategy, None, [], False
        self.updates, self._latest_step = 0, 0
        self._pieces = [p for p in strategy.master_pieces() if p.trainable]

    def _catch_up(self, trainer: Trainer) -> None:
        """Update once for an optimizer step that has not been considered yet (from on_train_batch_end, or from a
        save that another callback makes earlier in the same hook)."""
        step = trainer.global_step
        if trainer.state.stage != "fit" or step <= self._latest_step:
            return
        self._latest_step = step
        if self.should_update(step - 1):
            self._update(trainer)

    def _update(self, trainer: Trainer) -> None:
        self._bind(trainer.strategy)
        if self._average is None:
            self._average = [torch.empty_like(p.data, dtype=_average_dtype(p.data.dtype)) for p in self._pieces]
        weights = [p.data.to(a.dtype) for p, a in zip(self._pieces, self._average)]  # (no copy: same dtype)
        if self._average and self.updates == 0:
            torch._foreach_copy_(self._average, weights)
        elif self._average:
            torch._foreach_lerp_(self._average, weights, 1.0 - self.decay)
        self.updates += 1

    # -- swapping for evaluation ----------------------------------------------------------------------------
    def _swap_in(self, trainer: Trainer) -> None:
        if not self.evaluate_with_ema or self._swapped:
            return
        if self.updates == 0:
            if trainer.state.stage != "fit" and trainer.is_global_zero and not self._warned:
                self._warned = True
                warnings.warn(
                    f"EMA: the average holds nothing (no update, and no checkpoint with one loaded): "
                    f"{trainer.state.stage} runs with the trained weights",
                    stacklevel=2,
                )
            return
        self._apply(trainer)

    def _apply(self, trainer: Trainer) -> None:
        self._bind(trainer.strategy)
        self._exchange(back=False)
        self._swapped = True
        trainer.strategy.master_pieces_changed()

    def _swap_out(self, trainer: Trainer) -> None:
        if self._swapped:
            self._exchange(back=True)
            self._swapped = False
            trainer.strategy.master_pieces_changed()

    def _exchange(self, back: bool) -> None:
        """Swap the average with the master pieces in place; where their dtypes differ (bf16 weights, an fp32
        average) the trained pieces are kept aside instead and copied back."""
        if not back:
            self._stash = [
                None if a.dtype == p.data.dtype else p.data.clone() for p, a in zip(self._pieces, self._average)
            ]
        with torch.no_grad():
            for piece, average, kept in zip(self._pieces, self._average, self._stash):
                if kept is None:
                    _swap_(piece.data, average)
                else:
                    piece.data.copy_(kept if back else average)
        if back:
            self._stash = []

    # -- checkpoints ----------------------------------------------------------------------------------------
    def sharded_state(self, trainer: Trainer) -> dict[str, dict[str, Any]]:
        self._catch_up(trainer)
        if self._swapped:
            raise RuntimeError(
                "EMA: a checkpoint cannot be written while the average is swapped in for "
                f"{trainer.state.stage}; save from on_validation_end or outside evaluation"
            )
        if self.updates == 0 or not trainer.strategy.model_state().writes_pieces:
            return {}
        return {KEY: self._as_flat_pieces()}

    def sharded_state_targets(
        self, trainer: Trainer, saved: dict[str, dict[str, torch.Tensor]]
    ) -> dict[str, dict[str, Any]]:
        self._bind(trainer.strategy)
        stored = saved.get(KEY)
        if stored is None:
            if trainer.is_global_zero:
                warnings.warn(
                    "EMA: the checkpoint holds no average (ema.*); it starts again with the next update", stacklevel=2
                )
            self._average, self.updates = None, 0
            return {}
        missing = sorted({p.name for p in self._pieces} - set(stored))
        if missing:
            raise ValueError(
                f"EMA: the checkpoint's average (ema.*) has no entry for the trainable parameters "
                f"{missing}; it was written for another model"
            )
        self._average = [torch.empty_like(p.data, dtype=_average_dtype(p.data.dtype)) for p in self._pieces]
        self.updates = max(self.updates, 1)  # (a resume then restores the count with the callback state)
        return {KEY: self._as_flat_pieces()}

    def _as_flat_pieces(self) -> dict[str, FlatPieces]:
        out: dict[str, FlatPieces] = {}
        for piece, average in zip(self._pieces, self._average):
            entry = out.setdefault(piece.name, FlatPieces(piece.shape, average.dtype, []))
            entry.pieces.append((piece.start, average))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"updates": self.updates, "latest_update_step": self._latest_step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict["updates"] and self._average is None:
            raise ValueError(
                f"EMA: the checkpoint's callback state counts {state_dict['updates']} update(s) of the "
                "average but holds no average (ema.*)"
            )
        self.updates, self._latest_step = state_dict["updates"], state_dict["latest_update_step"]


def _average_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _swap_(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exchange the contents of two 1-D tensors of one dtype, a chunk at a time."""
    for start in range(0, a.numel(), SWAP_CHUNK):
        x, y = a[start : start + SWAP_CHUNK], b[start : start + SWAP_CHUNK]
        kept = x.clone()
        x.copy_(y)
        y.copy_(kept)
