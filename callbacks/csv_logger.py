"""CSVLogger (Lightning's name and arguments): one `metrics.csv` per run, a row per logged step and a column per
metric (`step` first), and the hyperparameters in `hparams.yaml`, in `save_dir/name/version_<n>/`; rank 0 writes.

Rows are kept in memory and written every `flush_logs_every_n_steps` logging calls and when the run is saved or ends;
a metric first seen after rows were written rewrites the file with the new column (empty cells where it was not
logged), so pandas (`pd.read_csv`) reads the whole run in one table.
"""

from __future__ import annotations

import csv
import json
import os
from argparse import Namespace
from collections.abc import Mapping
from typing import Any

import torch

from callbacks.loggers import Logger, _next_free_version, _to_scalar


class CSVLogger(Logger):
    """Writes the metrics to `metrics.csv` and the hyperparameters to `hparams.yaml` in
    `save_dir/name/version_<n>/` (Lightning's name and arguments); rank 0 writes.

    `metrics.csv` has a row per logged step and a column per metric (`step` first). Rows are kept in memory and
    written every `flush_logs_every_n_steps` logging calls and when the run is saved or ends; a metric first seen
    after rows were written rewrites the file with the new column, so `pandas.read_csv` reads the whole run.

    Args:
        save_dir: the root folder.
        name: the experiment's folder under `save_dir`; `None` or `""` for none.
        version: the run's folder: an int n gives `version_<n>`, a string is used as the folder name; `None` takes
            the next free `version_<n>` when first asked for.
        prefix: put before each metric's name, joined with `"-"`.
        flush_logs_every_n_steps: how many `log_metrics` calls between writes of the file.

    Raises:
        ValueError: if `flush_logs_every_n_steps` is not a positive int; when a logged metric is not a number or a
            scalar tensor.
    """

    NAME_METRICS_FILE = "metrics.csv"
    NAME_HPARAMS_FILE = "hparams.yaml"

    def __init__(
        self,
        save_dir: str | os.PathLike,
        name: str | None = "default",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        if not isinstance(flush_logs_every_n_steps, int) or flush_logs_every_n_steps < 1:
            raise ValueError(f"CSVLogger: flush_logs_every_n_steps={flush_logs_every_n_steps!r}; use a positive int")
        self._save_dir, self._name, self._version = os.fspath(save_dir), name or "", version
        self._prefix, self._flush_every = prefix, flush_logs_every_n_steps
        self._rows: list[dict[str, Any]] = []  # not yet written
        self._columns: list[str] = []  # of the file as written
        self._hparams: dict[str, Any] = {}
        self._calls = 0

    name = property(lambda self: self._name)
    """The experiment's name."""
    save_dir = property(lambda self: self._save_dir)
    """The root folder."""
    root_dir = property(lambda self: os.path.join(self._save_dir, self._name))
    """`save_dir/name`: the folder of the experiment's versions."""

    @property
    def version(self) -> int | str:
        if self._version is None:
            self._version = _next_free_version(self.root_dir)
        return self._version

    @version.setter
    def version(self, value: int | str) -> None:
        self._version = value

    @property
    def log_dir(self) -> str:
        """`save_dir/name/version_<n>` (or the string version): this run's folder."""
        version = self.version
        return os.path.join(self.root_dir, version if isinstance(version, str) else f"version_{version}")

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        if self.rank != 0:
            return
        row: dict[str, Any] = {"step": step}
        for key, value in metrics.items():
            name = f"{self._prefix}-{key}" if self._prefix else key
            if isinstance(value, Mapping):  # as TensorBoard's add_scalars: one column per entry
                row.update({f"{name}/{k}": _to_scalar(name, v) for k, v in value.items()})
            else:
                row[name] = _to_scalar(name, value)
        self._rows.append(row)
        self._calls += 1
        if self._calls % self._flush_every == 0:
            self.save()

    def log_hyperparams(self, params: Mapping[str, Any] | Namespace) -> None:
        if self.rank != 0:
            return
        self._hparams.update(vars(params) if isinstance(params, Namespace) else dict(params))
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, self.NAME_HPARAMS_FILE), "w") as f:
            f.write("".join(f"{line}\n" for line in _yaml(self._hparams)))

    def save(self) -> None:
        if self.rank != 0 or not self._rows:
            return
        path = os.path.join(self.log_dir, self.NAME_METRICS_FILE)
        new = [key for row in self._rows for key in row if key not in self._columns]
        rows, mode = self._rows, "a"
        if new or not os.path.exists(path):
            rows = (_read(path) if self._columns else []) + rows
            self._columns += list(dict.fromkeys(new))
            mode = "w"
        os.makedirs(self.log_dir, exist_ok=True)
        with open(path, mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._columns)
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)
        self._rows = []


def _read(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _yaml(params: Mapping[str, Any], indent: str = "") -> list[str]:
    """Nested hyperparameters as YAML: scalars in JSON's notation (which YAML reads), other values as strings."""
    lines = []
    for key, value in params.items():
        if isinstance(value, Mapping) and value:
            lines += [f"{indent}{key}:", *_yaml(value, indent + "  ")]
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, (list, tuple)):
            value = [v if isinstance(v, (bool, int, float, str)) or v is None else str(v) for v in value]
        elif not (isinstance(value, (bool, int, float, str)) or value is None):
            value = str(value)
        lines.append(f"{indent}{key}: {json.dumps(value)}")
    return lines
