"""DataModule (Lightning's LightningDataModule): the data of a run in one object.

`prepare_data()` runs once per machine (on local rank 0, while the other ranks wait) before any rank reads the data,
so downloads and tokenisation are not raced; `setup(stage)` runs on every rank ("fit", "validate", "test",
"predict"); the `*_dataloader()` methods give the loaders; `teardown(stage)` runs at the end of the stage;
`state_dict()` / `load_state_dict()` travel in checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .hparams import AttributeDict, HyperparametersMixin

if TYPE_CHECKING:
    from .trainer import Trainer


class DataHooks:
    """Where data comes from, for a DataModule and a TrainModule alike (as Lightning's DataHooks)."""

    def prepare_data(self) -> None:
        """Download or write the data; runs once per machine (on local rank 0, while the other ranks wait), before
        `setup`. Do not set state here: the other ranks do not run it."""

    def setup(self, stage: str) -> None:
        """Build the datasets of `stage`; runs on every rank at the start of each stage.

        Args:
            stage: `"fit"`, `"validate"`, `"test"` or `"predict"`.
        """

    def teardown(self, stage: str) -> None:
        """Release what `setup` built; runs on every rank at the end of each stage.

        Args:
            stage: `"fit"`, `"validate"`, `"test"` or `"predict"`.
        """

    def train_dataloader(self) -> Any:
        """The training `DataLoader`, used by `fit` when none is passed to it; the default returns None."""
        return None

    def val_dataloader(self) -> Any:
        """The validation `DataLoader`, used by `fit` and `validate` when none is passed; the default returns None
        (no validation)."""
        return None

    def test_dataloader(self) -> Any:
        """The test `DataLoader`, used by `test` when none is passed; the default returns None."""
        return None

    def predict_dataloader(self) -> Any:
        """The `DataLoader` of `predict` when none is passed; the default returns None."""
        return None


class DataModule(HyperparametersMixin, DataHooks):
    """The data of a run in one object (Lightning's `LightningDataModule`).

    Subclass it and define `prepare_data`, `setup` and the `*_dataloader` methods; pass it to `Trainer.fit`
    (`fit(module, datamodule=dm)`, or in the place of the training loader), `validate`, `test` or `predict`.
    Its `state_dict` is saved in checkpoints and given back to `load_state_dict` when resuming.
    """

    def __init__(self) -> None:
        self.trainer: Trainer | None = None
        self.hparams = AttributeDict()

    def state_dict(self) -> dict[str, Any]:
        """What to save of the data in a checkpoint; the default is an empty dict."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, when resuming from a checkpoint.

        Args:
            state_dict: the dict `state_dict` returned when the checkpoint was saved.
        """


def datamodule_in(*given: Any, datamodule: DataModule | None = None) -> tuple[tuple, DataModule | None]:
    """Lightning also takes the DataModule in the first loader's place (`fit(model, dm)`) or, by position, where
    this Trainer has ckpt_path (`fit(model, None, None, dm)`): find it there; the others as given."""
    found = [value for value in given if isinstance(value, DataModule)]
    if datamodule is not None and not isinstance(datamodule, DataModule):
        raise TypeError(f"datamodule must be a trainer.DataModule, got {type(datamodule).__name__}")
    if found and datamodule is not None or len(found) > 1:
        raise ValueError("a DataModule was given twice; pass it once, as datamodule=")
    rest = tuple(None if isinstance(value, DataModule) else value for value in given)
    return rest, datamodule or (found[0] if found else None)


def prepare_data(trainer: Trainer, holders: list[Any]) -> None:
    """Each holder's prepare_data(), once per machine (local rank 0) before any rank reads the data."""
    holders = [h for h in holders if h is not None and callable(getattr(h, "prepare_data", None))]
    if not holders:
        return
    if trainer.local_rank == 0:
        for holder in holders:
            holder.prepare_data()
    trainer.strategy.barrier()
