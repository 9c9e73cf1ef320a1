"""Experiment loggers: the `Logger` contract and `TensorBoardLogger` (CSVLogger and MLFlowLogger have files of their
own).

Loggers write from global rank 0 only. The Trainer sets `logger.rank = trainer.global_rank` before first use
and makes every rank agree on the version: `logger.version = strategy.broadcast(logger.version, src=0)`. A Trainer
takes several loggers at once (`logger=[TensorBoardLogger(...), CSVLogger(...)]`): each gets every write.
"""

from __future__ import annotations

import os
import re
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

import torch


class Logger:
    """The base of experiment loggers: what the Trainer and callbacks need from one. Writes happen on rank 0 only.

    Subclass it to write to another backend; every method is a no-op here. The Trainer sets `logger.rank` to the
    global rank before first use and makes every rank agree on `version` (rank 0's). Pass loggers to
    `Trainer(logger=...)`, one or a list (each gets every write).
    """

    rank: int = 0
    """The global rank of this process; only rank 0 writes."""

    @property
    def name(self) -> str:
        """The experiment's name."""
        return ""

    @property
    def version(self) -> int | str | None:
        """The run's version within the experiment."""
        return None

    @property
    def save_dir(self) -> str | None:
        """The root folder of the logger's files."""
        return None

    @property
    def log_dir(self) -> str | None:
        """Where this run's files go; the default home of `ModelCheckpoint`'s checkpoints."""
        return None

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Write metric values.

        Args:
            metrics: numbers or scalar tensors, by name.
            step: the step they belong to (the Trainer passes `global_step`).
        """

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace) -> None:
        """Write the hyperparameters (`save_hyperparameters`).

        Args:
            params: the hyperparameters, by name.
        """

    def save(self) -> None:
        """Flush what was written (called at the end of each stage)."""

    def finalize(self, status: str) -> None:
        """Close the run; the default calls `save`.

        Args:
            status: `"success"`, `"failed"` or `"interrupted"`.
        """
        self.save()

    def state_dict(self) -> dict[str, Any]:
        """What to keep of the logger in a checkpoint (e.g. `WandbLogger`'s run id, so that a resumed training
        continues the same run); the default is an empty dict."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, when training resumes from a checkpoint (before the first write).

        Args:
            state_dict: the dict `state_dict` returned when the checkpoint was saved.
        """

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Called when a `ModelCheckpoint`'s save is complete (on rank 0; on a background thread for an async
        save).

        Args:
            checkpoint_callback: the `ModelCheckpoint`.
        """


class _NoOpWriter:
    """The SummaryWriter's stand-in on ranks other than 0: `logger.experiment.add_x(...)` works anywhere."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class TensorBoardLogger(Logger):
    """Writes TensorBoard event files to `save_dir/name/version_<n>/` with `torch.utils.tensorboard`.

    `Trainer(logger=True)` (the default) makes one with `save_dir=default_root_dir`. The `SummaryWriter` is created
    on rank 0 at the first write.

    Args:
        save_dir: the root folder.
        name: the experiment's folder under `save_dir`; `None` or `""` for none.
        version: the run's folder: an int n gives `version_<n>`, a string is used as the folder name; `None` takes
            the next free `version_<n>` when first asked for.
        **writer_kwargs: keyword arguments for `torch.utils.tensorboard.SummaryWriter`.

    Raises:
        ValueError: when a logged metric is not a number or a scalar tensor.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike = "runs",
        name: str | None = "default",
        version: int | str | None = None,
        **writer_kwargs: Any,
    ) -> None:
        self._save_dir = os.fspath(save_dir)
        self._name = name or ""
        self._version = version
        self._writer_kwargs = writer_kwargs
        self._writer: Any = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def save_dir(self) -> str:
        return self._save_dir

    @property
    def root_dir(self) -> str:
        """`save_dir/name`: the folder of the experiment's versions."""
        return os.path.join(self._save_dir, self._name)

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = _next_free_version(self.root_dir)
        return self._version

    @version.setter
    def version(self, value: int | str) -> None:
        if self._writer is not None and value != self._version:
            raise RuntimeError(f"TensorBoardLogger already writes version {self._version!r}; can't change it")
        self._version = value

    @property
    def log_dir(self) -> str:
        """`save_dir/name/version_<n>` (or the string version): this run's folder."""
        version = self.version
        return os.path.join(self.root_dir, version if isinstance(version, str) else f"version_{version}")

    @property
    def experiment(self) -> Any:
        """The SummaryWriter (created on first use) on rank 0; a writer that does nothing on other ranks."""
        if self.rank != 0:
            return _NoOpWriter()
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # slow import: only when something is written

            os.makedirs(self.log_dir, exist_ok=True)
            self._writer = SummaryWriter(log_dir=self.log_dir, **self._writer_kwargs)
        return self._writer

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if self.rank != 0:
            return
        writer = self.experiment
        for key, value in metrics.items():
            if isinstance(value, Mapping):
                writer.add_scalars(key, {k: _to_scalar(key, v) for k, v in value.items()}, step)
            else:
                writer.add_scalar(key, _to_scalar(key, value), step)

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace) -> None:
        """Write the hyperparameters to the HParams dashboard (in this run's event file) and as a table in the
        Text dashboard; nested dicts become `"a/b"` names.

        Args:
            params: the hyperparameters, by name.
        """
        if self.rank != 0:
            return
        from torch.utils.tensorboard.summary import hparams

        flat = _flatten(vars(params) if isinstance(params, Namespace) else dict(params))
        if not flat:
            return
        writer = self.experiment
        file_writer = writer._get_file_writer()  # add_hparams would start a separate run in a subdirectory
        for summary in hparams(flat, {}):
            file_writer.add_summary(summary)
        table = "\n".join(["| name | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in flat.items()])
        writer.add_text("hparams", table)

    def save(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def finalize(self, status: str) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None  # a later write (e.g. `trainer.test` after `fit`) opens a new event file

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_writer": None}


def _next_free_version(root_dir: str) -> int:
    if not os.path.isdir(root_dir):
        return 0
    found = [re.fullmatch(r"version_(\d+)", entry) for entry in os.listdir(root_dir)]
    versions = [int(m.group(1)) for m in found if m and os.path.isdir(os.path.join(root_dir, m.group(0)))]
    return max(versions) + 1 if versions else 0


def _to_scalar(name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"Cannot log metric {name!r}: tensor of shape {tuple(value.shape)} is no scalar")
        return value.item()
    if isinstance(value, bool | int | float):
        return value
    kind = type(value).__name__
    raise ValueError(f"Cannot log metric {name!r} of type {kind}: need a number or a scalar tensor")


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts become "a/b" keys; values TensorBoard cannot show become their string form."""
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, prefix=f"{name}/"))
        elif isinstance(value, torch.Tensor) and value.numel() == 1:
            flat[name] = value.item()
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat
