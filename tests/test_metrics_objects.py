"""Metrics written the way Lightning users write them give one process's numbers (issue 18), on real ranks:

- every sample reaches the user's step exactly once in validate, test, predict and fit's validation: what the step
  collects itself (a torchmetrics object, a list of sample ids) equals one process on all samples, whatever the
  world size and strategy, for 9 samples in batches of 2 and for an iterable dataset with a different count on each
  rank; a rank left without a batch takes part in the collectives without running the step, or the ranks stop with
  an error naming them;
- `self.log(name, metric)` and `self.log_dict(metric_collection)` take torchmetrics objects, as Lightning does;
- what the epoch-end hooks log belongs to that epoch: in validate()'s results, in `callback_metrics` when
  ModelCheckpoint runs, in the logger at that epoch's step;
- a module without `validation_step` trains, with one warning, and a monitor of a validation metric says why it
  never appeared.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from callbacks import Callback, EarlyStopping, Logger, ModelCheckpoint
from strategies import FSDPStrategy
from trainer import Trainer, TrainModule

torchmetrics = pytest.importorskip("torchmetrics")
from torchmetrics import MeanSquaredError, MetricCollection  # noqa: E402
from torchmetrics.classification import MulticlassAccuracy  # noqa: E402

QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
CLASSES, SAMPLES = 4, 9
# per rank, by world size: an iterable dataset whose ranks yield different counts (rank 1 of 3 yields nothing)
STREAM_COUNTS = {1: [9], 2: [7, 2], 3: [5, 0, 4]}


def strategy(name: str):
    """fsdp with each Linear as a unit: every forward pass all-gathers, so each rank must take part in each."""
    return FSDPStrategy(auto_wrap_policy={nn.Linear}) if name == "fsdp" else name


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def samples(n: int = SAMPLES) -> TensorDataset:
    """(index, x, y): the index tells which samples a step saw."""
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.arange(n), torch.randn(n, 4, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def loader(n: int = SAMPLES, batch_size: int = 2, **kwargs) -> DataLoader:
    return DataLoader(samples(n), batch_size=batch_size, **kwargs)


class RankStream(IterableDataset):
    """Rank r yields `counts[r]` samples, the next ones after those of the ranks before it: all ranks together
    yield samples 0..sum(counts)-1 once."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def __iter__(self):
        index, x, y = samples(sum(self.counts)).tensors
        start = sum(self.counts[: rank()])
        for i in range(start, start + self.counts[rank()]):
            yield index[i], x[i], y[i]


def stream(counts: list[int]) -> DataLoader:
    return DataLoader(RankStream(counts), batch_size=2)


class Classifier(TrainModule):
    """The three patterns: a metric object logged (val/acc, and test/* through log_dict of a MetricCollection), a
    metric updated in the step and computed in on_validation_epoch_end (val/mse), and sample ids collected in the
    step (self.ids)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, CLASSES))
        self.val_acc = MulticlassAccuracy(CLASSES)
        self.val_mse = MeanSquaredError()
        self.test_metrics = MetricCollection(
            {"acc": MulticlassAccuracy(CLASSES), "mse": MeanSquaredError()}, prefix="test/"
        )
        self.ids: list[int] = []
        self.computed: list[float] = []  # val/mse of each validation, as on_validation_epoch_end computed it

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        index, x, y = batch
        logits = self(x)
        self.val_acc(logits.argmax(1), y)
        self.log("val/acc", self.val_acc)
        self.val_mse.update(true_class_probability(logits, y), torch.ones(len(y)))
        self.ids += index.tolist()

    def on_validation_epoch_end(self):
        value = self.val_mse.compute()
        self.val_mse.reset()
        self.log("val/mse", value)
        self.computed.append(float(value))

    def test_step(self, batch, batch_idx):
        index, x, y = batch
        self.test_metrics(self(x).argmax(1), y)
        self.log_dict(self.test_metrics)
        self.ids += index.tolist()

    def predict_step(self, batch, batch_idx):
        index, x, _ = batch
        self.ids += index.tolist()
        return torch.cat([index[:, None].float(), self(x)], dim=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def true_class_probability(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return logits.softmax(1).gather(1, y[:, None])[:, 0]


def one_process(weights: dict[str, torch.Tensor], n: int = SAMPLES) -> dict[str, float]:
    """The same metrics computed in one process on samples 0..n-1 at once."""
    model = Classifier()
    model.load_state_dict(weights)
    _, x, y = samples(n).tensors
    with torch.no_grad():
        logits = model(x)
    preds = logits.argmax(1)
    return {
        "val/acc": float(MulticlassAccuracy(CLASSES)(preds, y)),
        "val/mse": float(MeanSquaredError()(true_class_probability(logits, y), torch.ones(n))),
        "test/acc": float(MulticlassAccuracy(CLASSES)(preds, y)),
        "test/mse": float(MeanSquaredError()(preds, y)),
        "logits": logits,
    }


class EachValidation(Callback):
    """What ModelCheckpoint and EarlyStopping see at on_validation_end, with the weights validated."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_validation_epoch_start(self, trainer, module):
        module.ids = []

    def on_validation_end(self, trainer, module):
        if trainer.state.stage != "fit":
            return
        self.seen.append(
            {
                "sanity": trainer.sanity_checking,
                "val/mse": float(trainer.callback_metrics["val/mse"]),
                "val/acc": float(trainer.callback_metrics["val/acc"]),
                "ids": list(module.ids),
                "computed": module.computed[-1],
                "weights": trainer.strategy.full_state_dict(),
            }
        )


