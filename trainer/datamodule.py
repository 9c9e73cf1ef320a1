"""DataModule (Lightning's LightningDataModule): the data of a run in one object.

`prepare_data()` runs once per machine (on local rank 0, while the other ranks wait) before any rank reads the data,
so downloads and tokenisation are not raced; `setup(stage)` runs on every rank ("fit", "validate", "test",
"predict"); the `*_dataloader()` methods give the loaders; `teardown(stage)` runs at the end of the stage;
`state_dict()` / `load_state_dict()` travel in checkpoints.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from .hparams import AttributeDict
from .hparams import collect as collect_hparams

if TYPE_CHECKING:
    from .trainer import Trainer


class DataModule:
    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.hparams = AttributeDict()

    def save_hyperparameters(self, *args: Any, ignore: Any = None, **hparams: Any) -> None:
        """As TrainModule.save_hyperparameters: with no arguments, every `__init__` argument."""
        frame = inspect.currentframe().f_back
        try:
            self.hparams.update(collect_hparams(frame, self, args, ignore, hparams))
        finally:
            del frame

    def prepare_data(self) -> None:
        """Download or write the data; once per machine."""

    def setup(self, stage: str) -> None:
        """Build the datasets of `stage`; on every rank."""

    def teardown(self, stage: str) -> None:
        """Release what `setup` built."""

    def train_dataloader(self) -> Any:
        return None

    def val_dataloader(self) -> Any:
        return None

    def test_dataloader(self) -> Any:
        return None

    def predict_dataloader(self) -> Any:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
