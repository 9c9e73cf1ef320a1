"""A LightningModule moves over with only its imports changed: Lightning's names, forms and habits work here.

The modules below are written as Lightning's demos and documentation write them (BoringModel, a GAN with manual
optimization, ReduceLROnPlateau on a validation metric, a DataModule); only the imports point at this project.
"""

from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR
from torch.utils.data import DataLoader, Dataset, TensorDataset

from callbacks import Callback
from strategies import FSDPStrategy
from strategies.sharding.parameter import ShardedParameterError
from tests.test_parity import max_relative_difference
from trainer import DataModule, Trainer, TrainModule
from trainer.hparams import AttributeDict
from trainer.loop.optimizers import normalize


def _opt(n: int = 1) -> list[torch.optim.Optimizer]:
    return [torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1) for _ in range(n)]


def test_configure_optimizers_accepts_every_lightning_form():
    (a, b) = _opt(2)
    sa, sb = StepLR(a, 1), StepLR(b, 1)
    plateau = ReduceLROnPlateau(a)
    cases = {
        "optimizer": (a, [a], []),
        "list": ([a, b], [a, b], []),
        "tuple": ((a, b), [a, b], []),
        "two lists": (([a, b], [sa, sb]), [a, b], [(sa, 0), (sb, 1)]),
        "lists with a config dict": (([a], [{"scheduler": sa, "interval": "step"}]), [a], [(sa, 0)]),
        "dict": ({"optimizer": a, "lr_scheduler": sa}, [a], [(sa, 0)]),
        "dict with config": (
            {"optimizer": a, "lr_scheduler": {"scheduler": plateau, "monitor": "val/loss"}},
            [a],
            [(plateau, 0)],
        ),
        "dict monitor outside": ({"optimizer": a, "lr_scheduler": plateau, "monitor": "val/loss"}, [a], [(plateau, 0)]),
        "list of dicts": ([{"optimizer": a, "lr_scheduler": sa}, {"optimizer": b}], [a, b], [(sa, 0)]),
        "pair (this project's older form)": ((a, sa), [a], [(sa, 0)]),
    }
    for name, (returned, optimizers, schedulers) in cases.items():
        got_optimizers, configs = normalize(returned)
        assert got_optimizers == optimizers, name
        assert [(c.scheduler, c.optimizer_index) for c in configs] == schedulers, name
    step_config = normalize(([a], [{"scheduler": sa, "interval": "step", "frequency": 3}]))[1][0]
    assert (step_config.interval, step_config.frequency) == ("step", 3)


@pytest.mark.parametrize(
    "returned, error, match",
    [
        (lambda a: [a, "sgd", a], TypeError, "configure_optimizers must return"),
        (lambda a: [a, "sgd"], TypeError, "not a learning-rate scheduler"),
        (lambda a: {"optimizer": a, "lr_scheduler": ReduceLROnPlateau(a)}, ValueError, "ReduceLROnPlateau needs"),
        (lambda a: {"optimizer": a, "scheduler": StepLR(a, 1)}, ValueError, "unknown keys"),
        (
            lambda a: {"optimizer": a, "lr_scheduler": {"scheduler": StepLR(a, 1), "interval": "batch"}},
            ValueError,
            "interval='batch'",
        ),
        (lambda a: None, TypeError, "configure_optimizers must return"),
    ],
)
def test_configure_optimizers_refuses_what_it_cannot_read(returned, error, match):
    with pytest.raises(error, match=match):
        normalize(returned(_opt()[0]))