def run_stage(trainer: Trainer, module: Classifier, stage: str, data: DataLoader):
    module.ids = []
    results = getattr(trainer, stage)(module, data)
    return results if stage == "predict" else results[0], list(module.ids)


def body_every_pattern(name: str) -> dict:
    recorder = EachValidation()
    trainer = Trainer(
        strategy=strategy(name), devices=world_size(), max_epochs=2, timeout=30, callbacks=[recorder], **QUIET
    )
    module = Classifier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader(12, shuffle=True), loader())  # sanity check (2 steps), then 2 validations
        out = {
            "fit": recorder.seen,
            "weights": trainer.strategy.full_state_dict(),
            "state devices": metric_state_devices(module) | {str(trainer.strategy.root_device)},
        }
        for stage in ("validate", "test", "predict"):
            out[stage] = run_stage(trainer, module, stage, loader())
            out[f"{stage} stream"] = run_stage(trainer, module, stage, stream(STREAM_COUNTS[world_size()]))
        if world_size() == 3:  # fewer samples than ranks: rank 2 has none
            out["validate 2 samples"] = run_stage(trainer, module, "validate", loader(2))
    out["notices"] = [str(w.message) for w in caught if "without running" in str(w.message)]
    return out


def metric_state_devices(module: TrainModule) -> set[str]:
    states = [v for m in module.modules() if isinstance(m, torchmetrics.Metric) for v in m.metric_state.values()]
    return {str(v.device) for v in states if isinstance(v, torch.Tensor)}


def run_on_ranks(rank_pool, devices: int, body, *args) -> list:
    return [body(*args)] if devices == 1 else rank_pool(devices).run(body, *args)


def all_ids(ranks: list[dict], key: str) -> list[int]:
    return sorted(i for r in ranks for i in r[key][1])


@pytest.mark.parametrize("name", ["ddp", "zero2", "fsdp"])
@pytest.mark.parametrize("devices", [1, 2, 3])
def test_what_the_step_collects_equals_one_process_on_every_sample_once(rank_pool, devices, name):
    ranks = run_on_ranks(rank_pool, devices, body_every_pattern, name)
    assert all(len(r["state devices"]) == 1 for r in ranks)  # the metrics' states moved with the module
    by_rank = [[v for v in r["fit"] if not v["sanity"]] for r in ranks]
    assert [len(validations) for validations in by_rank] == [2] * devices
    for i, validation in enumerate(by_rank[0]):  # fit's validation: every rank's view, against one process
        want = one_process(validation["weights"])
        assert sorted(n for validations in by_rank for n in validations[i]["ids"]) == list(range(SAMPLES))
        assert validation["computed"] == pytest.approx(want["val/mse"], rel=1e-6)
        for validations in by_rank:
            for key in ("val/acc", "val/mse"):
                assert validations[i][key] == pytest.approx(want[key], rel=1e-6), (i, key)
    want = one_process(ranks[0]["weights"])
    for data in ("", " stream"):
        for stage in ("validate", "test"):
            assert all_ids(ranks, stage + data) == list(range(SAMPLES)), stage + data  # once each
            for r in ranks:
                metrics = r[stage + data][0]
                for key in [k for k in want if k.startswith("val/" if stage == "validate" else "test/")]:
                    assert metrics[key] == pytest.approx(want[key], rel=1e-6), (stage + data, key)
        assert all_ids(ranks, "predict" + data) == list(range(SAMPLES))
        predicted = torch.cat(ranks[0]["predict" + data][0])
        assert sorted(predicted[:, 0].long().tolist()) == list(range(SAMPLES))
        order = predicted[:, 0].long()
        torch.testing.assert_close(predicted[:, 1:], want["logits"][order], rtol=1e-5, atol=1e-6)
    if devices == 3:
        assert all_ids(ranks, "validate 2 samples") == [0, 1]
        assert ranks[0]["validate 2 samples"][0]["val/acc"] == pytest.approx(
            one_process(ranks[0]["weights"], 2)["val/acc"], rel=1e-6
        )
    # The fallback for ranks left without a batch is said on rank 0, once per kind of step.
    assert all(r["notices"] == [] for r in ranks[1:])
    assert len(ranks[0]["notices"]) == (0 if devices == 1 else 3), ranks[0]["notices"]


