"""WandbLogger, run offline with the real wandb and read back from the run file it wrote (`run-<id>.wandb`: wandb's
log of protobuf records, decoded with wandb's own record schema): metrics at their steps from rank 0 only,
hyperparameters and the command line's config, the same run continued when training resumes."""

from __future__ import annotations

import json
import os
import struct
import sys
import time
from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from callbacks import WandbLogger
from tests.test_loggers import Logged
from tests.test_parity import new_model, token_dataset
from trainer import Trainer

pytest.importorskip("wandb")
BLOCK, HEADER = 32768, 7  # wandb's run file: ":W&B" + magic + version, then LevelDB-log records in 32 KiB blocks


def offline_environment(root: str, setenv=os.environ.__setitem__) -> None:
    """Everything wandb writes under `root`, nothing on the network or in the home directory."""
    values = dict(
        WANDB_MODE="offline",
        WANDB_SILENT="true",
        WANDB_DIR=root,
        WANDB_CONFIG_DIR=f"{root}/config",
        WANDB_CACHE_DIR=f"{root}/cache",
        WANDB_DATA_DIR=f"{root}/data",
        WANDB_ARTIFACT_DIR=f"{root}/artifacts",
        WANDB_DISABLE_GIT="true",
    )
    for key, value in values.items():
        setenv(key, value)