def test_hparams_are_read_as_attributes_and_taken_from_init():
    from trainer import TrainModule

    class Model(TrainModule):
        def __init__(self, hidden_dim: int = 8, lr: float = 0.1, **extra) -> None:
            super().__init__()
            self.save_hyperparameters()

    class Wider(Model):
        def __init__(self, width: int = 4, **kwargs) -> None:
            super().__init__(**kwargs)

    model = Model(16, dropout=0.5)
    assert model.hparams == {"hidden_dim": 16, "lr": 0.1, "dropout": 0.5}
    assert model.hparams.hidden_dim == 16 and isinstance(model.hparams, AttributeDict)
    assert Wider(width=2, lr=0.3).hparams == {"width": 2, "hidden_dim": 8, "lr": 0.3}  # the subclasses' too
    with pytest.raises(AttributeError, match="no hyperparameter 'depth'"):
        _ = model.hparams.depth

    class Named(TrainModule):
        def __init__(self, a: int, b: int = 2, c: object = None) -> None:
            super().__init__()
            self.save_hyperparameters("a", "b")

    assert Named(1).hparams == {"a": 1, "b": 2}

    class FromNamespace(TrainModule):
        def __init__(self, args: argparse.Namespace) -> None:
            super().__init__()
            self.save_hyperparameters(args, ignore=["seed"])

    assert FromNamespace(argparse.Namespace(lr=0.2, seed=1)).hparams == {"lr": 0.2}


# ------------------------------------------------------------------ modules as Lightning's docs and demos write them
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
QUIET = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)


class RandomDataset(Dataset):
    """lightning.pytorch.demos.boring_classes.RandomDataset."""

    def __init__(self, size: int, length: int) -> None:
        self.len = length
        self.data = torch.randn(length, size, generator=torch.Generator().manual_seed(0))

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]

    def __len__(self) -> int:
        return self.len