# --------------------------------------------------------------- a rank that cannot take part without the step


class GathersInTheStep(Classifier):
    def validation_step(self, batch, batch_idx):
        self.log("val/gathered", self.all_gather(batch[1].sum()).sum())


class HeadAfterTheFirstStep(Classifier):
    """Its collectives depend on the step: the head (a unit under fsdp) runs from the second step on."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(CLASSES, CLASSES)

    def validation_step(self, batch, batch_idx):
        logits = self(batch[1])
        self.log("val/x", (self.extra(logits) if batch_idx > 0 else logits).mean())


def body_cannot_take_part(name: str, counts: list[int], module_class: str) -> str:
    trainer = Trainer(strategy=strategy(name), devices=2, timeout=30, **QUIET)
    try:
        trainer.validate(globals()[module_class](), stream(counts))
    except (RuntimeError, ValueError) as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "name, counts, module_class, match",
    [
        ("fsdp", [3, 0], "Classifier", "rank(s) [1] have no batch"),  # no step ran before: no forward to repeat
        ("ddp", [3, 1], "GathersInTheStep", "all_gather"),  # a collective of the user's own: no way to take part
        # rank 1 sits out step 1 repeating the all-gathers of step 0, but rank 0's step 1 gathers one unit more
        (
            "fsdp",
            [4, 2],
            "HeadAfterTheFirstStep",
            "validation_step 1 on rank 0: its collective 3 is the all-gather of unit 'extra'",
        ),
    ],
)
def test_a_rank_that_cannot_take_part_without_the_step_is_an_error_on_every_rank(
    rank_pool, name, counts, module_class, match
):
    for message in rank_pool(2).run(body_cannot_take_part, name, counts, module_class):
        assert match in message and "rank(s) [1]" in message.lower(), message


# ------------------------------------------------------------------------------- metric objects, step and epoch


class Recorded(Logger):
    version = None  # set by the Trainer

    def __init__(self) -> None:
        self.logged: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.logged.append((step, dict(metrics)))


class TrainAccuracy(Classifier):
    """A metric object logged per step and per epoch in training; a value logged in on_train_epoch_end."""

    def __init__(self) -> None:
        super().__init__()
        self.train_acc = MulticlassAccuracy(CLASSES, average="micro")
        self.batch_values: list[float] = []

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        logits = self(x)
        self.batch_values.append(float((logits.argmax(1) == y).float().mean()))
        self.train_acc(logits.argmax(1), y)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=True)
        return F.cross_entropy(logits, y)

    def on_train_epoch_end(self):
        self.log("train/epoch_end", float(self.current_epoch + 10))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)  # fixed weights: every batch's value is known


class TrainEpochAtValidation(Callback):
    """What a ModelCheckpoint at the end of validation reads of the training epoch that validation follows."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_validation_end(self, trainer, module):
        if trainer.state.stage == "fit":
            self.seen.append(float(trainer.callback_metrics["train/acc_epoch"]))


