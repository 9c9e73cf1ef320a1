"""Lightning's own demo modules (`lightning.pytorch.demos`), their source read from the installed package with only
the import of LightningModule / LightningDataModule pointed at this project, train here under ddp and fsdp, and
end where Lightning's own Trainer ends."""

from __future__ import annotations

import importlib.util
import re
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests.test_parity import max_relative_difference
from trainer import Trainer

pytest.importorskip("lightning")

QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
OUR_IMPORTS = {
    r"from lightning\.pytorch import LightningDataModule, LightningModule": (
        "from trainer import DataModule as LightningDataModule, TrainModule as LightningModule"
    ),
    r"from lightning\.pytorch import LightningModule": "from trainer import TrainModule as LightningModule",
}


def demo(name: str) -> types.ModuleType:
    """lightning/pytorch/demos/<name>.py with its import of Lightning's module classes replaced by ours."""
    key = f"ported_lightning_demo_{name}"
    if key not in sys.modules:
        source = Path(importlib.util.find_spec(f"lightning.pytorch.demos.{name}").origin).read_text()
        replaced = 0
        for pattern, ours in OUR_IMPORTS.items():
            source, n = re.subn(f"^{pattern}$", ours, source, flags=re.MULTILINE)
            replaced += n
        assert replaced == 1, f"the import of {name}.py changed in this Lightning release"
        module = types.ModuleType(key)
        exec(compile(source, f"<{name}.py, imports ported>", "exec"), module.__dict__)
        assert "LightningModule" not in vars(module) or vars(module)["LightningModule"].__module__ == "trainer.module"
        sys.modules[key] = module
    return sys.modules[key]


def write_wikitext(folder: Path) -> Path:
    """A small file in WikiText2's format (lines of words), which its loader tokenizes; nothing is downloaded."""
    words = "the of and to in a is that for it as was with be by on not he this are or his from at which".split()
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(words[i] for i in torch.randint(0, len(words), (12,), generator=g)) for _ in range(60)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "wikitext-2.txt").write_text("\n".join(lines) + "\n")
    return folder


def body_every_demo(strategy: str, data_dir: str) -> dict:
    boring, transformer = demo("boring_classes"), demo("transformer")
    results = {}

    def trainer(**kwargs) -> Trainer:
        return Trainer(strategy=strategy, devices=dist.get_world_size(), max_epochs=1, **QUIET, **kwargs)

    torch.manual_seed(0)
    model, t = boring.BoringModel(), trainer(limit_train_batches=8, limit_val_batches=2)
    t.fit(model)  # its own train/val dataloaders; ([optimizer], [StepLR])
    t.validate(model)
    t.test(model)
    predictions = t.predict(model)
    results["BoringModel"] = (
        t.global_step,
        t.strategy.full_state_dict(),
        None if predictions is None else len(predictions),
    )

    torch.manual_seed(0)
    model, t = boring.BoringModel(), trainer(max_steps=6)
    t.fit(model, datamodule=boring.BoringDataModule())
    results["BoringDataModule"] = (t.global_step, t.strategy.full_state_dict())

    torch.manual_seed(0)
    model, t = boring.ManualOptimBoringModel(), trainer(max_steps=6)
    t.fit(model)
    results["ManualOptimBoringModel"] = (t.global_step, t.strategy.full_state_dict())

    torch.manual_seed(0)
    model, t = boring.DemoModel(), trainer(max_steps=6)
    t.fit(model, DataLoader(boring.RandomDataset(32, 64), batch_size=4))
    results["DemoModel"] = (t.global_step, t.strategy.full_state_dict())

    torch.manual_seed(0)
    data = transformer.WikiText2(Path(data_dir), block_size=16, download=False)
    model, t = transformer.LightningTransformer(vocab_size=data.vocab_size), trainer(max_steps=3)
    model.prepare_data = lambda: None  # its prepare_data downloads WikiText2; the file is here already
    t.fit(model, DataLoader(data, batch_size=2))  # as its train_dataloader does, with a batch of 2
    results["LightningTransformer"] = (t.global_step, t.strategy.full_state_dict())
    return results


def test_lightnings_demo_modules_run_under_ddp_and_fsdp_with_only_imports_changed(rank_pool, tmp_path):
    data_dir = str(write_wikitext(tmp_path / "data"))
    pool = rank_pool(2)
    ddp, fsdp = pool.run(body_every_demo, "ddp", data_dir), pool.run(body_every_demo, "fsdp", data_dir)
    assert ddp[0]["BoringModel"][2] == 64 and ddp[1]["BoringModel"][2] is None  # one per sample, on rank 0
    expected_steps = {
        "BoringModel": 8,
        "BoringDataModule": 6,
        "ManualOptimBoringModel": 6,
        "DemoModel": 6,
        "LightningTransformer": 3,
    }
    for name, steps in expected_steps.items():
        assert ddp[0][name][0] == fsdp[0][name][0] == steps, name
        assert max_relative_difference(fsdp[0][name][1], ddp[0][name][1]) <= 1e-5, name
    torch.manual_seed(0)
    untrained = demo("boring_classes").BoringModel().state_dict()
    assert max_relative_difference(ddp[0]["BoringModel"][1], untrained) > 1e-3  # it did train


