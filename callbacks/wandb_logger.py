"""WandbLogger (Lightning's name and arguments): metrics at their steps, hyperparameters and the command line's
config in the run's config, checkpoints as model artifacts, from rank 0 through wandb's own client.

The run id is chosen on rank 0 when first asked for (every rank agrees on it through the Trainer, as on any logger's
version) and kept in checkpoints, so a training resumed from one continues the same W&B run (`resume="allow"`).
`offline=True` (or `WANDB_MODE=offline`) writes the run under `save_dir/wandb/` for `wandb sync` later.

wandb is an optional dependency: it is imported on rank 0 when the run is first needed.
"""

from __future__ import annotations

import os
import secrets
import string
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from callbacks.loggers import Logger, _to_scalar

STEP_KEY = "trainer/global_step"  # Lightning's: every metric is plotted against it
EXIT_CODES = {"success": 0, "finished": 0, "failed": 1, "interrupted": 255}


def _wandb() -> Any:
    try:
        import wandb
    except ImportError as error:
        raise ImportError(
            "WandbLogger needs the wandb package (an optional dependency): "
            'pip install "shardtrain[wandb]" (or pip install wandb)'
        ) from error
    return wandb


def _new_id() -> str:
    """An id in wandb's format (8 lowercase letters and digits), made without importing wandb."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class WandbLogger(Logger):
    """Logs to Weights & Biases (Lightning's name and arguments), from rank 0: metrics with their step (as
    `trainer/global_step`), hyperparameters and the command line's config in the run's config, and checkpoints as
    model artifacts with `log_model`.

    A training resumed from a checkpoint continues the same W&B run: its id is kept in the checkpoint. `wandb` is an
    optional dependency, imported on rank 0 when the run is first needed.

    Args:
        name: the run's display name.
        save_dir: the folder under which wandb writes the run (`<save_dir>/wandb/`); checkpoints go to
            `<save_dir>/<project>/<id>/checkpoints`.
        version: the run id to use or resume (same as `id`).
        offline: write the run locally only (`wandb sync` uploads it later).
        dir: same as `save_dir` (wandb's name), used when `save_dir` is not given.
        id: the run id to use or resume; `None` for a new one.
        anonymous: log anonymously (wandb's `anonymous="allow"`).
        project: the W&B project; `None` for `$WANDB_PROJECT`, else `"lightning_logs"`.
        log_model: `True` logs the best (else last) checkpoint as a model artifact when training ends, `"all"` every
            checkpoint once saved, `False` none.
        experiment: an existing `wandb` run to log to.
        prefix: put before each metric's name, joined with `"-"`.
        checkpoint_name: the model artifact's name; `None` for `model-<id>`.
        **kwargs: further arguments of `wandb.init` (`entity`, `tags`, `group`, `resume`, `mode`, ...).

    Raises:
        ValueError: if `log_model` is not `False`, `True` or `"all"`; when a logged metric is not a number or a
            scalar tensor.
        ImportError: when the run is first needed, if `wandb` is not installed.
    """

    def __init__(
        self,
        name: str | None = None,
        save_dir: str | os.PathLike = ".",
        version: str | None = None,
        offline: bool = False,
        dir: str | os.PathLike | None = None,
        id: str | None = None,
        anonymous: bool | None = None,
        project: str | None = None,
        log_model: bool | str = False,
        experiment: Any = None,
        prefix: str = "",
        checkpoint_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if log_model not in (True, False, "all"):
            raise ValueError(f"WandbLogger: log_model={log_model!r}; use False, True or 'all'")
        if save_dir == "." and dir is not None:
            save_dir = dir
        self._save_dir = os.fspath(save_dir)
        self._project = project or os.environ.get("WANDB_PROJECT", "lightning_logs")
        self._id = version or id
        self._log_model, self._prefix, self._checkpoint_name = log_model, prefix, checkpoint_name
        self._init = {"name": name, "project": self._project, "dir": self._save_dir, "resume": "allow", **kwargs}
        if offline:
            self._init["mode"] = "offline"
        if anonymous:
            self._init["anonymous"] = "allow"
        self._experiment = experiment
        self._checkpoints: list[tuple[str, list[str]]] = []  # (path, aliases) to log, on the main thread

    # ---- the run ------------------------------------------------------------------------------------
    @property
    def experiment(self) -> Any:
        """The wandb run (started on rank 0 when first needed), as Lightning's `logger.experiment`."""
        if self._experiment is None and self.rank == 0:
            wandb = _wandb()
            os.makedirs(self._save_dir, exist_ok=True)
            self._experiment = wandb.init(id=self.version, **self._init)
            self._experiment.define_metric(STEP_KEY)
            self._experiment.define_metric("*", step_metric=STEP_KEY, step_sync=True)
        return self._experiment

    name = property(lambda self: self._project)
    save_dir = property(lambda self: self._save_dir)

    @property
    def version(self) -> str | None:
        """The run id (chosen on rank 0 when first asked for; the other ranks are told it by the Trainer)."""
        if self._experiment is not None:
            return self._experiment.id
        if self._id is None and self.rank == 0:
            self._id = _new_id()
        return self._id

    @version.setter
    def version(self, value: str | None) -> None:
        if self._experiment is not None and value != self._experiment.id:
            raise RuntimeError(f"WandbLogger already logs to run {self._experiment.id!r}; can't change it")
        self._id = value

    @property
    def root_dir(self) -> str:
        """`<save_dir>/<project>`: the folder of the runs' folders (a resumed training looks for its last
        checkpoint in all of them)."""
        return os.path.join(self._save_dir, self._project)

    @property
    def log_dir(self) -> str:
        """`<save_dir>/<project>/<id>`: where the run's checkpoints go by default (as Lightning puts them)."""
        return os.path.join(self.root_dir, str(self.version))

    def state_dict(self) -> dict[str, Any]:
        return {"id": self.version}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the checkpoint's run (unless this logger was given an id, or already started its run)."""
        if self._experiment is None and state_dict.get("id") and self._init.get("resume") != "never":
            self._id = state_dict["id"]

    # ---- writing ------------------------------------------------------------------------------------
    def log_hyperparams(self, params: Mapping[str, Any] | Namespace) -> None:
        if self.rank != 0:
            return
        values = vars(params) if isinstance(params, Namespace) else dict(params)
        self.experiment.config.update(_plain(values), allow_val_change=True)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if self.rank != 0:
            return
        row = {}
        for key, value in metrics.items():
            name = f"{self._prefix}-{key}" if self._prefix else key
            values = value.items() if isinstance(value, Mapping) else [("", value)]
            row.update({f"{name}/{k}" if k else name: _to_scalar(name, v) for k, v in values})
        if step is not None:
            row[STEP_KEY] = step
        self.experiment.log(row)
        self._log_checkpoints()

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Noted here (maybe on a background thread), logged as an artifact on the next write from the main
        thread."""
        if not self._log_model:
            return
        best, last = checkpoint_callback.best_model_path, checkpoint_callback.last_model_path
        path = best or last
        if not path:
            return
        entry = (path, ["latest", "best"] if best else ["latest"])
        self._checkpoints = [*self._checkpoints, entry] if self._log_model == "all" else [entry]

    def _log_checkpoints(self, ending: bool = False) -> None:
        if not (self._log_model == "all" or (self._log_model and ending)):
            return
        wandb = _wandb()
        entries, self._checkpoints = self._checkpoints, []
        for path, aliases in entries:
            if not os.path.exists(path):
                continue
            artifact = wandb.Artifact(
                self._checkpoint_name or f"model-{self.version}", type="model", metadata={"path": path}
            )
            if os.path.isdir(path):
                artifact.add_dir(path)
            else:
                artifact.add_file(path, name=Path(path).name)
            self.experiment.log_artifact(artifact, aliases=aliases)

    def finalize(self, status: str) -> None:
        """Log the checkpoint of `log_model=True` and finish the run (a later stage resumes it)."""
        if self.rank != 0 or self._experiment is None:
            return
        if status == "success":
            self._log_checkpoints(ending=True)
        self._id = self._experiment.id
        self._experiment.finish(exit_code=EXIT_CODES.get(status, 0))
        self._experiment = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_experiment": None}


def _plain(values: Mapping[str, Any]) -> dict[str, Any]:
    """Values wandb's config can hold: nested dicts kept, tensors as numbers, other objects as their text."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out[str(key)] = _plain(value)
        elif hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
            out[str(key)] = value.item()
        elif value is None or isinstance(value, bool | int | float | str | list | tuple):
            out[str(key)] = value
        else:
            out[str(key)] = str(value)
    return out