class BoringModel(TrainModule):
    """lightning.pytorch.demos.boring_classes.BoringModel, imports changed."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def loss(self, preds: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            labels = torch.ones_like(preds)
        return torch.nn.functional.mse_loss(preds, labels)

    def step(self, batch):
        output = self(batch)
        return self.loss(output)

    def training_step(self, batch, batch_idx):
        return {"loss": self.step(batch)}

    def validation_step(self, batch, batch_idx):
        return {"x": self.step(batch)}

    def test_step(self, batch, batch_idx):
        return {"y": self.step(batch)}

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        lr_scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        return [optimizer], [lr_scheduler]

    def train_dataloader(self):
        return DataLoader(RandomDataset(32, 64))

    def val_dataloader(self):
        return DataLoader(RandomDataset(32, 64))

    def test_dataloader(self):
        return DataLoader(RandomDataset(32, 64))


def make_strategy(name: str):
    return FSDPStrategy() if name == "fsdp" else name


def body_boring_model_every_strategy() -> dict:
    out = {}
    for name in STRATEGIES:
        torch.manual_seed(0)
        model = BoringModel()
        trainer = Trainer(
            strategy=make_strategy(name),
            devices=dist.get_world_size(),
            max_epochs=1,
            limit_train_batches=4,
            limit_val_batches=2,
            **QUIET,
        )
        trainer.fit(model)
        tested = trainer.test(model)
        out[name] = (
            trainer.global_step,
            trainer.strategy.full_state_dict(),
            tested,
            trainer.lr_scheduler_configs[0].scheduler.last_epoch,
        )
    return out


def test_lightnings_boring_model_runs_under_every_strategy(rank_pool):
    ranks = rank_pool(2).run(body_boring_model_every_strategy)
    weights = ranks[0]["ddp"][1]
    for name in STRATEGIES:
        steps, state, tested, scheduler_epochs = ranks[0][name]
        assert steps == 4 and scheduler_epochs == 1 and tested == [{}]  # ([opt], [sched]): StepLR per epoch
        assert max_relative_difference(state, weights) <= 1e-5, name


# ------------------------------------------------------------------ Trainer arguments users pass every day


class Plateau(BoringModel):
    """ReduceLROnPlateau following a validation metric that never improves."""

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", torch.tensor(1.0))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0, factor=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss"}}


def test_reduce_lr_on_plateau_steps_with_its_monitored_metric(tmp_path):
    trainer = Trainer(
        devices=1, max_epochs=3, limit_train_batches=2, limit_val_batches=1, default_root_dir=tmp_path, **QUIET
    )
    model = Plateau()
    trainer.fit(model)
    # epoch 1 sets the best; epochs 2 and 3 do not improve: two halvings
    assert model.optimizers().param_groups[0]["lr"] == pytest.approx(0.025)


class BrokenValidation(BoringModel):
    trained = 0

    def training_step(self, batch, batch_idx):
        BrokenValidation.trained += 1
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        raise RuntimeError("a bug in validation_step")


def test_the_sanity_check_finds_a_broken_validation_step_before_training(tmp_path):
    with pytest.raises(RuntimeError, match="a bug in validation_step"):
        Trainer(devices=1, max_epochs=1, default_root_dir=tmp_path, **QUIET).fit(BrokenValidation())
    assert BrokenValidation.trained == 0
    trainer = Trainer(
        devices=1,
        max_epochs=1,
        limit_train_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=tmp_path,
        **QUIET,
    )
    trainer.fit(BrokenValidation())  # no validation: no sanity check either
    with pytest.raises(ValueError, match="num_sanity_val_steps"):
        Trainer(num_sanity_val_steps=-2)


def test_fast_dev_run_runs_a_batch_of_each_and_writes_nothing(tmp_path):
    from callbacks import ModelCheckpoint

    trainer = Trainer(
        devices=1,
        fast_dev_run=True,
        default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts")],
        enable_progress_bar=False,
    )
    model = BoringModel()
    trainer.fit(model)
    assert trainer.global_step == 1 and trainer.num_val_batches == 1
    assert trainer.logger is None and not os.path.exists(tmp_path / "ckpts") and os.listdir(tmp_path) == []
    assert Trainer(fast_dev_run=3, **QUIET).limit_train_batches == 3
    with pytest.raises(ValueError, match="fast_dev_run"):
        Trainer(fast_dev_run=-1)


def test_lightning_names_for_accelerator_devices_and_precision():
    assert Trainer(devices=-1, **QUIET).world_size == 1
    assert Trainer(devices=[0], accelerator="cpu", **QUIET).world_size == 1
    with pytest.raises(ValueError, match="no CUDA device"):
        Trainer(accelerator="gpu")
    for precision in ("32-true", "16-true", "bf16-true", "16-mixed", "bf16-mixed"):
        Trainer(precision=precision, **QUIET)
    trainer = Trainer(precision="16-true", max_steps=2, **QUIET, num_sanity_val_steps=0)
    model = BoringModel()
    trainer.fit(model)
    assert model.layer.weight.dtype == torch.float16
    with pytest.raises(ValueError, match="gradient_clip_algorithm"):
        Trainer(gradient_clip_algorithm="max")


@pytest.mark.parametrize(
    "argument, closest",
    [
        ({"gpus": 2}, "devices=N with accelerator='cuda'"),
        ({"min_steps": 10}, "max_steps, and EarlyStopping"),
        ({"overfit_batches": 1}, "limit_train_batches"),
        ({"max_epoch": 3}, "did you mean max_epochs"),
    ],
)
def test_a_lightning_argument_not_supported_names_the_closest_thing(argument, closest):
    with pytest.raises(TypeError, match=closest.replace("(", r"\(").replace(")", r"\)")):
        Trainer(**argument)


# ------------------------------------------------------------------ logging, hyperparameters, checkpoints


class Logs(BoringModel):
    def __init__(self, hidden_dim: int = 32, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.layer = torch.nn.Linear(self.hparams.hidden_dim, 2)

    def training_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log_dict(
            {"train/sum": torch.tensor(float(batch_idx + 1)), "train/max": float(batch_idx)},
            on_step=False,
            on_epoch=True,
            reduce_fx="sum",
        )
        self.log("train/biggest", float(batch_idx), on_step=False, on_epoch=True, reduce_fx=torch.max)
        self.log("train/hidden", 1.0, logger=False)
        if self.global_rank == 0:
            self.log("train/rank0", 7.0, rank_zero_only=True)
        return loss


def test_log_reduce_fx_logger_and_rank_zero_only(tmp_path):
    trainer = Trainer(
        devices=1,
        max_epochs=1,
        limit_train_batches=3,
        limit_val_batches=0,
        default_root_dir=tmp_path,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(Logs())
    metrics = trainer.callback_metrics
    assert float(metrics["train/sum"]) == 6.0 and float(metrics["train/max"]) == 3.0  # 0+1+2 with reduce_fx sum
    assert float(metrics["train/biggest"]) == 2.0 and float(metrics["train/hidden"]) == 1.0
    events = EventAccumulator(trainer.log_dir)
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "train/sum" in tags and "train/rank0" in tags and "train/hidden" not in tags
    with pytest.raises(ValueError, match="reduce_fx='median'"):
        trainer.metrics.log("x", 1.0, False, True, False, False, reduce_fx="median")
    with pytest.raises(ValueError, match="contradict"):
        trainer.metrics.log("x", 1.0, False, True, False, True, rank_zero_only=True)


def body_load_from_checkpoint(root: str, name: str) -> None:
    trainer = Trainer(
        strategy=make_strategy(name),
        devices=dist.get_world_size(),
        max_steps=3,
        limit_val_batches=0,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    model = Logs(hidden_dim=32, lr=0.5)
    trainer.fit(model)
    trainer.save_checkpoint(os.path.join(root, name))
    state = trainer.strategy.full_state_dict()
    if trainer.is_global_zero:
        torch.save(state, os.path.join(root, f"{name}.pt"))


def test_load_from_checkpoint_rebuilds_the_module_from_any_strategys_checkpoint(rank_pool, tmp_path):
    for name in ("ddp", "fsdp"):
        rank_pool(2).run(body_load_from_checkpoint, str(tmp_path), name)
        model = Logs.load_from_checkpoint(tmp_path / name)
        assert model.hparams == {"hidden_dim": 32, "lr": 0.5}
        trained = torch.load(tmp_path / f"{name}.pt")
        assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
        assert Logs.load_from_checkpoint(tmp_path / name, lr=0.1).hparams.lr == 0.1
    events = EventAccumulator(str(tmp_path / "default" / "version_0"))
    events.Reload()
    assert "hidden_dim" in events.Tensors("hparams/text_summary")[0].tensor_proto.string_val[0].decode()


# ------------------------------------------------------------------ DataModules, setup and teardown


class FilesDataModule(DataModule):
    """Writes its data once per machine in prepare_data, reads it on every rank in setup (Lightning's pattern)."""

    def __init__(self, root: str, batch_size: int = 4) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.calls: list[str] = []

    def prepare_data(self) -> None:
        with open(os.path.join(self.hparams.root, "prepared.txt"), "a") as f:
            f.write(f"rank {dist.get_rank()}\n")
        path = os.path.join(self.hparams.root, "data.pt")
        if not os.path.exists(path):  # as a download would
            torch.save(torch.randn(32, 32, generator=torch.Generator().manual_seed(0)), path)

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")
        self.data = torch.load(os.path.join(self.hparams.root, "data.pt"))

    def teardown(self, stage: str) -> None:
        self.calls.append(f"teardown:{stage}")

    def train_dataloader(self):
        return DataLoader(TensorDataset(self.data), batch_size=self.hparams.batch_size)

    def val_dataloader(self):
        return DataLoader(TensorDataset(self.data[:8]), batch_size=self.hparams.batch_size)

    def predict_dataloader(self):
        return DataLoader(TensorDataset(self.data[:6]), batch_size=2)

    def state_dict(self) -> dict:
        return {"seen_stages": list(self.calls)}


class BuiltInSetup(BoringModel):
    """Layers built in setup() train (as in Lightning); teardown is called."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")
        if not hasattr(self, "head"):
            self.head = torch.nn.Linear(2, 2)

    def teardown(self, stage: str) -> None:
        self.calls.append(f"teardown:{stage}")

    def forward(self, x):
        return self.head(self.layer(x))

    def training_step(self, batch, batch_idx):
        return self.step(batch[0])

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.step(batch[0]))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


class HeadAtStart(Callback):
    """The head built in the module's setup, as training starts."""

    def on_train_start(self, trainer, module) -> None:
        self.head = trainer.strategy.full_state_dict()["head.weight"]


def body_datamodule(root: str) -> dict:
    datamodule = FilesDataModule(root)
    model = BuiltInSetup()
    at_start = HeadAtStart()
    trainer = Trainer(
        strategy="fsdp",
        devices=dist.get_world_size(),
        max_epochs=1,
        default_root_dir=root,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[at_start],
    )
    torch.manual_seed(0)
    trainer.fit(model, datamodule=datamodule)
    head_after = trainer.strategy.full_state_dict()["head.weight"]
    validated = trainer.validate(model, datamodule)  # Lightning's positional form
    predicted = trainer.predict(model, datamodule=datamodule)
    trainer.save_checkpoint(os.path.join(root, "with-dm"))
    return {
        "dm_calls": datamodule.calls,
        "model_calls": model.calls,
        "validated": validated,
        "predicted": predicted,
        "head_moved": not torch.equal(head_after, at_start.head),
    }


def test_a_datamodule_prepares_once_per_machine_and_sets_up_every_rank(rank_pool, tmp_path):
    from trainer.checkpoint import load_trainer_state

    ranks = rank_pool(2).run(body_datamodule, str(tmp_path))
    # once per machine (local rank 0) at each of fit, validate and predict, before any rank read the data
    assert (tmp_path / "prepared.txt").read_text() == "rank 0\n" * 3
    for rank in ranks:
        assert rank["dm_calls"] == [
            "setup:fit",
            "teardown:fit",
            "setup:validate",
            "teardown:validate",
            "setup:predict",
            "teardown:predict",
        ]
        assert rank["model_calls"] == rank["dm_calls"]
        assert "val/loss" in rank["validated"][0] and rank["head_moved"]
    assert len(torch.cat(ranks[0]["predicted"])) == 6 and ranks[1]["predicted"] is None
    saved = load_trainer_state(tmp_path / "with-dm")
    assert saved["datamodule"]["seen_stages"][:2] == ["setup:fit", "teardown:fit"]


def test_a_custom_batch_sampler_is_a_clear_error_on_several_ranks():
    from torch.utils.data import BatchSampler, SequentialSampler

    from trainer.data.loaders import distributed_loader

    class Buckets:  # a batch sampler without .sampler, as many are
        def __iter__(self):
            return iter([[0, 1], [2, 3]])

        def __len__(self):
            return 2

    data = TensorDataset(torch.zeros(4, 1))
    for batch_sampler in (Buckets(), BatchSampler(SequentialSampler(data), 2, False)):
        loader = DataLoader(data, batch_sampler=batch_sampler)
        with pytest.raises(ValueError, match="give it a DistributedSampler yourself"):
            distributed_loader(loader, 2, 0, 0, "train_dataloaders")
        assert distributed_loader(loader, 1, 0, 0, "train_dataloaders") is loader


# ------------------------------------------------------------------ hooks, and what .grad holds in them


class RecordsHooks(Callback):
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.grads: dict[str, list] = {}

    def _grads(self, module, where: str) -> None:
        seen = []
        for name, p in module.named_parameters():
            if p.grad is None:
                seen.append((name, "none"))
                continue
            try:
                seen.append((name, float(p.grad.float().norm())))
            except ShardedParameterError as error:
                seen.append(
                    (name, "sharded" if f"'{name}'" in str(error) and "full_gradients" in str(error) else str(error))
                )
        self.grads.setdefault(where, seen)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.calls.append("on_train_batch_start")

    def on_before_backward(self, trainer, module, loss):
        self.calls.append("on_before_backward")

    def on_after_backward(self, trainer, module):
        self.calls.append("on_after_backward")
        self._grads(module, "after_backward")

    def on_before_optimizer_step(self, trainer, module, optimizer):
        self.calls.append("on_before_optimizer_step")
        self._grads(module, "before_optimizer_step")
        self.full = trainer.strategy.full_gradients()

    def on_before_zero_grad(self, trainer, module, optimizer):
        self.calls.append("on_before_zero_grad")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.calls.append("on_train_batch_end")


def body_hooks_and_grads(name: str) -> dict:
    torch.manual_seed(0)
    recorder = RecordsHooks()
    trainer = Trainer(
        strategy=make_strategy(name),
        devices=dist.get_world_size(),
        max_steps=1,
        limit_val_batches=0,
        callbacks=[recorder],
        **QUIET,
    )
    trainer.fit(BoringModel())
    return {"calls": recorder.calls, "grads": recorder.grads, "full": recorder.full}


def test_hooks_run_where_lightning_runs_them_and_grad_is_never_none_there(rank_pool):
    """ddp and zero1: `.grad` is the full averaged gradient in on_before_optimizer_step (after backward of the
    last micro-batch: in on_after_backward too); zero2 and fsdp: a placeholder whose reads say the rank holds a
    shard and point at strategy.full_gradients(), which gives the full averaged gradient on every rank."""
    reference = {}
    for name in STRATEGIES:
        ranks = rank_pool(2).run(body_hooks_and_grads, name)
        for rank in ranks:
            assert rank["calls"] == [
                "on_train_batch_start",
                "on_before_backward",
                "on_after_backward",
                "on_before_optimizer_step",
                "on_before_zero_grad",
                "on_train_batch_end",
            ]
            for where in ("after_backward", "before_optimizer_step"):
                kinds = [value for _, value in rank["grads"][where]]
                assert "none" not in kinds, (name, where, kinds)
                if name in ("zero2", "fsdp"):
                    assert kinds == ["sharded"] * 2, (name, where, kinds)
        full = ranks[0]["full"]
        assert set(full) == {"layer.weight", "layer.bias"} and all(
            torch.equal(full[k], ranks[1]["full"][k]) for k in full
        )
        reference.setdefault("full", full)
        assert max_relative_difference(full, reference["full"]) <= 1e-6, name
        if name in ("ddp", "zero1"):  # .grad itself is the full averaged gradient
            norms = dict(ranks[0]["grads"]["before_optimizer_step"])
            assert norms["layer.weight"] == pytest.approx(float(full["layer.weight"].norm()), rel=1e-6)


# ------------------------------------------------------------------ manual optimization: a GAN


class GAN(TrainModule):
    """Lightning's manual-optimization GAN pattern (docs: "Manual Optimization"), imports changed."""

    def __init__(self, clip: float | None = None) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
        self.discriminator = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
        self.clip = clip

    def training_step(self, batch, batch_idx):
        real, noise = batch
        g_opt, d_opt = self.optimizers()
        # generator
        self.toggle_optimizer(g_opt)
        fake = self.generator(noise)
        g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), torch.ones(len(fake), 1))
        self.manual_backward(g_loss)
        if self.clip:
            self.clip_gradients(g_opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        g_opt.step()
        g_opt.zero_grad()
        self.untoggle_optimizer(g_opt)
        # discriminator
        self.toggle_optimizer(d_opt)
        real_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), torch.ones(len(real), 1))
        fake_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), torch.zeros(len(fake), 1))
        d_loss = (real_loss + fake_loss) / 2
        self.manual_backward(d_loss)
        if self.clip:
            self.clip_gradients(d_opt, gradient_clip_val=self.clip / 10, gradient_clip_algorithm="value")
        d_opt.step()
        d_opt.zero_grad()
        self.untoggle_optimizer(d_opt)
        self.log_dict({"g_loss": g_loss, "d_loss": d_loss}, prog_bar=True)

    def configure_optimizers(self):
        g = torch.optim.Adam(self.generator.parameters(), lr=0.01)
        d = torch.optim.SGD(self.discriminator.parameters(), lr=0.05, momentum=0.9)
        return [g, d], []