def read_run(path: Path) -> dict:
    """The records of one offline run file, by kind: run (id, project, name), history rows and config values."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending = path.read_bytes(), HEADER, b""
    assert data[:4] == b":W&B"
    out: dict = {"history": [], "config": {}, "artifacts": []}
    while position + 7 <= len(data):
        if BLOCK - position % BLOCK < 7:  # a block's tail too short for a record header is padding
            position += BLOCK - position % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind not in (1, 4):  # full record, or the last piece of one
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(pending)
        pending = b""
        _add(out, record)
    return out


def _add(out: dict, record) -> None:
    def items(updates):
        return {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in updates}

    which = record.WhichOneof("record_type")
    if which == "run":
        out["run"] = (record.run.run_id, record.run.project, record.run.display_name)
        out["config"].update(items(record.run.config.update))
    elif which == "history":
        out["history"].append(items(record.history.item))
    elif which == "config":
        out["config"].update(items(record.config.update))
    elif which == "exit":
        out["exit_code"] = record.exit.exit_code
    elif which == "artifact":
        out["artifacts"].append(
            (
                record.artifact.name,
                record.artifact.type,
                sorted(record.artifact.aliases),
                sorted(entry.path for entry in record.artifact.manifest.contents),
            )
        )


def run_files(root: Path) -> list[Path]:
    return sorted(root.rglob("run-*.wandb"), key=lambda p: p.stat().st_mtime)


def read_finished_runs(root: Path, count: int) -> list[dict]:
    """The `count` runs under `root`, each once its exit record is written (wandb's service writes the file in
    the background; `finish()` may return a moment before the last records are on disk)."""
    for _ in range(100):
        try:
            runs = [read_run(path) for path in run_files(root)]
        except Exception:  # a record half written: read again
            runs = []
        if len(runs) == count and all("exit_code" in run for run in runs):
            return sorted(runs, key=lambda run: run["history"][0]["_timestamp"] if run["history"] else 0)
        time.sleep(0.2)
    raise AssertionError(f"expected {count} finished wandb runs under {root}, found {run_files(root)}")


def _wandb_body(root: str) -> dict:
    offline_environment(root)
    logger = WandbLogger(project="shardtrain", name="tiny", save_dir=root, offline=True)
    trainer = Trainer(
        strategy="ddp",
        devices=2,
        max_steps=4,
        max_epochs=1,
        log_every_n_steps=1,
        logger=logger,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(new_model(Logged), DataLoader(token_dataset(), batch_size=2))
    return {"version": logger.version, "log_dir": trainer.log_dir}


def test_metrics_at_their_steps_and_hyperparameters_from_rank_0_only(rank_pool, tmp_path):
    rank0, rank1 = rank_pool(2).run(_wandb_body, str(tmp_path))
    assert rank0["version"] == rank1["version"] and len(rank0["version"]) == 8  # every rank knows the run id
    (run,) = read_finished_runs(tmp_path, 1)  # only rank 0 made a run
    assert run["run"] == (rank0["version"], "shardtrain", "tiny")
    losses = [(row["trainer/global_step"], row["train/loss"]) for row in run["history"] if "train/loss" in row]
    assert [step for step, _ in losses] == [1, 2, 3, 4]
    assert run["config"]["lr"] == 0.1  # the module's hyperparameters
    assert rank0["log_dir"] == os.path.join(str(tmp_path), "shardtrain", rank0["version"])  # checkpoints go here


def test_resumed_training_continues_the_same_run(tmp_path, monkeypatch):
    offline_environment(str(tmp_path), monkeypatch.setenv)
    first = WandbLogger(project="shardtrain", save_dir=str(tmp_path), offline=True, log_model=True)
    Trainer(max_steps=2, log_every_n_steps=1, logger=first, enable_progress_bar=False, enable_model_summary=False).fit(
        new_model(Logged), DataLoader(token_dataset(), batch_size=2)
    )
    assert list((tmp_path / "shardtrain" / first.version / "checkpoints").iterdir())  # Lightning's place
    again = WandbLogger(project="shardtrain", save_dir=str(tmp_path), offline=True)  # no id given
    trainer = Trainer(
        max_steps=4, log_every_n_steps=1, logger=again, enable_progress_bar=False, enable_model_summary=False
    )
    trainer.fit(new_model(Logged), DataLoader(token_dataset(), batch_size=2), ckpt_path="last")
    assert again.version == first.version  # the id came from the checkpoint
    runs = read_finished_runs(tmp_path, 2)
    assert [run["run"][0] for run in runs] == [first.version, first.version]
    steps = [[row["trainer/global_step"] for row in run["history"] if "train/loss" in row] for run in runs]
    assert steps == [[1, 2], [3, 4]]
    (artifact,) = runs[0]["artifacts"]  # log_model=True: the last checkpoint, once training ended
    name, kind, aliases, files = artifact
    assert name == f"model-{first.version}" and kind == "model" and "latest" in aliases
    assert "meta.json" in files and ".metadata" in files  # the checkpoint directory's files


def test_the_command_lines_config_goes_into_the_runs_config(tmp_path, monkeypatch):
    pytest.importorskip("jsonargparse")
    from tests.scripts import cli_regression
    from trainer.cli import CLI

    offline_environment(str(tmp_path), monkeypatch.setenv)
    yaml_file = Path(cli_regression.__file__).with_suffix(".yaml")
    CLI(
        cli_regression.Regressor,
        cli_regression.RegressionData,
        args=[
            "fit",
            "--config",
            str(yaml_file),
            "--trainer.max_epochs",
            "1",
            "--trainer.logger",
            "WandbLogger",
            "--trainer.logger.offline",
            "true",
            "--trainer.logger.save_dir",
            str(tmp_path),
            "--trainer.logger.project",
            "cli",
        ],
    )
    (run,) = read_finished_runs(tmp_path, 1)
    config = run["config"]
    assert config["trainer"]["max_epochs"] == 1 and config["model"] == {"hidden": 6, "lr": 0.05}
    assert config["trainer"]["logger"]["class_path"] == "callbacks.WandbLogger"
    assert config["seed_everything"] == 7


def test_wandb_is_an_optional_dependency_named_when_missing(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    logger = WandbLogger(save_dir=str(tmp_path), offline=True)
    with pytest.raises(ImportError, match=r'pip install "shardtrain\[wandb\]"'):
        logger.log_metrics({"x": 1.0}, step=0)
