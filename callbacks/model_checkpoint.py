"""When to save checkpoints and which to keep: the best `save_top_k` by a monitored metric, and `last`."""

from __future__ import annotations

import logging
import math
import os
import re
import warnings
from typing import TYPE_CHECKING, Any

import torch

from callbacks._monitor import broadcast_metrics, check_mode, why_missing
from callbacks.base import Callback

if TYPE_CHECKING:
    from trainer import Trainer, TrainModule

log = logging.getLogger(__name__)


class ModelCheckpoint(Callback):
    """Saves checkpoints (directories written by `trainer.save_checkpoint`) during `fit`, like Lightning's
    `ModelCheckpoint`, and keeps the best `save_top_k` of them.

    The Trainer adds one with the defaults unless `enable_checkpointing=False`. Every rank takes the same
    decisions: they are made from rank 0's metrics, broadcast. Checkpoints that fall out of the top k are deleted
    by rank 0 after the new one is complete on every rank.

    Args:
        dirpath: the folder of the checkpoints; `None` for `<trainer.log_dir or trainer.default_root_dir>/checkpoints`.
        filename: a name template such as `"{epoch}-{val/loss:.3f}"`, filled from the logged metrics, `epoch`
            and `step` (with `auto_insert_metric_name` it gives `"epoch=3-val_loss=0.123"`); `None` for
            `"{epoch}-{step}"`.
        monitor: the logged metric that ranks the checkpoints; `None` ranks them by step (the most recent are
            kept).
        mode: `"min"` (lower `monitor` is better) or `"max"`.
        save_top_k: how many checkpoints to keep: the best by `monitor`; `-1` keeps all, `0` none (apart from
            `last`).
        save_last: also write `dirpath/last` at every save, replaced only once the new one is complete (when a
            top-k checkpoint is written at the same step, `last` is hard links to its files, not a second save).
        every_n_train_steps: save every n optimizer steps; `None` or `0` for not by steps.
        every_n_epochs: save every n epochs (after validation, or at the end of the training epoch without
            validation); `None` means 1 when `every_n_train_steps` is not set either, else 0 (not by epochs).
        save_on_train_epoch_end: save at the end of the training epoch (`True`) or after validation (`False`);
            `None` for after validation when there is validation.
        auto_insert_metric_name: write `name=` before each value in `filename` (a `/` in a name becomes `_`).
        verbose: log (at INFO level, on rank 0) when a checkpoint is not in the top k.
        async_save: write the files in the background while training goes on (see `Trainer.save_checkpoint`);
            checkpoints that fall out of the top k are removed once the new one is in place.

    Raises:
        ValueError: if `mode` is not `"min"` or `"max"`; `save_top_k < -1`; `every_n_train_steps` or
            `every_n_epochs` is negative, or both are positive. During `fit`: if `monitor` is not logged when a
            save at an epoch's end is due, or was never logged when `fit` ends (the message lists the logged
            metrics).

    Attributes:
        best_model_path: the path of the best checkpoint so far (`""` before the first).
        best_model_score: the monitored value of the best checkpoint (a tensor), or None.
        last_model_path: the path of the latest `last` checkpoint (`""` before the first).
        best_k_models: the kept checkpoints' paths and their monitored values.
    """

    CHECKPOINT_NAME_LAST = "last"

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = None,
        monitor: str | None = None,
        *,
        mode: str = "min",
        save_top_k: int = 1,
        save_last: bool | None = None,
        every_n_train_steps: int | None = None,
        every_n_epochs: int | None = None,
        save_on_train_epoch_end: bool | None = None,
        auto_insert_metric_name: bool = True,
        verbose: bool = False,
        async_save: bool = False,
    ) -> None:
        check_mode("ModelCheckpoint", mode)
        _check_triggers(save_top_k, every_n_train_steps, every_n_epochs)
        self.dirpath = _realpath(dirpath) if dirpath is not None else None
        self.filename = filename
        self.monitor = monitor
        self.mode = mode
        self.save_top_k = save_top_k
        self.save_last = save_last
        self.save_on_train_epoch_end = save_on_train_epoch_end
        self.auto_insert_metric_name = auto_insert_metric_name
        self.verbose = verbose
        self.async_save = async_save
        both_unset = every_n_train_steps is None and every_n_epochs is None
        self.every_n_epochs = 1 if both_unset else (every_n_epochs or 0)
        self.every_n_train_steps = every_n_train_steps or 0

        self.best_k_models: dict[str, torch.Tensor] = {}
        self.kth_best_model_path = ""
        self.kth_value: torch.Tensor | None = None
        self.best_model_path = ""
        self.best_model_score: torch.Tensor | None = None
        self.current_score: torch.Tensor | None = None
        self.last_model_path = ""
        self._last_global_step_saved = 0
        self._dirpath_resolved = False
        self._pending_state: dict[str, Any] | None = None
        self._restored_paths: set[str] = set()  # checkpoints this callback wrote in the run it resumes
        self._epoch_ended = False  # in this fit: only then is a monitored metric never logged an error
        self._due: list[tuple[str, list[str]]] = []  # (path, checkpoints to remove once it is in place)

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self.every_n_train_steps,
            every_n_epochs=self.every_n_epochs,
        )

    # -- hooks ----------------------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, module: TrainModule, stage: str) -> None:
        root = trainer.log_dir or trainer.default_root_dir
        dirpath = self.dirpath or _realpath(os.path.join(root, "checkpoints"))
        self.dirpath = trainer.strategy.broadcast(dirpath, src=0)
        self._dirpath_resolved = True
        self._epoch_ended = False
        if stage == "fit" and trainer.is_global_zero and os.path.isdir(dirpath):
            from strategies.checkpoint.files import remove_incomplete

            remove_incomplete(dirpath)  # staging folders of saves that crashed or were killed
            if os.listdir(dirpath):
                warnings.warn(f"Checkpoint directory {dirpath} exists and is not empty.", stacklevel=2)
        if self._pending_state is not None:
            self._restore(self._pending_state)
            self._pending_state = None

    def on_train_batch_end(
        self, trainer: Trainer, module: TrainModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        n = self.every_n_train_steps
        if n >= 1 and trainer.global_step % n == 0 and not self._skip(trainer):
            self._save(trainer, strict=False)  # a validation metric may not exist yet: warn, save only `last`

    def on_train_epoch_end(self, trainer: Trainer, module: TrainModule) -> None:
        self._epoch_ended = True
        if self._on_train_epoch_end(trainer) and self._epoch_due(trainer) and not self._skip(trainer):
            self._save(trainer, strict=True)

    def on_validation_end(self, trainer: Trainer, module: TrainModule) -> None:
        if not self._on_train_epoch_end(trainer) and self._epoch_due(trainer) and not self._skip(trainer):
            self._save(trainer, strict=True)

    def on_train_end(self, trainer: Trainer, module: TrainModule) -> None:
        # max_steps ended fit inside an epoch, whose end would have saved: keep what was trained, as Lightning
        # does (the checkpoint resumes at the next batch of that epoch)
        inside_an_epoch = trainer.state.batches_done_in_epoch > 0
        if inside_an_epoch and self.every_n_epochs >= 1 and not self._skip(trainer):
            self._save(trainer, strict=False)
        if self.monitor is None or self.save_top_k == 0 or not self._epoch_ended or trainer.sanity_checking:
            return
        logged = [k for k in broadcast_metrics(trainer) if k not in ("epoch", "step")]
        if self.monitor not in logged:
            raise ValueError(
                f"ModelCheckpoint(monitor={self.monitor!r}) saved nothing: {self.monitor!r} was never logged by the "
                f"end of epoch {trainer.current_epoch - 1}; logged: {sorted(logged)}. Log it with "
                f"self.log({self.monitor!r}, value), and if it is a validation metric check that validation runs "
                f"(val_check_interval, check_val_every_n_epoch, limit_val_batches).{why_missing(trainer)}"
            )

    def _skip(self, trainer: Trainer) -> bool:
        return (
            trainer.state.stage != "fit"
            or trainer.sanity_checking
            or trainer.global_step == self._last_global_step_saved
        )

    def _on_train_epoch_end(self, trainer: Trainer) -> bool:
        if self.save_on_train_epoch_end is not None:
            return self.save_on_train_epoch_end
        return not trainer.num_val_batches

    def _epoch_due(self, trainer: Trainer) -> bool:
        return self.every_n_epochs >= 1 and (trainer.current_epoch + 1) % self.every_n_epochs == 0

    # -- saving ---------------------------------------------------------------------------------------------
    def _save(self, trainer: Trainer, strict: bool) -> None:
        trainer.checkpointer.wait()  # the previous save is in place before names and the top k are decided
        metrics = broadcast_metrics(trainer)
        self._save_top_k(trainer, metrics, strict)
        self._save_last(trainer)
        self._write(trainer)

    def _save_top_k(self, trainer: Trainer, metrics: dict[str, float], strict: bool) -> None:
        if self.save_top_k == 0:
            return
        if self.monitor is not None and self.monitor not in metrics:
            message = (
                f"ModelCheckpoint(monitor={self.monitor!r}) could not find the monitored metric in "
                f"the logged metrics: {sorted(k for k in metrics if k not in ('epoch', 'step'))}. "
                f"Log it with self.log({self.monitor!r}, value).{why_missing(trainer)}"
            )
            if strict:
                raise ValueError(message)
            warnings.warn(message, stacklevel=2)
            return
        current = self._score(metrics)
        if not self._is_top_k(current):
            if self.verbose and trainer.is_global_zero:
                log.info(f"Step {trainer.global_step}: {self.monitor}={current:.6g} is not in the top k")
            return
        self._update_best_and_save(trainer, current, metrics)

    def _score(self, metrics: dict[str, float]) -> float:
        """The monitored value (NaN ranks worst); without `monitor` the step: the most recent ranks best."""
        if self.monitor is None:
            return float(metrics["step"])
        current = metrics[self.monitor]
        return (math.inf if self.mode == "min" else -math.inf) if math.isnan(current) else current

    @property
    def _effective_mode(self) -> str:
        return "max" if self.monitor is None else self.mode

    def _better(self, a: float, b: float) -> bool:
        return a < b if self._effective_mode == "min" else a > b

    def _is_top_k(self, current: float) -> bool:
        if self.save_top_k == -1 or len(self.best_k_models) < self.save_top_k:
            return True
        return self.kth_value is not None and self._better(current, float(self.kth_value))

    def _update_best_and_save(self, trainer: Trainer, current: float, metrics: dict[str, float]) -> None:
        removed = []
        while self.save_top_k > 0 and len(self.best_k_models) >= self.save_top_k:
            removed.append(self._worst_path())
            self.best_k_models.pop(removed[-1])
        path = self._new_path(trainer, metrics, reusable=removed)
        self.current_score = torch.tensor(current)
        self.best_k_models[path] = self.current_score
        self._update_best()
        if self.verbose and trainer.is_global_zero:
            log.info(f"Step {trainer.global_step}: saving {path} ({self.monitor or 'step'} = {current:.6g})")
        stale = [p for p in removed if self._should_remove(trainer, p, path)]
        self._save_checkpoint(trainer, path, remove=stale)

    def _worst_path(self) -> str:
        pick = max if self._effective_mode == "min" else min
        return pick(self.best_k_models, key=lambda p: float(self.best_k_models[p]))

    def _update_best(self) -> None:
        pick = min if self._effective_mode == "min" else max
        best = pick(self.best_k_models, key=lambda p: float(self.best_k_models[p]))
        self.best_model_path = best
        self.best_model_score = self.best_k_models[best] if self.monitor is not None else None
        if self.save_top_k > 0 and len(self.best_k_models) >= self.save_top_k:
            self.kth_best_model_path = self._worst_path()
            self.kth_value = self.best_k_models[self.kth_best_model_path]

    def _save_last(self, trainer: Trainer) -> None:
        if not self.save_last:
            return
        previous = self.last_model_path
        path = self.last_model_path = os.path.join(self.dirpath, self.CHECKPOINT_NAME_LAST)
        stale = [previous] if previous and self._should_remove(trainer, previous, path) else []
        self._save_checkpoint(trainer, path, remove=stale)

    def _save_checkpoint(self, trainer: Trainer, path: str, remove: list[str]) -> None:
        """Saves to `path` (with the other paths due at this step, in `_write`); `remove` is removed afterwards.
        The state saved with the checkpoint is already updated to include it."""
        self._last_global_step_saved = trainer.global_step
        self._due.append((path, remove))

    def _write(self, trainer: Trainer) -> None:
        """One save for every path due at this step (the others are links to it); rank 0 removes the stale
        checkpoints once it is in place on every rank. `trainer.save_checkpoint` writes aside and renames, so an
        existing checkpoint is replaced only by a complete one."""
        if not self._due:
            return
        due, self._due = self._due, []
        stale = [old for _, remove in due for old in remove] if trainer.is_global_zero else []

        def remove_stale() -> None:  # on rank 0, once the save is complete
            from strategies.checkpoint.files import remove

            for old in stale:
                remove(old)
            for logger in trainer.loggers:
                logger.after_save_checkpoint(self)

        links = [path for path, _ in due[1:]]
        trainer.checkpointer.save(trainer, due[0][0], async_save=self.async_save, links=links, on_done=remove_stale)

    def _new_path(self, trainer: Trainer, metrics: dict[str, float], reusable: list[str]) -> str:
        """The formatted name in `dirpath`, with "-v<n>" added if a checkpoint we keep has that name."""
        path = None
        if trainer.is_global_zero:
            name = self.format_checkpoint_name(metrics)
            path = os.path.join(self.dirpath, name)
            version = 1
            while os.path.exists(path) and path not in reusable:
                path = os.path.join(self.dirpath, f"{name}-v{version}")
                version += 1
        return trainer.strategy.broadcast(path, src=0)

    def _should_remove(self, trainer: Trainer, previous: str, current: str) -> bool:
        """Only checkpoints inside `dirpath`, never the new one, nor the one this run resumed from unless this
        callback wrote it itself (in the run it resumes: a restarted job must not pile up checkpoints)."""
        previous = _realpath(previous)
        if previous == _realpath(current):
            return False
        resumed_from = trainer.ckpt_path is not None and previous == _realpath(trainer.ckpt_path)
        if resumed_from and previous not in self._restored_paths:
            return False
        return os.path.commonpath([previous, self.dirpath]) == self.dirpath

    def format_checkpoint_name(self, metrics: dict[str, Any]) -> str:
        """Fill `filename` from `metrics`: `"{epoch}-{val/loss:.2f}"` gives `"epoch=2-val_loss=0.31"`.

        Args:
            metrics: values by name; names missing from it are filled with 0.

        Returns:
            The checkpoint's name (without the folder).
        """
        template = self.filename or "{epoch}-{step}"
        metrics = dict(metrics)
        for group in sorted(re.findall(r"(\{.*?)[:\}]", template), key=len, reverse=True):
            name = group[1:]
            if self.auto_insert_metric_name:
                template = template.replace(group, f"{name.replace('/', '_')}={{{name}")
            template = template.replace(group, f"{{0[{name}]")
            metrics.setdefault(name, 0)
        return template.format(metrics)

    # -- state ----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "dirpath": self.dirpath,
            "best_model_path": self.best_model_path,
            "best_model_score": _float(self.best_model_score),
            "current_score": _float(self.current_score),
            "best_k_models": {path: float(score) for path, score in self.best_k_models.items()},
            "kth_best_model_path": self.kth_best_model_path,
            "kth_value": _float(self.kth_value),
            "last_model_path": self.last_model_path,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._dirpath_resolved:
            self._restore(state_dict)
        else:  # the default dirpath is known only in `setup`
            self._pending_state = dict(state_dict)

    def _restore(self, state: dict[str, Any]) -> None:
        self.best_model_path = state["best_model_path"]
        if state.get("dirpath") != self.dirpath:
            warnings.warn(
                f"ModelCheckpoint's dirpath changed from {state.get('dirpath')!r} to "
                f"{self.dirpath!r}: only best_model_path is restored, the top-k bookkeeping starts "
                "afresh.",
                stacklevel=2,
            )
            return
        self.best_model_score = _tensor(state["best_model_score"])
        self.current_score = _tensor(state.get("current_score"))
        self.best_k_models = {path: torch.tensor(score) for path, score in state["best_k_models"].items()}
        self.kth_best_model_path = state["kth_best_model_path"]
        self.kth_value = _tensor(state["kth_value"])
        self.last_model_path = state["last_model_path"]
        self._restored_paths = {_realpath(p) for p in [*self.best_k_models, self.last_model_path] if p}


def _check_triggers(save_top_k: int, every_n_train_steps: int | None, every_n_epochs: int | None) -> None:
    if save_top_k < -1:
        raise ValueError(f"ModelCheckpoint(save_top_k={save_top_k}) must be >= -1 (-1 keeps all checkpoints)")
    for name, value in (("every_n_train_steps", every_n_train_steps), ("every_n_epochs", every_n_epochs)):
        if value is not None and value < 0:
            raise ValueError(f"ModelCheckpoint({name}={value}) must be >= 0")
    if (every_n_train_steps or 0) > 0 and (every_n_epochs or 0) > 0:
        raise ValueError(
            "ModelCheckpoint: `every_n_train_steps` and `every_n_epochs` are mutually exclusive;"
            f" got every_n_train_steps={every_n_train_steps}, every_n_epochs={every_n_epochs}"
        )


def _realpath(path: str | os.PathLike) -> str:
    return os.path.realpath(os.path.expanduser(os.fspath(path)))


def _float(value: torch.Tensor | None) -> float | None:
    return None if value is None else float(value)


def _tensor(value: float | None) -> torch.Tensor | None:
    return None if value is None else torch.tensor(value)
