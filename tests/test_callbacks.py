"""Callbacks and loggers: TensorBoard files read back with TensorBoard's own reader, real Trainer runs."""

from __future__ import annotations

import math
import os
from argparse import Namespace

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

from callbacks import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    ModelCheckpoint,
    ProgressBar,
    TensorBoardLogger,
    ThroughputMonitor,
)
from trainer import Trainer, TrainModule
from trainer.checkpoint import load_trainer_state


def read_events(log_dir: str) -> EventAccumulator:
    events = EventAccumulator(log_dir, size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def scalars(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


# -- TensorBoardLogger on its own ----------------------------------------------------------------------------
def test_logger_writes_scalars_that_tensorboard_reads(tmp_path):
    logger = TensorBoardLogger(save_dir=tmp_path, name="exp")
    assert logger.version == 0
    assert logger.log_dir == os.path.join(tmp_path, "exp", "version_0")
    logger.log_metrics({"train/loss": torch.tensor(2.5), "lr": 0.1}, step=1)
    logger.log_metrics({"train/loss": 1.5, "pair": {"a": 1.0, "b": torch.tensor(2.0)}}, step=2)
    logger.finalize("success")

    events = read_events(logger.log_dir)
    assert scalars(events, "train/loss") == [(1, 2.5), (2, 1.5)]
    assert scalars(events, "lr") == [(1, pytest.approx(0.1))]
    # add_scalars writes one run per key next to the main one
    assert scalars(read_events(os.path.join(logger.log_dir, "pair_a")), "pair") == [(2, 1.0)]


def test_logger_takes_next_free_version_and_accepts_string_versions(tmp_path):
    for expected in range(3):
        logger = TensorBoardLogger(save_dir=tmp_path, name="exp")
        logger.log_metrics({"x": 1.0}, step=0)
        logger.finalize("success")
        assert logger.version == expected
    assert sorted(os.listdir(tmp_path / "exp")) == ["version_0", "version_1", "version_2"]
    named = TensorBoardLogger(save_dir=tmp_path, name="exp", version="baseline")
    assert named.log_dir == os.path.join(tmp_path, "exp", "baseline")
    assert TensorBoardLogger(save_dir=tmp_path, name="").log_dir == os.path.join(tmp_path, "version_0")


def test_logger_is_lazy_and_silent_on_other_ranks(tmp_path):
    logger = TensorBoardLogger(save_dir=tmp_path)
    assert not os.path.exists(tmp_path / "default")  # nothing is created before the first write
    logger.rank = 1
    logger.log_metrics({"x": 1.0}, step=0)
    logger.log_hyperparams({"lr": 0.1})
    logger.experiment.add_histogram("w", torch.zeros(3))  # user code that writes directly works on any rank
    logger.finalize("success")
    assert not os.path.exists(tmp_path / "default")


def test_logger_writes_hyperparameters_to_hparams_and_text(tmp_path):
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    logger = TensorBoardLogger(save_dir=tmp_path)
    params = Namespace(lr=0.01, layers=4, act="gelu", opt={"name": "adam", "betas": (0.9, 0.99)})
    logger.log_hyperparams(params)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")

    events = read_events(logger.log_dir)
    text = events.Tensors("hparams/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| lr | 0.01 |" in text and "| opt/betas | (0.9, 0.99) |" in text
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    session = HParamsPluginData.FromString(content)
    hparams = session.session_start_info.hparams
    assert hparams["lr"].number_value == pytest.approx(0.01)
    assert hparams["act"].string_value == "gelu"
    assert hparams["opt/name"].string_value == "adam"
    assert os.listdir(logger.log_dir) == [n for n in os.listdir(logger.log_dir) if n.startswith("events.")]


def test_logger_rejects_what_is_not_a_scalar(tmp_path):
    logger = TensorBoardLogger(save_dir=tmp_path)
    with pytest.raises(ValueError, match="'acts'.*shape \\(3,\\)"):
        logger.log_metrics({"acts": torch.ones(3)}, step=0)
    with pytest.raises(ValueError, match="'name'.*str"):
        logger.log_metrics({"name": "x"}, step=0)
    logger.finalize("failed")


def test_logger_writes_again_after_finalize(tmp_path):
    logger = TensorBoardLogger(save_dir=tmp_path)
    logger.log_metrics({"x": 1.0}, step=0)
    logger.finalize("success")
    logger.log_metrics({"x": 2.0}, step=1)  # e.g. trainer.test after trainer.fit
    logger.finalize("success")
    assert logger.version == 0
    assert scalars(read_events(logger.log_dir), "x") == [(0, 1.0), (1, 2.0)]


# -- argument checks -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: ModelCheckpoint(mode="best"), r"mode='best'.*'min', 'max'"),
        (lambda: ModelCheckpoint(save_top_k=-2), r"save_top_k=-2"),
        (lambda: ModelCheckpoint(every_n_train_steps=-1), r"every_n_train_steps=-1"),
        (lambda: ModelCheckpoint(every_n_train_steps=5, every_n_epochs=1), r"mutually exclusive"),
        (lambda: EarlyStopping("val/loss", mode="lowest"), r"mode='lowest'.*'min', 'max'"),
        (lambda: EarlyStopping("val/loss", patience=-1), r"patience=-1"),
        (lambda: LearningRateMonitor(logging_interval="batch"), r"logging_interval='batch'.*'step', 'epoch'"),
        (lambda: ProgressBar(refresh_rate=0), r"refresh_rate=0"),
    ],
)
def test_bad_arguments_are_value_errors_naming_them(make, match):
    with pytest.raises(ValueError, match=match):
        make()


# -- pure logic ----------------------------------------------------------------------------------------------
def test_checkpoint_names_follow_lightning_templates():
    metrics = {"epoch": 3, "step": 120, "val/loss": 0.12345, "acc": 0.9}
    assert ModelCheckpoint().format_checkpoint_name(metrics) == "epoch=3-step=120"
    named = ModelCheckpoint(filename="{epoch:02d}-{val/loss:.2f}")
    assert named.format_checkpoint_name(metrics) == "epoch=03-val_loss=0.12"
    plain = ModelCheckpoint(filename="best-{acc:.1f}", auto_insert_metric_name=False)
    assert plain.format_checkpoint_name(metrics) == "best-0.9"
    assert ModelCheckpoint(filename="{missing}").format_checkpoint_name(metrics) == "missing=0"


def test_state_keys_tell_instances_apart():
    keys = {
        ModelCheckpoint(monitor="a").state_key,
        ModelCheckpoint(monitor="b").state_key,
        ModelCheckpoint(monitor="a", mode="max").state_key,
        EarlyStopping("a").state_key,
        EarlyStopping("b").state_key,
    }
    assert len(keys) == 5


@pytest.mark.parametrize(
    "mode, values, min_delta, stop_at",
    [
        ("min", [5, 4, 3, 3, 3, 3, 2], 0.0, 5),  # three checks without improvement after the best (3)
        ("min", [5, 4.95, 4.92, 4.91, 4.8], 0.1, 3),  # improvements below min_delta (from the best) do not count
        ("max", [0.1, 0.5, 0.4, 0.6, 0.6, 0.5, 0.55], 0.0, 6),
        ("min", [1.0, math.nan], 0.0, 1),  # a non-finite value stops at once
    ],
)
def test_early_stopping_decision(mode, values, min_delta, stop_at):
    stopper = EarlyStopping("m", mode=mode, min_delta=min_delta, patience=3)
    stops = [stopper.evaluate(float(v))[0] for v in values]
    assert stops.index(True) == stop_at


def test_early_stopping_state_round_trips():
    stopper = EarlyStopping("m", patience=5)
    for v in [3.0, 2.0, 2.5, 2.5]:
        stopper.evaluate(v)
    restored = EarlyStopping("m", patience=5)
    restored.load_state_dict(stopper.state_dict())
    assert (restored.wait_count, restored.best_score) == (2, 2.0)
    assert [restored.evaluate(2.5)[0] for _ in range(3)] == [False, False, True]


# -- with a real Trainer -------------------------------------------------------------------------------------
class Regression(TrainModule):
    """A linear model on random data. Validation logs `val/score` = schedule[epoch] (+ `offset`), so tests can
    design the metric's course; `offset` differs per rank in distributed tests to make the ranks disagree."""

    def __init__(self, schedule: list[float] | None = None, offset: float = 0.0, groups: int = 1) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.schedule, self.offset, self.groups = schedule, offset, groups
        self.save_hyperparameters(lr=0.1, groups=groups)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/mae", (self.net(x) - y).abs().mean(), on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.net(x), y))
        if self.schedule is not None:
            self.log("val/score", self.schedule[self.current_epoch] + self.offset)

    def configure_optimizers(self):
        params = list(self.parameters())
        groups = [{"params": params[:1]}, {"params": params[1:], "lr": 0.01}] if self.groups == 2 else params
        optimizer = torch.optim.SGD(groups, lr=0.1)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


class EpochCounter(Callback):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def on_train_epoch_start(self, trainer, module) -> None:
        self.epochs.append(trainer.current_epoch)


def loader(batches: int = 4, batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = batches * batch_size
    data = TensorDataset(torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))
    return DataLoader(data, batch_size)


def make_trainer(root, **kwargs) -> Trainer:
    options = dict(
        strategy="auto",
        devices=1,
        max_epochs=2,
        default_root_dir=root,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
    )
    return Trainer(**{**options, **kwargs})


def checkpoint_dirs(dirpath) -> list[str]:
    return sorted(os.listdir(dirpath))


def test_fit_writes_step_epoch_and_lr_metrics_to_tensorboard(tmp_path):
    trainer = make_trainer(tmp_path, callbacks=[LearningRateMonitor()])
    trainer.fit(Regression(), loader(), loader(batches=2))

    events = read_events(trainer.log_dir)
    assert trainer.log_dir == os.path.join(tmp_path, "default", "version_0")
    assert [step for step, _ in scalars(events, "train/loss")] == list(range(1, 9))
    assert [step for step, _ in scalars(events, "train/mae")] == [4, 8]
    assert [step for step, _ in scalars(events, "val/loss")] == [4, 8]
    # StepLR steps per epoch, so the lr is logged at each epoch start: before steps 0 and 4
    assert scalars(events, "lr-SGD") == [(0, pytest.approx(0.1)), (4, pytest.approx(0.05))]
    assert "| lr | 0.1 |" in events.Tensors("hparams/text_summary")[0].tensor_proto.string_val[0].decode()
    assert trainer.callback_metrics["lr-SGD"] == pytest.approx(0.05)


def test_lr_monitor_logs_every_group_once_per_optimizer_step(tmp_path):
    monitor = LearningRateMonitor(logging_interval="step", log_momentum=True)
    trainer = make_trainer(tmp_path, callbacks=[monitor], accumulate_grad_batches=2)
    trainer.fit(Regression(groups=2), loader(), None)

    events = read_events(trainer.log_dir)
    assert scalars(events, "lr-SGD/pg1") == [(s, pytest.approx(0.1 * 0.5 ** (s // 2))) for s in range(4)]
    assert scalars(events, "lr-SGD/pg2") == [(s, pytest.approx(0.01 * 0.5 ** (s // 2))) for s in range(4)]
    assert [v for _, v in scalars(events, "lr-SGD/pg1-momentum")] == [0.0] * 4


def test_throughput_monitor_logs_samples_items_and_flops_per_second(tmp_path):
    """Regression runs Linear(4, 1) twice per batch of 4 (the loss, and a logged MAE) and backpropagates the loss
    to the weight only: 2 x 32 + 32 = 96 FLOPs per batch, counted once by torch's FlopCounterMode."""
    monitor = ThroughputMonitor(length_fn=lambda batch: 10 * len(batch[0]))
    trainer = make_trainer(tmp_path, callbacks=[monitor], log_every_n_steps=2)
    trainer.fit(Regression(), loader(), None)
    assert monitor.flops_per_batch == 96
    events = read_events(trainer.log_dir)
    steps = [step for step, _ in scalars(events, "device/samples_per_sec")]
    assert steps == [2, 4, 6, 8]
    for (_, samples), (_, items), (_, flops) in zip(
        scalars(events, "device/samples_per_sec"),
        scalars(events, "device/items_per_sec"),
        scalars(events, "device/flops_per_sec"),
    ):
        assert samples > 0 and items == pytest.approx(10 * samples, rel=1e-4)
        assert flops == pytest.approx(96 / 4 * samples, rel=1e-4)
    assert scalars(events, "samples_per_sec") == scalars(events, "device/samples_per_sec")  # one rank
    with pytest.raises(TypeError, match="batch_size_fn"):
        ThroughputMonitor(batch_size_fn=3)


def test_lr_monitor_needs_a_logger(tmp_path):
    trainer = make_trainer(tmp_path, callbacks=[LearningRateMonitor()], logger=False)
    with pytest.raises(ValueError, match="LearningRateMonitor needs a logger"):
        trainer.fit(Regression(), loader(), None)


def test_early_stopping_stops_when_the_metric_plateaus(tmp_path):
    stopper = EarlyStopping("val/score", patience=2, min_delta=0.01)
    counter = EpochCounter()
    trainer = make_trainer(tmp_path, max_epochs=10, callbacks=[stopper, counter], logger=False)
    module = Regression(schedule=[1.0, 0.5, 0.4, 0.395, 0.45, 0.3, 0.2])
    trainer.fit(module, loader(batches=1), loader(batches=1))

    assert counter.epochs == [0, 1, 2, 3, 4]  # best 0.4 at epoch 2; 0.395 is within min_delta; 0.45 is worse
    assert (stopper.stopped_epoch, stopper.wait_count, stopper.best_score) == (4, 2, pytest.approx(0.4))


def test_early_stopping_names_a_missing_metric(tmp_path):
    trainer = make_trainer(tmp_path, callbacks=[EarlyStopping("val/acc")], logger=False)
    with pytest.raises(ValueError, match=r"monitor='val/acc'.*'val/loss'"):
        trainer.fit(Regression(), loader(batches=1), loader(batches=1))


def test_model_checkpoint_keeps_the_best_k_and_last_and_resumes_its_bookkeeping(tmp_path):
    dirpath = tmp_path / "ckpts"
    schedule = [0.1, 0.9, 0.3, 0.8, 0.2, 0.95, 0.1]
    saver = ModelCheckpoint(dirpath, monitor="val/score", mode="max", save_top_k=2, save_last=True)
    trainer = make_trainer(tmp_path, max_epochs=5, callbacks=[saver], enable_checkpointing=True, logger=False)
    trainer.fit(Regression(schedule), loader(batches=2), loader(batches=1))

    assert checkpoint_dirs(dirpath) == ["epoch=1-step=4", "epoch=3-step=8", "last"]
    assert saver.best_model_path == os.path.join(os.path.realpath(dirpath), "epoch=1-step=4")
    assert float(saver.best_model_score) == pytest.approx(0.9)
    saved = load_trainer_state(dirpath / "last")["callbacks"][saver.state_key]
    assert sorted(map(os.path.basename, saved["best_k_models"])) == ["epoch=1-step=4", "epoch=3-step=8"]

    # Resume from `last`: 0.95 at epoch 5 pushes out epoch 3 (0.8); 0.1 at epoch 6 is not kept.
    resumed = ModelCheckpoint(dirpath, monitor="val/score", mode="max", save_top_k=2, save_last=True)
    trainer = make_trainer(tmp_path, max_epochs=7, callbacks=[resumed], enable_checkpointing=True, logger=False)
    with pytest.warns(UserWarning, match="exists and is not empty"):
        trainer.fit(Regression(schedule), loader(batches=2), loader(batches=1), ckpt_path=dirpath / "last")
    assert checkpoint_dirs(dirpath) == ["epoch=1-step=4", "epoch=5-step=12", "last"]
    assert float(resumed.best_model_score) == pytest.approx(0.95)
    assert load_trainer_state(dirpath / "last")["state"]["global_step"] == 14


def test_model_checkpoint_every_n_train_steps_in_the_default_directory(tmp_path):
    saver = ModelCheckpoint(every_n_train_steps=3, save_top_k=-1)
    trainer = make_trainer(tmp_path, callbacks=[saver], enable_checkpointing=True)
    trainer.fit(Regression(), loader(), None)

    assert saver.dirpath == os.path.realpath(os.path.join(trainer.log_dir, "checkpoints"))
    assert checkpoint_dirs(saver.dirpath) == ["epoch=0-step=3", "epoch=1-step=6"]
    assert saver.best_model_path.endswith("epoch=1-step=6") and saver.best_model_score is None


def test_max_steps_inside_an_epoch_still_leaves_a_checkpoint(tmp_path):
    """As Lightning: the default ModelCheckpoint keeps what a run trained when max_steps ends it mid-epoch (the
    checkpoint resumes inside the epoch, at the next batch); with every_n_train_steps it keeps its own steps."""
    trainer = make_trainer(tmp_path, max_steps=3, enable_checkpointing=True, logger=False)
    trainer.fit(Regression(), loader(batches=8), None)
    assert checkpoint_dirs(tmp_path / "checkpoints") == ["epoch=0-step=3"]
    assert load_trainer_state(tmp_path / "checkpoints" / "epoch=0-step=3")["state"]["batches_done_in_epoch"] == 3
    saver = ModelCheckpoint(tmp_path / "by_steps", every_n_train_steps=2, save_top_k=-1)
    make_trainer(tmp_path, max_steps=3, callbacks=[saver], enable_checkpointing=True, logger=False).fit(
        Regression(), loader(batches=8), None
    )
    assert checkpoint_dirs(tmp_path / "by_steps") == ["epoch=0-step=2"]


def test_model_checkpoint_names_a_missing_metric(tmp_path):
    saver = ModelCheckpoint(tmp_path / "ckpts", monitor="val/acc")
    trainer = make_trainer(tmp_path, callbacks=[saver], enable_checkpointing=True, logger=False)
    with pytest.raises(ValueError, match=r"monitor='val/acc'.*'val/loss'"):
        trainer.fit(Regression(), loader(batches=1), loader(batches=1))


def test_progress_bar_shows_epochs_loss_and_prog_bar_metrics_without_a_tty(tmp_path, capsys):
    trainer = make_trainer(tmp_path, enable_progress_bar=True, logger=False)
    trainer.fit(Regression(), loader(), loader(batches=2))
    trainer.validate(dataloaders=loader(batches=2))

    err = capsys.readouterr().err
    assert "Epoch 0: 100%" in err and "Epoch 1: 100%" in err and "4/4" in err
    assert "loss=" in err and "step=8" in err and "train/loss=" in err
    assert err.rstrip().splitlines()[-1].startswith("Validation: 100%")  # a standalone validation bar stays


# -- on two ranks --------------------------------------------------------------------------------------------
def _two_rank_body(root: str) -> dict:
    """Each rank logs its own (unsynced) `val/score`: rank 0's plateaus, rank 1's keeps improving. The
    callbacks must follow rank 0 on both ranks and only rank 0 may write TensorBoard files."""
    rank = int(os.environ["RANK"])
    schedule = [[1.0, 0.5, 0.6, 0.7, 0.8], [1.0, 0.9, 0.8, 0.7, 0.6]][rank]
    stopper = EarlyStopping("val/score", patience=1)
    saver = ModelCheckpoint(monitor="val/score", save_top_k=2)
    counter = EpochCounter()
    trainer = make_trainer(
        root,
        strategy="ddp",
        devices=2,
        max_epochs=5,
        enable_checkpointing=True,
        callbacks=[stopper, saver, counter, LearningRateMonitor()],
    )
    trainer.fit(Regression(schedule), loader(batches=2), loader(batches=1))
    return {
        "epochs": counter.epochs,
        "stopped": stopper.stopped_epoch,
        "log_dir": trainer.log_dir,
        "kept": sorted(map(os.path.basename, saver.best_k_models)),
        "best": saver.best_model_path,
        "files": sorted(os.listdir(trainer.log_dir)),
    }


def test_two_ranks_take_rank_zero_decisions_and_only_rank_zero_writes(rank_pool, tmp_path):
    results = rank_pool(2).run(_two_rank_body, str(tmp_path))

    assert results[0] == results[1]
    result = results[0]
    assert result["epochs"] == [0, 1, 2] and result["stopped"] == 2
    assert result["kept"] == ["epoch=1-step=2", "epoch=2-step=3"]
    assert result["files"] == ["checkpoints", *[f for f in result["files"] if f.startswith("events.")]]
    assert len(result["files"]) == 2  # one event file: rank 1 wrote none
    lrs = scalars(read_events(result["log_dir"]), "lr-SGD")
    assert lrs == [(step, pytest.approx(0.1 / 2**step)) for step in range(3)]
