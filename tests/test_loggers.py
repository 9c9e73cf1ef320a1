"""CSVLogger and MLFlowLogger (Lightning's names and arguments), alone and several at once, read back with pandas
and with MLflow's own client."""

from __future__ import annotations

import os
import sys

import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader

from callbacks import CSVLogger, MLFlowLogger, TensorBoardLogger
from tests.test_callbacks import read_events, scalars
from tests.test_parity import TiedLM, new_model, token_dataset
from trainer import Trainer


def test_csv_logger_writes_one_metrics_file_per_run_that_pandas_reads(tmp_path):
    logger = CSVLogger(tmp_path, name="exp", flush_logs_every_n_steps=2)
    assert logger.version == 0 and logger.log_dir == os.path.join(tmp_path, "exp", "version_0")
    logger.log_hyperparams({"lr": 0.1, "opt": {"name": "adam"}})
    logger.log_metrics({"train/loss": torch.tensor(2.5)}, step=1)
    logger.log_metrics({"train/loss": 1.5, "epoch": 0}, step=2)
    logger.log_metrics({"val/acc": 0.75, "epoch": 0}, step=2)  # a new column: the file is rewritten
    logger.finalize("success")

    frame = pd.read_csv(os.path.join(logger.log_dir, "metrics.csv"))
    assert list(frame.columns) == ["step", "train/loss", "epoch", "val/acc"]
    assert frame["step"].tolist() == [1, 2, 2]
    assert frame["train/loss"].tolist()[:2] == [2.5, 1.5] and pd.isna(frame["train/loss"][2])
    assert frame["val/acc"].tolist()[2] == 0.75
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as f:
        assert f.read() == 'lr: 0.1\nopt:\n  name: "adam"\n'
    assert CSVLogger(tmp_path, name="exp").version == 1  # the next run: its own file
    rank1 = CSVLogger(tmp_path / "other")
    rank1.rank = 1
    rank1.log_metrics({"x": 1.0}, step=0)
    rank1.finalize("success")
    assert not os.path.exists(tmp_path / "other")  # only rank 0 writes


def test_mlflow_is_an_optional_dependency_named_when_missing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow raises ImportError
    logger = MLFlowLogger(save_dir=str(tmp_path))
    with pytest.raises(ImportError, match=r"pip install mlflow"):
        logger.log_metrics({"x": 1.0}, step=0)


class Logged(TiedLM):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train/loss", loss)
        return loss


def _several_loggers_body(root: str) -> dict | None:
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # MLflow's own local store
    loggers = [
        TensorBoardLogger(root, name="tb"),
        CSVLogger(root, name="csv"),
        MLFlowLogger(experiment_name="shardtrain", run_name="several", save_dir=os.path.join(root, "mlruns")),
    ]
    trainer = Trainer(
        strategy="ddp",
        devices=2,
        max_steps=4,
        max_epochs=1,
        log_every_n_steps=1,
        logger=loggers,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(new_model(Logged), DataLoader(token_dataset(), batch_size=2))
    if trainer.global_rank != 0:
        return {"versions": [logger.version for logger in trainer.loggers]}
    from mlflow.tracking import MlflowClient

    mlflow_logger = trainer.loggers[2]
    client = MlflowClient(tracking_uri=mlflow_logger._tracking_uri)
    run = client.get_run(mlflow_logger.run_id)
    history = client.get_metric_history(run.info.run_id, "train/loss")
    return {
        "versions": [logger.version for logger in trainer.loggers],
        "logger": trainer.logger is loggers[0],
        "tb": trainer.loggers[0].log_dir,
        "csv": trainer.loggers[1].log_dir,
        "params": run.data.params,
        "tags": run.data.tags,
        "status": run.info.status,
        "run_name": run.info.run_name,
        "history": [(m.step, m.value) for m in history],
        "experiment": client.get_experiment(run.info.experiment_id).name,
        "checkpoint": trainer.checkpoint_callback.best_model_path,
    }


def test_several_loggers_at_once_read_back_with_tensorboard_pandas_and_mlflow(rank_pool, tmp_path):
    results = rank_pool(2).run(_several_loggers_body, str(tmp_path))
    out = results[0]
    assert results[1]["versions"] == out["versions"]  # every rank knows each logger's version (MLflow: the run id)
    assert out["logger"]  # trainer.logger is the first; trainer.loggers all of them

    losses = scalars(read_events(out["tb"]), "train/loss")
    assert [step for step, _ in losses] == [1, 2, 3, 4]
    frame = pd.read_csv(os.path.join(out["csv"], "metrics.csv")).dropna(subset=["train/loss"])
    assert frame["step"].tolist() == [1, 2, 3, 4]
    assert frame["train/loss"].tolist() == pytest.approx([value for _, value in losses])
    assert [(step, pytest.approx(value)) for step, value in out["history"]] == losses

    assert out["params"]["lr"] == "0.1" and out["status"] == "FINISHED"
    assert out["experiment"] == "shardtrain" and out["run_name"] == "several"
    assert out["tags"]["checkpoint_path"] == out["checkpoint"] and out["checkpoint"].endswith("epoch=0-step=4")
    assert os.path.exists(tmp_path / "mlruns" / "mlflow.db")  # MLflow's local sqlite store, offline
