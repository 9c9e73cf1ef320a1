"""Checkpoints on real ranks and real files: the directory format, exact resume, resharding between
strategies and world sizes, `last`, corruption, the consolidate tool and checks against the model."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback, ModelCheckpoint
from strategies import FSDPStrategy, get_strategy
from tests.ranks import ROOT
from trainer import Trainer, TrainModule, seed_everything
from trainer import checkpoint as ckpt_io

VOCAB, DIM, SEQ = 11, 6, 5
SAMPLES, GLOBAL_BATCH = 24, 6  # 4 optimizer steps per epoch at any world size that divides 6
SHARDED = ("zero1", "zero2", "fsdp")


# -- model, data, trainer ----------------------------------------------------------------------------------
class TiedNet(nn.Module):
    """175 parameters (uneven over 2 and 3 ranks), a head tied to the embedding, and a buffer that counts."""

    def __init__(self, hidden: int = 7, dropout: float = 0.0, extra: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.Sequential(nn.Linear(DIM, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        if extra:
            self.gate = nn.Linear(DIM, 1)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.norm(h + self.block(h)))


class LM(TrainModule):
    def __init__(self, optimizer: str = "adam", dropout: float = 0.0, **net: object) -> None:
        super().__init__()
        self.net = TiedNet(dropout=dropout, **net)
        self.optimizer = optimizer
        self.save_hyperparameters(optimizer=optimizer)

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.net.seen.add_(1)
        return F.cross_entropy(self.net(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        if self.optimizer == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=0.01)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["note"] = f"step {self.global_step}"


def loader(world_size: int = 1) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // world_size, shuffle=True)


def make_strategy(name: str):
    return FSDPStrategy(auto_wrap_policy={nn.Sequential}) if name == "fsdp" else get_strategy(name)


def make_trainer(root: str, strategy: str, devices: int, max_steps: int, **kwargs) -> Trainer:
    options = dict(logger=False, enable_progress_bar=False, enable_checkpointing=False, deterministic=True,
                   default_root_dir=root)
    return Trainer(strategy=make_strategy(strategy), devices=devices, max_steps=max_steps, **{**options, **kwargs})


def fit(root: str, strategy: str, devices: int, max_steps: int, ckpt_path: str | None = None,
        save_to: str | None = None, module_kwargs: dict | None = None, **kwargs) -> tuple[Trainer, LM]:
    seed_everything(0)
    module = LM(**(module_kwargs or {}))
    trainer = make_trainer(root, strategy, devices, max_steps, **kwargs)
    trainer.fit(module, loader(devices), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return trainer, module


def rank_zero(trainer: Trainer, value: object) -> object:
    return value if trainer.is_global_zero else None


def optimizer_state(path: str) -> dict[str, dict[str, torch.Tensor]]:
    """Optimizer 0's state in full, keyed by parameter name, read with no process group."""
    _, ranks = ckpt_io.load_rank_files(path)
    return ckpt_io.load_full_optimizer_state(ranks, 0)[0]


def assert_states_close(a: dict, b: dict, atol: float) -> None:
    assert list(a) == list(b)
    for key in a:
        if isinstance(a[key], dict):
            assert_states_close(a[key], b[key], atol)
        else:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(autouse=True)
def _restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


# -- the format: every strategy at two ranks, read back with no process group --------------------------------
def _save_body(root: str, strategy: str) -> dict | None:
    trainer, module = fit(root, strategy, 2, max_steps=3, save_to=os.path.join(root, strategy))
    full = trainer.strategy.full_state_dict()
    keys = list(module.state_dict())
    return rank_zero(trainer, {"full": full, "keys": keys})


@pytest.fixture(scope="module")
def saved(rank_pool, tmp_path_factory) -> tuple[str, dict[str, dict]]:
    """One checkpoint per strategy, written at 2 ranks after 3 steps of Adam, and each strategy's own
    `full_state_dict()` at that moment."""
    root = str(tmp_path_factory.mktemp("saved"))
    expected = {name: rank_pool(2).run(_save_body, root, name)[0] for name in ("ddp", *SHARDED)}
    return root, expected