def test_the_boring_model_ends_where_lightnings_own_trainer_ends():
    """One process each, the same seed and batches: Lightning's Trainer and ours give the same weights."""
    import lightning.pytorch as pl

    boring = demo("boring_classes")
    from lightning.pytorch.demos.boring_classes import BoringModel as LightningsBoringModel

    def loader() -> DataLoader:
        torch.manual_seed(1)
        return DataLoader(boring.RandomDataset(32, 64), batch_size=4)

    torch.manual_seed(0)
    theirs = LightningsBoringModel()
    pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(theirs, loader())
    torch.manual_seed(0)
    ours = boring.BoringModel()
    Trainer(devices=1, max_epochs=2, limit_val_batches=0, **QUIET).fit(ours, loader())
    assert max_relative_difference(ours.state_dict(), theirs.state_dict()) <= 1e-6
    torch.manual_seed(0)
    assert max_relative_difference(ours.state_dict(), boring.BoringModel().state_dict()) > 1e-3


# ------------------------------------------------------------------ the order of the hooks, recorded with Lightning

RECORDED_HOOKS = (
    "prepare_data",
    "setup",
    "configure_model",
    "configure_optimizers",
    "on_fit_start",
    "val_dataloader",
    "train_dataloader",
    "on_train_start",
    "on_train_epoch_start",
    "on_validation_start",
    "on_validation_epoch_start",
    "on_validation_epoch_end",
    "on_validation_end",
    "on_train_epoch_end",
    "on_train_end",
    "on_fit_end",
    "teardown",
)


def recording(module_class: type) -> tuple[type, list[str]]:
    """A subclass of `module_class` that notes each hook of RECORDED_HOOKS it runs, and the list it notes in."""
    calls: list[str] = []

    def noting(name: str):
        def hook(self, *args, **kwargs):
            calls.append(name)
            return getattr(super(recorded, self), name)(*args, **kwargs)

        return hook

    recorded = type(f"Recording{module_class.__name__}", (module_class,), {n: noting(n) for n in RECORDED_HOOKS})
    return recorded, calls


@pytest.mark.parametrize("sanity_steps", [2, 0])
def test_the_hooks_run_in_lightnings_order_and_the_demos_end_with_lightnings_weights(sanity_steps):
    """One process each, Lightning's Trainer and ours, the module's own loaders (BoringModel's draw RandomDataset
    from the global random generator): the same hooks in the same order, and the same weights under one seed."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos import boring_classes as theirs

    ours = demo("boring_classes")
    arguments = {
        "max_epochs": 2,
        "limit_train_batches": 3,
        "limit_val_batches": 2,
        "num_sanity_val_steps": sanity_steps,
    }
    for name in ("BoringModel", "ManualOptimBoringModel"):
        lightnings_class, lightnings_calls = recording(getattr(theirs, name))
        torch.manual_seed(0)
        lightnings = lightnings_class()
        pl.Trainer(accelerator="cpu", devices=1, **arguments, **QUIET).fit(lightnings)
        our_class, our_calls = recording(getattr(ours, name))
        torch.manual_seed(0)
        our_module = our_class()
        Trainer(devices=1, **arguments, **QUIET).fit(our_module)
        assert our_calls == lightnings_calls, name
        assert max_relative_difference(our_module.state_dict(), lightnings.state_dict()) <= 1e-6, name


# ------------------------------------------------------------------ two ranks: the seed as Lightning's ddp resets it


def shuffled_training(module_class: type) -> type:
    """`module_class` whose own `train_dataloader` shuffles: Lightning shuffles every training loader it gives a
    DistributedSampler, where ours keeps the loader's setting (docs/lightning.md, differences kept on purpose)."""

    def train_dataloader(self):
        loader = module_class.train_dataloader(self)  # its data drawn from the global generator, as it is
        return DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=True)

    return type(f"Shuffled{module_class.__name__}", (module_class,), {"train_dataloader": train_dataloader})


def body_boring_on_two_ranks(name: str, ours: bool, strategy: str) -> dict:
    """Lightning's demo `name`, its training loader shuffled, on this pool's 2 ranks under our Trainer (`ours`) or
    Lightning's own (ddp, its default sanity check): rank 0's weights."""
    import lightning.pytorch as pl
    from lightning.pytorch.demos import boring_classes as theirs

    arguments = {"max_epochs": 2, "limit_train_batches": 4, "limit_val_batches": 2, **QUIET}
    if ours:
        from trainer import seed_everything

        seed_everything(7)
        module = shuffled_training(getattr(demo("boring_classes"), name))()
        trainer = Trainer(strategy=strategy, devices=2, **arguments)
        trainer.fit(module)
        return trainer.strategy.full_state_dict()
    pl.seed_everything(7, verbose=False)
    module = shuffled_training(getattr(theirs, name))()
    pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, **arguments).fit(module)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_boring_models_end_with_lightnings_weights_on_two_ranks(rank_pool, strategy):
    """Lightning's ddp seeds every rank again from `seed_everything`'s seed when it sets up the process group, before
    the module's hooks build their loaders (BoringModel draws its data from the global generator in them, after the
    module drew its weights): ours does too, so the data and the weights are Lightning's."""
    pool = rank_pool(2)
    for name in ("BoringModel", "ManualOptimBoringModel"):
        lightnings = pool.run(body_boring_on_two_ranks, name, False, "ddp")[0]
        ours = pool.run(body_boring_on_two_ranks, name, True, strategy)[0]
        assert max_relative_difference(ours, lightnings) <= 1e-6, name