def gan_data() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(24, 6, generator=g), torch.randn(24, 4, generator=g))


def fit_gan(name, devices: int, batch_size: int, clip: float | None) -> tuple[dict, int]:
    torch.manual_seed(0)
    trainer = Trainer(strategy=make_strategy(name), devices=devices, max_epochs=1, **QUIET)
    trainer.fit(GAN(clip), DataLoader(gan_data(), batch_size=batch_size))
    return trainer.strategy.full_state_dict(), trainer.global_step


def body_gan_every_strategy(clip: float | None) -> dict:
    return {name: fit_gan(name, dist.get_world_size(), 2, clip) for name in STRATEGIES}


def test_a_manually_optimized_gan_matches_one_process_under_every_strategy(rank_pool):
    """Two optimizers over disjoint parameters, toggled; clipping by norm (generator) and by value
    (discriminator) over each optimizer's own parameters; global_step counts every optimizer step."""
    want, steps = fit_gan("single", 1, 4, clip=0.5)
    assert steps == 2 * 6
    initial = GAN().state_dict()
    results = rank_pool(2).run(body_gan_every_strategy, 0.5)[0]
    for name, (got, got_steps) in results.items():
        assert got_steps == steps, name
        assert max_relative_difference(got, want) <= 1e-5, name
    assert max_relative_difference(want, initial) > 1e-3