@pytest.mark.parametrize("strategy", ["ddp", *SHARDED])
def test_load_full_state_dict_equals_the_strategy_full_state_dict(saved, strategy):
    root, expected = saved
    path = os.path.join(root, strategy)
    assert sorted(os.listdir(path)) == ["meta.json", "rank0.pt", "rank1.pt", "trainer.pt"]
    assert not [n for n in os.listdir(root) if ".tmp-" in n or ".old-" in n]

    state = ckpt_io.load_full_state_dict(path)
    assert list(state) == expected[strategy]["keys"] == list(expected[strategy]["full"])
    assert_states_close(state, expected[strategy]["full"], atol=0)
    assert state["net.head.weight"].data_ptr() == state["net.embed.weight"].data_ptr()  # the tie survives
    assert state["net.seen"].item() == 3  # buffers too

    meta, ranks = ckpt_io.load_rank_files(path)
    assert (meta["world_size"], meta["global_step"], meta["aliases"]) == (2, 3, {"net.head.weight": "net.embed.weight"})
    params = {k: v for k, v in state.items() if k not in ("net.head.weight", "net.seen")}
    for name, tensor in params.items():
        covered = sorted((p["start"], p["end"]) for r in ranks if (p := r["model"].get(name)))
        if strategy in SHARDED:  # each file holds slices; together they cover every element exactly once
            assert covered[0][0] == 0 and covered[-1][1] == tensor.numel()
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
        else:
            assert covered == [(0, tensor.numel())] and name not in ranks[1]["model"]
    if strategy in SHARDED:
        assert all(r["model"] for r in ranks) and all(len(r["model"]) < len(state) for r in ranks)


def test_sharded_checkpoints_hold_the_same_optimizer_state_as_ddp(saved):
    root, _ = saved
    reference = optimizer_state(os.path.join(root, "ddp"))
    assert set(reference) == {"net.embed.weight", "net.block.0.weight", "net.block.0.bias", "net.block.3.weight",
                              "net.block.3.bias", "net.norm.weight", "net.norm.bias"}
    for strategy in SHARDED:
        state = optimizer_state(os.path.join(root, strategy))
        assert sorted(state) == sorted(reference)
        for name in reference:
            assert state[name]["exp_avg"].shape == reference[name]["exp_avg"].shape
            assert float(state[name]["step"]) == 3.0
        assert_states_close({k: state[k] for k in reference}, reference, atol=1e-6)


