"""Loading a checkpoint never runs code from it (issue 29). A pickle planted to run `touch MARKER` when unpickled
goes into each format (a one-file checkpoint, a DCP object item, DCP's `.metadata` with a matching integrity
record) and is given to each entry point; no code runs and the error names the type, where it is and how to opt
in. With `trust_pickled=True` (`--trust-pickled`) a trusted file loads. What the project writes (callback states,
hyperparameters, on_save_checkpoint contents of plain types, RNG and loader state) loads without the opt-in."""

from __future__ import annotations

import json
import os
import pathlib
import warnings
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from callbacks import EMA, EarlyStopping, ModelCheckpoint
from strategies import get_strategy
from strategies.checkpoint import format as ckpt_format
from tests.test_checkpoint import LM, fit, keeps_determinism_setting, loader, make_trainer
from trainer import DataModule, seed_everything
from trainer import checkpoint as ckpt_io

OPT_IN = r"trust_pickled=True"


class Planted:
    """Unpickling it runs `touch <marker>` (what a crafted checkpoint does)."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture
def marker(tmp_path) -> pathlib.Path:
    return tmp_path / "MARKER"


def refused(what: str = r"posix\.system") -> pytest.RaisesContext:
    return pytest.raises(ckpt_io.CheckpointError, match=rf"(?s){what}.*nothing was loaded.*{OPT_IN}")


def weights() -> dict[str, torch.Tensor]:
    return LM().state_dict()


# -- a one-file checkpoint ------------------------------------------------------------------------------------
def test_a_one_file_checkpoint_with_a_planted_pickle_runs_nothing_at_any_entry_point(tmp_path, marker, capsys):
    planted, whole = str(tmp_path / "planted.pt"), str(tmp_path / "whole.pt")
    torch.save({"model": weights(), "trainer": {"state": Planted(marker)}}, planted)
    torch.save(Planted(marker), whole)  # the case: the whole file is the planted object
    named = rf"checkpoint file '{planted}'.*posix\.system"

    for path in (planted, whole):
        with refused():
            ckpt_io.load_full_state_dict(path)
    with refused(named):
        ckpt_io.load_checkpoint(planted)
    with refused(named):
        ckpt_io.load_trainer_state(planted)
    with refused(named):
        ckpt_io.consolidate(planted, str(tmp_path / "out.pt"))
    with refused(named):
        ckpt_io.export_safetensors(planted, str(tmp_path / "st"))
    with refused(named):
        LM.load_from_checkpoint(planted)
    with refused(named):
        fit(str(tmp_path), "single", 1, max_steps=1, ckpt_path=planted)
    with refused(named):
        make_trainer(str(tmp_path), "single", 1, max_steps=1).validate(Plain(), loader(), ckpt_path=planted)
    for command in (
        ["export", planted, str(tmp_path / "st"), "--format", "safetensors"],
        ["consolidate", planted, str(tmp_path / "out.pt")],
    ):
        with pytest.raises(SystemExit) as exited:
            ckpt_io.main(command)
        assert exited.value.code == 2
        error = capsys.readouterr().err
        assert "posix.system" in error and "--trust-pickled" in error and "Traceback" not in error
    assert not marker.exists()
    assert not os.path.exists(tmp_path / "out.pt") and not os.path.exists(tmp_path / "st" / "model.safetensors")

    assert ckpt_io.load_checkpoint(planted, trust_pickled=True)["trainer"]["state"] == 0  # os.system's status
    assert marker.exists()


def test_the_command_line_reads_a_trusted_file_with_trust_pickled(tmp_path, marker):
    planted = str(tmp_path / "planted.pt")
    torch.save({"model": weights(), "trainer": {"state": Planted(marker)}}, planted)
    ckpt_io.main(["export", planted, str(tmp_path / "st"), "--trust-pickled"])
    assert marker.exists() and os.path.exists(tmp_path / "st" / "model.safetensors")


# -- a DCP checkpoint: an object item written by a real run ---------------------------------------------------
class Smuggler(LM):
    """A module whose on_save_checkpoint puts an object of another type into the checkpoint."""

    marker: pathlib.Path | None = None

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["thing"] = Planted(self.marker)


def test_an_object_item_outside_the_allow_list_is_refused_on_resume(tmp_path, marker):
    Smuggler.marker = marker
    path = str(tmp_path / "ckpt")
    seed_everything(0)
    trainer = make_trainer(str(tmp_path), "single", 1, max_steps=2)
    trainer.fit(Smuggler(), loader())
    with pytest.warns(UserWarning, match=r"(?s)'trainer'.*posix\.system.*module_extra.*thing.*trust_pickled=True"):
        trainer.save_checkpoint(path)
    assert not marker.exists()  # writing it runs nothing either

    item = rf"checkpoint '{path}' \(item 'trainer' in __0_0\.distcp\).*posix\.system"
    with refused(item):
        fit(str(tmp_path / "resume"), "single", 1, max_steps=4, ckpt_path=path)
    with refused(item):
        ckpt_io.load_trainer_state(path)
    with refused(item):
        ckpt_io.load_checkpoint(path)
    with refused(item):
        ckpt_io.consolidate(path, str(tmp_path / "out.pt"), with_optimizer=True)
    assert not marker.exists()
    # What reads no object but the checkpoint's own description loads as before: the planted item is never read.
    assert set(ckpt_io.load_full_state_dict(path)) == set(weights())
    ckpt_io.consolidate(path, str(tmp_path / "weights.pt"))
    assert not marker.exists()

    trainer = make_trainer(str(tmp_path / "trusted"), "single", 1, max_steps=4)
    trainer.fit(LM(), loader(), ckpt_path=path, trust_pickled=True)
    assert trainer.global_step == 4 and marker.exists()


@keeps_determinism_setting
def _resume_body(root: str) -> str | None:
    Smuggler.marker = pathlib.Path(root) / "MARKER"
    path = os.path.join(root, "ckpt")
    seed_everything(0)
    trainer = make_trainer(root, "fsdp", 2, max_steps=2)
    trainer.fit(Smuggler(), loader(2))
    trainer.save_checkpoint(path)
    try:
        fit(os.path.join(root, "resume"), "zero2", 2, max_steps=4, ckpt_path=path)
    except ckpt_io.CheckpointError as error:
        return str(error)
    return None


def test_every_rank_refuses_the_planted_item_of_a_sharded_run(rank_pool, tmp_path, marker):
    errors = rank_pool(2).run(_resume_body, str(tmp_path))
    assert all(
        error is not None and "item 'trainer' in __0_0.distcp" in error and "posix.system" in error for error in errors
    ), errors
    assert not marker.exists()


def test_strategy_load_refuses_a_planted_entry_and_loads_it_when_trusted(tmp_path, marker):
    strategy = get_strategy("single")
    model = strategy.setup_module(nn.Linear(3, 2))
    path = str(tmp_path / "ckpt")
    with pytest.warns(UserWarning, match=r"'extra'.*posix\.system"):
        strategy.save(path, {"model": model, "step": 3, "extra": Planted(marker)})
    with refused(r"item 'extra' in __0_0\.distcp.*posix\.system"):
        strategy.load(path, {"model": model, "step": 0, "extra": None})
    assert not marker.exists()
    assert strategy.load(path, {"model": model, "step": 0, "extra": None}, trust_pickled=True)["step"] == 3
    assert marker.exists()


def test_saving_warns_once_for_the_same_item_and_types(tmp_path, marker):
    strategy = get_strategy("single")
    model = strategy.setup_module(nn.Linear(3, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(2):
            strategy.save(str(tmp_path / f"c{i}"), {"model": model, "once": Planted(marker)})
    assert [str(w.message).count("posix.system") for w in caught if "'once'" in str(w.message)] == [1]


# -- DCP's .metadata -----------------------------------------------------------------------------------------
def _plant_metadata(path: str, marker: pathlib.Path) -> None:
    """Replace `.metadata` with the planted pickle and record its size and checksum in meta.json, as whoever
    crafts a checkpoint can."""
    import pickle

    metadata = os.path.join(path, ckpt_format.DCP_METADATA)
    with open(metadata, "wb") as f:
        pickle.dump(Planted(marker), f)
    with open(os.path.join(path, ckpt_format.META_FILE)) as f:
        meta = json.load(f)
    meta.pop("checksum")
    meta["files"][ckpt_format.DCP_METADATA] = ckpt_format.file_integrity(
        path, ckpt_format.DCP_METADATA, [(0, os.path.getsize(metadata))]
    )
    ckpt_format.write_meta(path, meta)


def test_a_planted_metadata_file_with_a_matching_integrity_record_runs_nothing(tmp_path, marker, capsys):
    path = str(tmp_path / "ckpt")
    fit(str(tmp_path), "single", 1, max_steps=1, save_to=path)
    _plant_metadata(path, marker)
    named = rf"checkpoint file '{path}/\.metadata'.*posix\.system"

    with refused(named):
        ckpt_io.load_full_state_dict(path)
    with refused(named):
        ckpt_io.load_trainer_state(path)
    with refused(named):
        fit(str(tmp_path / "resume"), "single", 1, max_steps=2, ckpt_path=path)
    strategy = get_strategy("single")
    with refused(named):
        strategy.load(path, {"model": strategy.setup_module(nn.Linear(3, 2))})
    with pytest.raises(SystemExit):
        ckpt_io.main(["export", path, str(tmp_path / "st")])
    assert "posix.system" in capsys.readouterr().err
    assert not marker.exists()

    with pytest.raises(ckpt_io.CheckpointError, match=r"not DCP's metadata"):
        ckpt_io.load_full_state_dict(path, trust_pickled=True)  # trusted: unpickled (and then found wrong)
    assert marker.exists()


# -- what the project writes loads without the opt-in -----------------------------------------------------------
class Loaders(DataModule):
    """A datamodule whose state is what a resumable loader keeps: plain dicts, lists, ints and tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.position = {"epoch": 0, "per_rank": [{"seen": 0, "order": torch.arange(4)}]}

    def train_dataloader(self) -> DataLoader:
        return loader()

    def val_dataloader(self) -> DataLoader:
        return loader()

    def state_dict(self) -> dict:
        return self.position

    def load_state_dict(self, state: dict) -> None:
        self.position = state


