"""MLFlowLogger (Lightning's name and arguments): hyperparameters as params, metrics by step, and the checkpoint
path as a tag, through MLflow's client, from rank 0.

`tracking_uri`: the MLflow server or store (default: $MLFLOW_TRACKING_URI). Without one the run goes to MLflow's
own local store, offline: a sqlite database `<save_dir>/mlflow.db` (MLflow 3 refuses its older `file:` store
unless MLFLOW_ALLOW_FILE_STORE=true), with artifacts and this project's checkpoints under
`<save_dir>/<experiment_name>/<run_id>/`. See it with `mlflow ui --backend-store-uri sqlite:///<save_dir>/mlflow.db`.

mlflow is an optional dependency: it is imported on rank 0 when the run is first needed.
"""

from __future__ import annotations

import os
import re
import time
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from callbacks.loggers import Logger, _flatten, _to_scalar

STATUS = {"success": "FINISHED", "finished": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
MAX_PARAM_LENGTH = 6000  # MLflow's limit on a param's value
BATCH = 100  # params per log_batch call (MLflow's limit)


def _mlflow() -> Any:
    """MLflow's client class and entities module, imported when first needed."""
    try:
        import mlflow.entities
        from mlflow.tracking import MlflowClient
    except ImportError as error:
        raise ImportError(
            "MLFlowLogger needs the mlflow package (an optional dependency): pip install mlflow"
        ) from error
    return MlflowClient, mlflow.entities


class MLFlowLogger(Logger):
    """Logs to MLflow (Lightning's name and arguments): hyperparameters as params, metrics by step, and the
    checkpoint path as a tag, through MLflow's client, from rank 0.

    Without a tracking URI the run goes to MLflow's own local store, offline: a sqlite database
    `<save_dir>/mlflow.db`, with artifacts and this project's checkpoints under
    `<save_dir>/<experiment_name>/<run_id>/` (see it with `mlflow ui --backend-store-uri
    sqlite:///<save_dir>/mlflow.db`). `mlflow` is an optional dependency, imported on rank 0 when the run is first
    needed.

    Args:
        experiment_name: the MLflow experiment (created if it does not exist).
        run_name: the run's name; `None` for MLflow's.
        tracking_uri: the MLflow server or store; `None` for `$MLFLOW_TRACKING_URI`, else the local store under
            `save_dir`.
        tags: tags of the new run.
        save_dir: the folder of the local store (used only without a tracking URI).
        log_model: `True` logs the best (else the last) checkpoint's files as artifacts when the run ends,
            `"all"` every checkpoint once it is saved, `False` none.
        prefix: put before each metric's name, joined with `"-"`.
        artifact_location: the artifact location of a new experiment; `None` for MLflow's default (with the local
            store, under `save_dir`).
        run_id: log to this existing run instead of creating one.
        synchronous: passed to MLflow's `log_batch`; `None` for MLflow's default.

    Raises:
        ValueError: if `log_model` is not `False`, `True` or `"all"`; if there is no tracking URI and `save_dir` is
            None; when a logged metric is not a number or a scalar tensor.
        ImportError: when the run is first needed, if `mlflow` is not installed.
    """

    def __init__(
        self,
        experiment_name: str = "lightning_logs",
        run_name: str | None = None,
        tracking_uri: str | None = None,
        tags: dict[str, Any] | None = None,
        save_dir: str | os.PathLike | None = "./mlruns",
        log_model: bool | str = False,
        prefix: str = "",
        artifact_location: str | None = None,
        run_id: str | None = None,
        synchronous: bool | None = None,
    ) -> None:
        if log_model not in (True, False, "all"):
            raise ValueError(f"MLFlowLogger: log_model={log_model!r}; use False, True or 'all'")
        tracking_uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        self._local = tracking_uri is None
        if self._local and save_dir is None:
            raise ValueError("MLFlowLogger: give a tracking_uri, or a save_dir for MLflow's local store")
        self._save_dir = os.path.abspath(os.fspath(save_dir)) if self._local else None
        self._tracking_uri = tracking_uri or f"sqlite:///{self._save_dir}/mlflow.db"
        self._experiment_name, self._run_name, self._tags = experiment_name, run_name, dict(tags or {})
        self._log_model, self._prefix, self._synchronous = log_model, prefix, synchronous
        self._artifact_location = artifact_location
        self._run_id, self._experiment_id = run_id, None
        self._client: Any = None
        self._checkpoint_tags: dict[str, str] = {}  # set on the main thread (saves may end on another)
        self._checkpoints_to_log: list[str] = []

    # ---- the run ------------------------------------------------------------------------------------
    @property
    def experiment(self) -> Any:
        """MLflow's client (rank 0), as Lightning's `logger.experiment`; use it with `logger.run_id`."""
        if self._client is None:
            if self._local:
                os.makedirs(self._save_dir, exist_ok=True)
            self._client = _mlflow()[0](tracking_uri=self._tracking_uri)
        return self._client

    @property
    def run_id(self) -> str | None:
        """The run (created on rank 0 when first needed; other ranks are told it by the Trainer)."""
        if self._run_id is None and self.rank == 0:
            client = self.experiment
            tags = {key: str(value) for key, value in self._tags.items()}
            run = client.create_run(self.experiment_id, run_name=self._run_name, tags=tags)
            self._run_id = run.info.run_id
        return self._run_id

    @property
    def experiment_id(self) -> str | None:
        if self._experiment_id is None and self.rank == 0:
            client = self.experiment
            found = client.get_experiment_by_name(self._experiment_name)
            if found is not None:
                self._experiment_id = found.experiment_id
            else:
                location = self._artifact_location
                if location is None and self._local:  # not MLflow's default, ./mlruns in the working directory
                    location = Path(self._save_dir, self._experiment_name).as_uri()
                self._experiment_id = client.create_experiment(self._experiment_name, artifact_location=location)
        return self._experiment_id

    name = property(lambda self: self._experiment_name)
    save_dir = property(lambda self: self._save_dir)

    @property
    def version(self) -> str | None:
        return self.run_id

    @version.setter
    def version(self, value: str | None) -> None:
        self._run_id = value

    @property
    def log_dir(self) -> str | None:
        """`<save_dir>/<experiment_name>/<run_id>` with the local store (checkpoints go there), else None."""
        if not self._local or self.version is None:
            return None
        return os.path.join(self._save_dir, self._experiment_name, self.version)

    # ---- writing ------------------------------------------------------------------------------------
    def log_hyperparams(self, params: Mapping[str, Any] | Namespace) -> None:
        if self.rank != 0:
            return
        Param = _mlflow()[1].Param  # noqa: N806
        flat = _flatten(vars(params) if isinstance(params, Namespace) else dict(params))
        items = [Param(key, str(value)[:MAX_PARAM_LENGTH]) for key, value in flat.items()]
        for start in range(0, len(items), BATCH):
            self._log_batch(params=items[start : start + BATCH])

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if self.rank != 0:
            return
        Metric = _mlflow()[1].Metric  # noqa: N806
        run_id = self.run_id  # (imports mlflow, or names it missing)
        stamp = int(time.time() * 1000)
        items = []
        for key, value in metrics.items():
            name = _key(f"{self._prefix}-{key}" if self._prefix else key)
            values = value.items() if isinstance(value, Mapping) else [("", value)]
            items += [Metric(f"{name}/{k}" if k else name, _to_scalar(name, v), stamp, step or 0) for k, v in values]
        if items and run_id is not None:
            self._log_batch(metrics=items)
        self._flush_checkpoints()

    def _log_batch(self, **entries: Any) -> None:
        extra = {} if self._synchronous is None else {"synchronous": self._synchronous}
        self.experiment.log_batch(self.run_id, **entries, **extra)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        """Noted here, written on the next log, save or finalize (from the main thread)."""
        path = checkpoint_callback.best_model_path or checkpoint_callback.last_model_path
        if not path:
            return
        self._checkpoint_tags["checkpoint_path"] = path
        if checkpoint_callback.last_model_path:
            self._checkpoint_tags["last_model_path"] = checkpoint_callback.last_model_path
        if self._log_model == "all":
            self._checkpoints_to_log.append(path)
        elif self._log_model:
            self._checkpoints_to_log = [path]  # the best (or last) one, logged when the run ends

    def _flush_checkpoints(self, ending: bool = False) -> None:
        tags, self._checkpoint_tags = self._checkpoint_tags, {}
        for key, value in tags.items():
            self.experiment.set_tag(self.run_id, key, value)
        if self._log_model == "all" or (self._log_model and ending):
            paths, self._checkpoints_to_log = self._checkpoints_to_log, []
            for path in paths:
                if os.path.exists(path):
                    self.experiment.log_artifacts(self.run_id, path, artifact_path=f"checkpoints/{Path(path).name}")

    def save(self) -> None:
        if self.rank == 0 and self._client is not None:
            self._flush_checkpoints()

    def finalize(self, status: str) -> None:
        if self.rank != 0 or self._run_id is None:
            return
        self._flush_checkpoints(ending=True)
        self.experiment.set_terminated(self._run_id, STATUS.get(status, "FINISHED"))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}


def _key(name: str) -> str:
    """MLflow takes letters, digits, and _ - . space : / in a metric's name; anything else becomes _."""
    return re.sub(r"[^\w\-. :/]", "_", name)