def test_several_optimizers_need_manual_optimization():
    class TwoOptimizers(GAN):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = True

    with pytest.raises(ValueError, match="need manual optimization"):
        Trainer(devices=1, max_steps=1, **QUIET).fit(TwoOptimizers(), DataLoader(gan_data(), batch_size=4))


# ------------------------------------------------------------------ small conveniences


class Gathers(BoringModel):
    def training_step(self, batch, batch_idx):
        gathered = self.all_gather({"rank": torch.tensor([float(self.global_rank)])})
        self.gathered = gathered["rank"].flatten().tolist()
        differentiable = self.all_gather(batch.sum(dim=1).mean(), sync_grads=True)
        self.where = (str(self.device), self.global_rank, self.local_rank)
        self.print(f"rank {self.global_rank} on {self.device}, local rank {self.local_rank}")  # rank 0 only
        return self.step(batch) + 0.0 * differentiable.sum()


def body_gathers() -> tuple:
    model = Gathers()
    Trainer(devices=dist.get_world_size(), max_steps=1, limit_val_batches=0, **QUIET).fit(model)
    return model.gathered, model.where


def test_all_gather_device_and_ranks(rank_pool):
    ranks = rank_pool(2).run(body_gathers)
    assert [gathered for gathered, _ in ranks] == [[0.0, 1.0], [0.0, 1.0]]
    assert [where for _, where in ranks] == [("cpu", 0, 0), ("cpu", 1, 1)]