# -- the consolidate tool -------------------------------------------------------------------------------------
def test_consolidate_cli_writes_plain_files_torch_load_reads(saved, tmp_path):
    root, expected = saved
    source = os.path.join(root, "fsdp")
    env = {**os.environ, "PYTHONPATH": ROOT}
    command = [sys.executable, "-m", "trainer.checkpoint", "consolidate", source]
    jobs = [subprocess.Popen([*command, str(tmp_path / "w.pt")], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True),
            subprocess.Popen([*command, str(tmp_path / "o.pt"), "--with-optimizer"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    for job in jobs:
        out, _ = job.communicate(timeout=60)
        assert job.returncode == 0, out
    assert sorted(os.listdir(tmp_path)) == ["o.pt", "w.pt"]

    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    model_state = LM().state_dict()
    assert list(weights) == list(model_state)
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in model_state.items()}
    assert_states_close(weights, expected["fsdp"]["full"], atol=0)

    full = torch.load(tmp_path / "o.pt", weights_only=True)
    assert_states_close(full["state_dict"], weights, atol=0)
    (optimizer,) = full["optimizers"]
    assert_states_close(optimizer["state"], optimizer_state(source), atol=0)
    for name, entries in optimizer["state"].items():
        assert entries["exp_avg"].shape == entries["exp_avg_sq"].shape == model_state[name].shape
    (group,) = optimizer["param_groups"]
    assert group["lr"] == pytest.approx(0.01)
    assert sorted(set(group["param_names"])) == sorted(optimizer["state"])


# -- corruption -------------------------------------------------------------------------------------------
def test_a_corrupted_or_truncated_file_is_named_and_refused(saved, tmp_path):
    root, _ = saved
    flipped, cut = str(tmp_path / "flipped"), str(tmp_path / "cut")
    shutil.copytree(os.path.join(root, "zero2"), flipped)
    shutil.copytree(os.path.join(root, "zero2"), cut)
    with open(os.path.join(flipped, "rank1.pt"), "r+b") as f:
        f.seek(os.path.getsize(os.path.join(flipped, "rank1.pt")) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with open(os.path.join(cut, "rank0.pt"), "r+b") as f:
        f.truncate(100)

    with pytest.raises(ValueError, match=r"flipped/rank1\.pt.*corrupted"):
        ckpt_io.load_full_state_dict(flipped)
    with pytest.raises(ValueError, match=r"cut/rank0\.pt.*truncated"):
        ckpt_io.load_full_state_dict(cut)
    with pytest.raises(ValueError, match=r"flipped/rank1\.pt"):
        fit(str(tmp_path), "single", 1, max_steps=4, ckpt_path=flipped)
    with pytest.raises(ValueError, match=r"cut/rank0\.pt"):
        ckpt_io.consolidate(cut, str(tmp_path / "out.pt"))
    assert not os.path.exists(tmp_path / "out.pt")

    with open(os.path.join(cut, "trainer.pt"), "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match=r"cut/trainer\.pt"):
        ckpt_io.load_trainer_state(cut)
    os.remove(os.path.join(flipped, "meta.json"))
    with pytest.raises(ValueError, match=r"meta\.json is missing"):
        ckpt_io.load_full_state_dict(flipped)


# -- checked against the model before a resume --------------------------------------------------------------
def test_a_checkpoint_of_another_model_lists_every_difference(saved, tmp_path):
    root, _ = saved
    seed_everything(0)
    trainer = make_trainer(str(tmp_path), "single", 1, max_steps=1)
    with pytest.raises(ValueError) as error:
        trainer.fit(LM(hidden=8, extra=True), loader(), ckpt_path=os.path.join(root, "fsdp"))
    message = str(error.value)
    print(message)


# -- exact resume: same strategy and world size ---------------------------------------------------------------
class Snapshot(Callback):
    """What the trainer holds when training (re)starts, after a checkpoint was loaded."""

    def on_train_start(self, trainer, module) -> None:
        optimizer = trainer.optimizers[0]
        self.start = {
            "weights": trainer.strategy.full_state_dict(),
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "batches_done": trainer.state.batches_done_in_epoch,
            "lr": optimizer.param_groups[0]["lr"],
            "scheduler_epoch": trainer.lr_scheduler_configs[0]["scheduler"].last_epoch,
            "adam_steps": sorted({float(s["step"]) for s in optimizer.state.values()}),
        }


def _resume_body(root: str, strategy: str, devices: int, stop: int, total: int) -> dict | None:
    root = os.path.join(root, f"{strategy}-{stop}")
    args = dict(module_kwargs={"dropout": 0.2})
    straight, _ = fit(os.path.join(root, "a"), strategy, devices, total, **args)
    final = straight.strategy.full_state_dict()
    path = os.path.join(root, "ckpt")
    first, _ = fit(os.path.join(root, "b"), strategy, devices, stop, save_to=path, **args)
    saved = first.strategy.full_state_dict()
    snapshot = Snapshot()
    resumed, module = fit(os.path.join(root, "c"), strategy, devices, total, ckpt_path=path,
                          callbacks=[snapshot], **args)
    return rank_zero(resumed, {"final": final, "saved": saved, "start": snapshot.start, "path": path,
                               "resumed": resumed.strategy.full_state_dict(), "step": resumed.global_step,
                               "epoch": resumed.current_epoch, "module_extra": module.hparams})


@pytest.mark.parametrize("strategy, devices, stop", [
    ("single", 1, 6),  # mid-epoch (4 steps per epoch)
    ("ddp", 2, 4),  # at an epoch boundary
    ("ddp", 2, 6),
    ("zero2", 2, 5),
    ("fsdp", 2, 6),
])
def test_a_resumed_run_ends_exactly_where_the_uninterrupted_run_ends(rank_pool, tmp_path, strategy, devices, stop):
    total = 10
    args = (str(tmp_path), strategy, devices, stop, total)
    result = _resume_body(*args) if devices == 1 else rank_pool(devices).run(_resume_body, *args)[0]

    start = result["start"]
    assert_states_close(start["weights"], result["saved"], atol=0)
    assert (start["global_step"], start["epoch"], start["batches_done"]) == (stop, stop // 4, stop % 4)
    assert start["scheduler_epoch"] == stop // 4 and start["lr"] == pytest.approx(0.01 * 0.5 ** (stop // 4))
    assert start["adam_steps"] == [float(stop)]
    assert ckpt_io.load_trainer_state(result["path"])["module_extra"] == {"note": f"step {stop}"}
    assert (result["step"], result["epoch"]) == (total, total // 4)
    assert_states_close(result["resumed"], result["final"], atol=0)
