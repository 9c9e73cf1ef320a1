"""fit's loaders, asked of the module (or datamodule) when Lightning asks for them: after `configure_optimizers` and
`on_fit_start`; the validation loader for the sanity check, then the training loader, then (without a sanity
check) the validation loader; with `limit_val_batches=0` never. Data that those hooks build from the global random
generator (Lightning's `BoringModel`: `RandomDataset`) is then the data Lightning's Trainer trains on under the same
seed. `trainer.estimated_stepping_batches` builds the training loader earlier, as Lightning's does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .global_batch import DataLayout, layout_of, resumed_batches, warn_if_the_global_batch_changed
from .loader_state import check_world_size
from .loaders import limit_batches, stop_workers
from .stream_remainder import remainder_to_read

if TYPE_CHECKING:
    from ..trainer import Trainer

_UNBUILT = object()


class FitLoaders:
    def __init__(self, trainer: Trainer, make_train: Callable[[], Any], make_val: Callable[[], Any]) -> None:
        self.trainer = trainer
        self._make_train, self._make_val = make_train, make_val
        self._train: Any = _UNBUILT
        self._val: Any = _UNBUILT

    @property
    def train(self) -> Any:
        """The training loader, built at the first use; its batches per epoch are in num_training_batches."""
        if self._train is _UNBUILT:
            t = self.trainer
            self._train = self._make_train()
            t.loader_position.attach(self._train)
            t.num_training_batches = limit_batches(self._train, t.limit_train_batches, "limit_train_batches")
            self._lay_out(t)
        return self._train

    def _lay_out(self, t: Trainer) -> None:
        """The accumulation from `global_batch_size`, and a resumed epoch's position in this run's batches when
        the checkpoint's run split its data another way (global_batch.py)."""
        if t.state.epoch_complete:  # resumed after an epoch's last batch: nothing of it is left to read
            t.loader_position.pending = None
        remainder = remainder_to_read(t, self._train)  # a split HuggingFace stream, on another number of ranks
        if t.loader_position.pending is not None:  # a loader's own state, per rank: refused on another world size
            check_world_size(t.loader_position, t.world_size, t.global_rank, self._train)
        t.data_layout = layout_of(t, self._train)
        t.accumulate_grad_batches = t.data_layout.accumulate
        if t.resumed_layout is None:
            return
        saved = DataLayout(**t.resumed_layout)
        warn_if_the_global_batch_changed(saved, t.data_layout)
        if remainder is not None:
            t.loader_position.remainder = remainder
            t.state.batches_done_in_epoch = remainder.batches_done(saved, t.data_layout, t.state.batches_done_in_epoch)
        elif not t.state.epoch_complete:
            t.state.batches_done_in_epoch = resumed_batches(
                saved, t.data_layout, t.state.batches_done_in_epoch, t.restore_loader_state
            )

    def stop_workers(self) -> None:
        """At the end of fit: the workers the loaders built keep stop (loaders.stop_workers),
        the training loader's position kept first for a checkpoint saved after fit."""
        self.trainer.loader_position.keep()
        for loader in (self._train, self._val):
            stop_workers(loader)

    @property
    def val(self) -> Any:
        """The validation loader (None without validation), built at the first use; its batches per run are in
        num_val_batches."""
        if self._val is _UNBUILT:
            t = self.trainer
            self._val = None if t.limit_val_batches == 0 else self._make_val()
            if self._val is not None:
                t.num_val_batches = limit_batches(self._val, t.limit_val_batches, "limit_val_batches")
        return self._val