class Plain(LM):
    """Hyperparameters and on_save_checkpoint contents of the types a run keeps."""

    def __init__(
        self,
        lr: float = 0.01,
        layers: tuple = (2, 3),
        root: pathlib.Path = pathlib.Path("/data"),
        schedule: dict | None = None,
        optimizer: str = "adam",
    ) -> None:
        super().__init__(optimizer)
        self.save_hyperparameters()

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.training_step(batch, batch_idx))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["counts"] = OrderedDict(steps=torch.tensor(self.global_step), seen=[1, 2.5, "x", None, (3, 4)])
        checkpoint["dtype"], checkpoint["flags"] = torch.bfloat16, {True, False}
        checkpoint["hparams"] = self.hparams  # the project's own AttributeDict


def test_what_the_project_writes_loads_without_the_opt_in(tmp_path):
    callbacks = [
        ModelCheckpoint(dirpath=str(tmp_path / "ckpts"), monitor="val/loss", save_last=True),
        EarlyStopping(monitor="val/loss", patience=5),
        EMA(decay=0.9),
    ]
    seed_everything(0)
    trainer = make_trainer(
        str(tmp_path),
        "single",
        1,
        max_steps=4,
        callbacks=callbacks,
        enable_checkpointing=True,
        limit_val_batches=1,
        val_check_interval=2,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*trust_pickled")  # no such warning while saving
        trainer.fit(Plain(schedule={"warmup": [1, 2]}), datamodule=Loaders())
        trainer.save_checkpoint(tmp_path / "full.pt", full=True)
    last = ckpt_io.find_last(str(tmp_path / "ckpts"))
    for path in (last, str(tmp_path / "full.pt")):
        state = ckpt_io.load_trainer_state(path)
        assert state["hparams"] == {
            "lr": 0.01,
            "layers": (2, 3),
            "root": pathlib.Path("/data"),
            "schedule": {"warmup": [1, 2]},
            "optimizer": "adam",
        }
        assert state["module_extra"]["dtype"] is torch.bfloat16 and state["datamodule"]["epoch"] == 0
        assert state["module_extra"]["hparams"]["lr"] == 0.01
        assert {key.split("{")[0] for key in state["callbacks"]} >= {"EMA", "EarlyStopping", "ModelCheckpoint"}
        assert ckpt_io.load_checkpoint(path)["rng"]
        ckpt_io.load_full_state_dict(path, ema=True)
    resumed = make_trainer(
        str(tmp_path / "again"), "single", 1, max_steps=6, callbacks=[EMA(decay=0.9)], limit_val_batches=1
    )
    resumed.fit(Plain(), datamodule=Loaders(), ckpt_path=last)
    assert resumed.global_step == 6
    Plain.load_from_checkpoint(last)


class Registered:
    def __init__(self, value: int) -> None:
        self.value = value


def test_a_type_registered_with_torch_add_safe_globals_loads_without_the_opt_in(tmp_path):
    strategy = get_strategy("single")
    model = strategy.setup_module(nn.Linear(3, 2))
    before = torch.serialization.get_safe_globals()
    torch.serialization.add_safe_globals([Registered])
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*trust_pickled")  # registered: saving does not warn either
            strategy.save(str(tmp_path / "c"), {"model": model, "config": Registered(7)})
        assert strategy.load(str(tmp_path / "c"), {"model": model, "config": None})["config"].value == 7
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)


def test_a_damaged_pickle_is_still_named_as_damaged(tmp_path):
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    with pytest.raises(ckpt_io.CheckpointError, match=r"cannot be read \(truncated or not a checkpoint\)"):
        ckpt_io.load_full_state_dict(garbage)