def test_a_metric_object_logs_its_batch_value_per_step_and_compute_per_epoch():
    logger, at_validation = Recorded(), TrainEpochAtValidation()
    stopper = EarlyStopping("train/epoch_end", patience=1, check_on_train_epoch_end=True)  # 10, then 11: stop
    trainer = Trainer(
        devices=1,
        max_epochs=3,
        log_every_n_steps=1,
        logger=logger,
        callbacks=[stopper, at_validation],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    module = TrainAccuracy()
    trainer.fit(module, loader(6), loader())
    assert (trainer.current_epoch, stopper.best_score) == (2, 10.0)  # it read what on_train_epoch_end logged
    steps = [(step, m["train/acc_step"]) for step, m in logger.logged if "train/acc_step" in m]
    assert steps == [(i + 1, pytest.approx(v)) for i, v in enumerate(module.batch_values)]
    by_step: dict[int, dict] = {}
    for step, metrics in logger.logged:
        by_step.setdefault(step, {}).update(metrics)
    epochs = [(step, m) for step, m in sorted(by_step.items()) if "train/acc_epoch" in m]
    assert [step for step, _ in epochs] == [3, 6]  # at the epoch's last step
    _, x, y = samples(6).tensors
    with torch.no_grad():
        accuracy = float((module(x).argmax(1) == y).float().mean())
    assert at_validation.seen == [pytest.approx(accuracy)] * 2  # the epoch's own, when validation follows it
    for epoch, (_, metrics) in enumerate(epochs):
        assert metrics["train/acc_epoch"] == pytest.approx(accuracy)  # compute() over the epoch, then reset()
        assert metrics["train/epoch_end"] == epoch + 10  # logged in on_train_epoch_end: that epoch's entry
    validations = [(step, m) for step, m in logger.logged if "val/mse" in m]
    assert [step for step, _ in validations] == [3, 6]  # also what on_validation_epoch_end logs
    assert [m["val/mse"] for _, m in validations] == pytest.approx(module.computed)
    with pytest.raises(TypeError, match="log_dict"):
        trainer.metrics.log("x", module.test_metrics, False, None, None, False)
    module.val_mse.update(torch.ones(1), torch.ones(1))  # updated, never called: no value of a batch
    with pytest.raises(ValueError, match="on_step=True"):
        trainer.metrics.log("y", module.val_mse, False, True, False, False)


def body_checkpoint_of_epoch_end_metric(root: str) -> dict:
    recorder, logger = EachValidation(), Recorded()
    saver = ModelCheckpoint(os.path.join(root, "ckpts"), monitor="val/mse", mode="min", save_top_k=1)
    trainer = Trainer(
        strategy="ddp",
        devices=world_size(),
        max_epochs=3,
        logger=logger,
        callbacks=[recorder, saver],
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Classifier()
    trainer.fit(module, loader(12, shuffle=True), loader())
    validated = trainer.validate(module, loader())[0]
    return {
        "seen": recorder.seen,
        "best": (saver.best_model_path, float(saver.best_model_score)),
        "logged": logger.logged,
        "validated": validated,
        "computed": module.computed,
    }


def test_modelcheckpoint_keeps_what_one_process_keeps_for_a_metric_computed_at_epoch_end(rank_pool, tmp_path):
    ranks = rank_pool(2).run(body_checkpoint_of_epoch_end_metric, str(tmp_path))
    for result in ranks:
        validations = [v for v in result["seen"] if not v["sanity"]]
        true = [one_process(v["weights"])["val/mse"] for v in validations]
        assert [v["val/mse"] for v in validations] == pytest.approx(true, rel=1e-6)  # not the previous one's
        best = min(range(len(true)), key=true.__getitem__)
        assert result["best"][1] == pytest.approx(true[best], rel=1e-6)
        assert f"epoch={best}-" in os.path.basename(result["best"][0]), result["best"]
        assert result["validated"]["val/mse"] == pytest.approx(result["computed"][-1])  # in validate()'s results
    logged = [(step, m["val/mse"]) for step, m in ranks[0]["logged"] if "val/mse" in m]
    assert logged[:3] == [(3 * (i + 1), pytest.approx(v)) for i, v in enumerate(true)]  # at that epoch's step


# ---------------------------------------------------------------------------- validation the module does not define


def body_no_validation_step(root: str, monitor: str | None) -> dict:
    from tests.test_lightning_demos import demo

    boring = demo("boring_classes")
    callbacks = {
        "checkpoint": [ModelCheckpoint(monitor="val_loss")],
        "stopping": [EarlyStopping("val_loss")],
        None: [],
    }[monitor]
    trainer = Trainer(
        strategy="ddp",
        devices=2,
        max_epochs=1,
        limit_train_batches=4,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(boring.DemoModel(), datamodule=boring.BoringDataModule())
            error = None
        except ValueError as raised:
            error = str(raised)
    return {
        "step": trainer.global_step,
        "error": error,
        "warnings": [str(w.message) for w in caught if "validation_step" in str(w.message)],
    }


def test_a_module_without_validation_step_trains_and_says_validation_is_skipped(rank_pool, tmp_path):
    ranks = rank_pool(2).run(body_no_validation_step, str(tmp_path), None)
    assert [r["step"] for r in ranks] == [4, 4] and [r["error"] for r in ranks] == [None, None]
    assert len(ranks[0]["warnings"]) == 1 and ranks[1]["warnings"] == []
    assert "DemoModel" in ranks[0]["warnings"][0] and "skipped" in ranks[0]["warnings"][0]
    for monitor in ("checkpoint", "stopping"):
        for r in rank_pool(2).run(body_no_validation_step, str(tmp_path / monitor), monitor):
            assert "'val_loss'" in r["error"] and "DemoModel defines no validation_step" in r["error"], r["error"]


# ---------------------------------------------------------------------------- reset in the epoch-end hook, as Lightning


def resetting_module(base: type) -> type:
    """Lightning's common pattern, on `base` (Lightning's LightningModule or our TrainModule): a torchmetrics object
    logged per epoch in each step and reset in the epoch-end hook, which also logs a value of its own and notes
    what `trainer.callback_metrics` holds for the stage's metric in it."""

    class ResetsInEpochEndHooks(base):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)
            self.train_mean, self.val_mean, self.test_mean = (torchmetrics.MeanMetric() for _ in range(3))
            self.in_hooks: list[tuple[str, float | None]] = []

        def _step(self, metric, stage: str, batch) -> torch.Tensor:
            _, x, y = batch
            metric(y.float())  # the mean label: the same at any world size
            self.log(f"{stage}/mean", metric, on_step=False, on_epoch=True)
            return self.net(x).pow(2).mean()

        def training_step(self, batch, batch_idx):
            return self._step(self.train_mean, "train", batch)

        def validation_step(self, batch, batch_idx):
            self._step(self.val_mean, "val", batch)

        def test_step(self, batch, batch_idx):
            self._step(self.test_mean, "test", batch)

        def _epoch_end(self, stage: str, metric) -> None:
            value = self.trainer.callback_metrics.get(f"{stage}/mean")
            self.in_hooks.append((stage, None if value is None else round(float(value), 6)))
            metric.reset()
            self.log(f"{stage}/in_hook", 1.0 + len(self.in_hooks))

        def on_train_epoch_end(self):
            self._epoch_end("train", self.train_mean)

        def on_validation_epoch_end(self):
            self._epoch_end("val", self.val_mean)

        def on_test_epoch_end(self):
            self._epoch_end("test", self.test_mean)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return ResetsInEpochEndHooks


def fit_and_test_resetting(trainer_class: type, logger: Any, **trainer_kwargs) -> dict:
    from trainer import TrainModule as base

    if trainer_class is not Trainer:
        from lightning.pytorch import LightningModule as base
    torch.manual_seed(0)
    module = resetting_module(base)()
    trainer = trainer_class(
        max_epochs=2,
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_kwargs,
    )
    trainer.fit(module, loader(8), loader(6))
    trainer.test(module, loader(6))
    logged: dict[str, list[float]] = {}  # by name, in the order logged
    for _, metrics in logger.logged:
        for name, value in metrics.items():
            if name.endswith(("/mean", "/in_hook")):
                logged.setdefault(name, []).append(round(value, 6))
    return {"in_hooks": module.in_hooks, "logged": logged}


def body_resetting(name: str) -> dict:
    return fit_and_test_resetting(Trainer, Recorded(), strategy=strategy(name), devices=world_size())


def test_a_metric_reset_in_the_epoch_end_hook_logs_what_lightning_logs(rank_pool):
    """Lightning computes the logged metric objects before on_train/validation/test_epoch_end (they are in
    callback_metrics there), so a reset in the hook does not zero what is logged; values logged in the hook still
    count for that epoch. Recorded with Lightning itself, then ours on 1 and 2 ranks."""
    import lightning.pytorch as pl

    class LightningRecorded(pl.loggers.logger.Logger):
        name, version = "recorded", 0

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[tuple[int, dict]] = []

        def log_metrics(self, metrics, step=None):
            self.logged.append((step, dict(metrics)))

        def log_hyperparams(self, *args, **kwargs):
            pass

    lightnings = fit_and_test_resetting(pl.Trainer, LightningRecorded(), accelerator="cpu", devices=1)
    assert ("val", None) not in lightnings["in_hooks"] and len(lightnings["in_hooks"]) == 6  # sanity, 2 x 2, test
    assert fit_and_test_resetting(Trainer, Recorded(), devices=1) == lightnings
    # no validation at the epoch's end: the training metric is computed before on_train_epoch_end all the same
    without = fit_and_test_resetting(pl.Trainer, LightningRecorded(), accelerator="cpu", devices=1, limit_val_batches=0)
    assert without["in_hooks"][0] == ("train", 1.875)
    assert fit_and_test_resetting(Trainer, Recorded(), devices=1, limit_val_batches=0) == without
    for name in ("ddp", "fsdp"):
        ranks = rank_pool(2).run(body_resetting, name)
        # (the sanity check's 2 batches are 2 per rank: all 6 samples at 2 ranks)
        assert [rank["in_hooks"][1:] for rank in ranks] == [lightnings["in_hooks"][1:]] * 2, name
        assert ranks[0]["logged"] == lightnings["logged"], name