def body_clip_by_value(name: str) -> dict:
    torch.manual_seed(0)
    trainer = Trainer(
        strategy=make_strategy(name),
        devices=dist.get_world_size(),
        max_steps=3,
        limit_val_batches=0,
        gradient_clip_val=0.01,
        gradient_clip_algorithm="value",
        **QUIET,
    )
    trainer.fit(BoringModel(), DataLoader(RandomDataset(32, 64), batch_size=2))
    return trainer.strategy.full_state_dict()


def test_gradient_clip_algorithm_value_matches_torch_clip_grad_value(rank_pool):
    torch.manual_seed(0)
    model = BoringModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = RandomDataset(32, 64).data
    for step in range(3):
        model.step(data[step * 4 : step * 4 + 4]).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
        optimizer.step()
        optimizer.zero_grad()
    want = model.state_dict()
    for name in ("ddp", "fsdp"):
        got = rank_pool(2).run(body_clip_by_value, name)[0]
        assert max_relative_difference(got, want) <= 1e-5, name


def body_summary_and_sampler() -> tuple[str, int, int]:
    import io
    from contextlib import redirect_stdout

    from callbacks import ModelSummary

    trainer = Trainer(
        strategy="fsdp",
        devices=dist.get_world_size(),
        max_steps=1,
        limit_val_batches=0,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    out = io.StringIO()
    with redirect_stdout(out):
        trainer.fit(BoringModel(), DataLoader(RandomDataset(32, 64), batch_size=4))
    summary = next(cb for cb in trainer.callbacks if isinstance(cb, ModelSummary))
    return out.getvalue(), len(summary.table(trainer, trainer.module).splitlines()), trainer.num_training_batches


def test_model_summary_shows_bytes_per_rank_and_the_sampler_can_be_left_alone(rank_pool):
    (rank0, lines0, batches0), (rank1, _, batches1) = rank_pool(2).run(body_summary_and_sampler)
    assert "layer  Linear  66" in rank0 and "Per rank (of 2)" in rank0 and "66 trainable params" in rank0
    assert rank1 == ""  # printed on rank 0 only
    assert lines0 == 5
    assert batches0 == batches1 == 16  # use_distributed_sampler=False: each rank iterates the loader as given
