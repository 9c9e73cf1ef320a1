"""A run that continues on another number of ranks is the same experiment: `global_batch_size` keeps the samples
per optimizer step, and a mid-epoch checkpoint resumed on 2, 3 or 4 ranks trains each remaining sample of the
epoch once, in the uninterrupted run's order, ending with its weights."""

from __future__ import annotations

import os
import signal
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import ModelCheckpoint
from strategies import get_strategy
from tests.ranks import ROOT
from tests.scripts import elastic_train
from tests.test_launcher import Job, _free_port
from tests.test_parity import max_relative_difference
from trainer import Trainer, TrainModule, seed_everything

ELASTIC_SCRIPT = os.path.join(ROOT, "tests", "scripts", "elastic_train.py")
SAMPLES, FEATURES, BATCH, GLOBAL = 48, 6, 2, 24  # two optimizer steps an epoch at any of 2, 3, 4 ranks
STEPS = 4  # two epochs; the checkpoint of step 1 is in the middle of the first


class Recorded(TrainModule):
    """Linear regression that notes the samples it trains (by index), with AdamW."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, 1))
        self.trained: list[int] = []

    def training_step(self, batch, batch_idx):
        x, y, index = batch
        self.trained += index.tolist()
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.05)


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(SAMPLES, FEATURES, generator=g), torch.randn(SAMPLES, 1, generator=g), torch.arange(SAMPLES)
    )


class Augmented(TensorDataset):
    """`dataset()` with noise drawn from torch's generator at every load (in DataLoader workers)."""

    def __init__(self) -> None:
        super().__init__(*dataset().tensors)

    def __getitem__(self, index):
        x, y, i = super().__getitem__(index)
        return x + 0.3 * torch.randn(FEATURES), y, i


def body_fit(root: str, strategy: str, ckpt_path: str | None = None, workers: int = 0, **trainer_kwargs) -> dict:
    """One run on this pool's ranks: the weights, every rank's trained samples by epoch, the warnings."""
    seed_everything(0)
    module = Recorded()
    callbacks = [
        ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    ]
    trainer_kwargs.setdefault("global_batch_size", GLOBAL)
    trainer = Trainer(
        strategy=get_strategy(strategy),
        devices=dist.get_world_size(),
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
        **trainer_kwargs,
    )
    # with workers, random augmentation: each sample is loaded with a random state of its own, at any world size
    loader = DataLoader(Augmented() if workers else dataset(), batch_size=BATCH, shuffle=True, num_workers=workers)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, loader, ckpt_path=ckpt_path)
    return {
        "weights": trainer.strategy.full_state_dict(),
        "trained": _gathered(module.trained),
        "accumulate": trainer.accumulate_grad_batches,
        "warnings": [str(w.message) for w in caught],
    }


def _gathered(items: list[int]) -> list[list[int]]:
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, items)
    return out


@pytest.mark.parametrize(
    "strategy, before, after, workers",
    [
        ("ddp", 4, 2, 0),
        ("fsdp", 2, 4, 2),  # with DataLoader workers and random augmentation
        ("zero2", 4, 3, 0),
    ],
)
def test_a_mid_epoch_checkpoint_resumed_on_another_number_of_ranks_is_the_same_run(
    rank_pool, tmp_path, strategy, before, after, workers
):
    straight = rank_pool(before).run(body_fit, str(tmp_path / "straight"), strategy, workers=workers)[0]
    checkpoint = str(tmp_path / "straight" / "ckpt" / "step=1")
    resumed = rank_pool(after).run(body_fit, str(tmp_path / "resumed"), strategy, checkpoint, workers=workers)[0]
    assert straight["accumulate"] == GLOBAL // (BATCH * before) and resumed["accumulate"] == GLOBAL // (BATCH * after)
    # the first epoch: the checkpoint's step, then the resumed run's first step: each sample once
    trained_before = [i for rank in straight["trained"] for i in rank[: GLOBAL // before]]
    per_rank_rest = (SAMPLES - GLOBAL) // after
    trained_after = [i for rank in resumed["trained"] for i in rank[:per_rank_rest]]
    assert Counter(trained_before + trained_after) == {i: 1 for i in range(SAMPLES)}
    # the second epoch: every sample once again, over all ranks
    assert Counter(i for rank in resumed["trained"] for i in rank[per_rank_rest:]) == {i: 1 for i in range(SAMPLES)}
    assert max_relative_difference(resumed["weights"], straight["weights"]) <= 1e-5
    assert not [w for w in resumed["warnings"] if "global batch" in w or "train again" in w], resumed["warnings"]


def test_without_a_global_batch_size_a_resume_on_fewer_ranks_warns_with_both_sizes(rank_pool, tmp_path):
    rank_pool(4).run(body_fit, str(tmp_path / "four"), "ddp", global_batch_size=None)
    checkpoint = str(tmp_path / "four" / "ckpt" / "step=2")
    resumed = rank_pool(2).run(body_fit, str(tmp_path / "two"), "ddp", checkpoint, global_batch_size=None)[0]
    said = [w for w in resumed["warnings"] if "global batches of 8 samples" in w]
    assert len(said) == 1 and "this run on 4" in said[0] and "global_batch_size=8" in said[0], resumed["warnings"]


def test_a_global_batch_size_that_does_not_divide_names_the_three_numbers(tmp_path):
    trainer = Trainer(
        devices=1,
        global_batch_size=5,
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    with pytest.raises(
        ValueError,
        match=r"global_batch_size=5 does not divide into batches of 2 .* on 1 "
        r"data-parallel rank: it must be a multiple of 2 x 1 = 2",
    ):
        trainer.fit(Recorded(), DataLoader(dataset(), batch_size=2))
    with pytest.raises(ValueError, match="global_batch_size=8 and accumulate_grad_batches=2"):
        Trainer(devices=1, global_batch_size=8, accumulate_grad_batches=2)


def test_a_global_batch_size_on_one_rank_accumulates_as_the_same_run_on_more(tmp_path):
    seed_everything(0)
    trainer = Trainer(
        devices=1,
        global_batch_size=GLOBAL,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    module = Recorded()
    trainer.fit(module, DataLoader(dataset(), batch_size=BATCH, shuffle=True))
    assert trainer.accumulate_grad_batches == GLOBAL // BATCH and len(module.trained) == 2 * GLOBAL


# ------------------------------------------------------------------ torchrun --nnodes 1:2: lose a node, continue

LOSSES = {  # the fault of each strategy's run: after step 3, or in the save of step 4 (step 2 is then resumed)
    "ddp": ("--lose-node-after", "3"),
    "zero2": ("--lose-node-after", "3"),
    "fsdp": ("--lose-node-in-save", "4"),
    "hsdp": ("--lose-node-after", "3"),
}


@pytest.fixture(scope="module")
def elastic_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[Job]]]:
    """Per strategy, two torchrun agents of 2 ranks each (two "nodes") in one elastic job (`--nnodes 1:2`), all
    started at once; the second agent is lost mid-epoch, and the first continues alone."""
    runs = {}
    for strategy, loss in LOSSES.items():
        run = tmp_path_factory.mktemp(f"elastic-{strategy}")
        (run / "root").mkdir()
        port = _free_port()
        agents = []
        for node, extra in enumerate([(), loss]):
            argv = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "1:2",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{port}",
                "--rdzv-id",
                strategy,
                "--rdzv-conf",
                f"is_host={int(node == 0)},last_call_timeout=15",
                ELASTIC_SCRIPT,
                "--root",
                str(run / "root"),
                "--strategy",
                strategy,
                *extra,
            ]
            agents.append(Job(argv, run / f"agent{node}"))
        runs[strategy] = (run / "root", agents)
    yield runs
    for _, agents in runs.values():
        for agent in agents:
            agent.kill()


def _uninterrupted_elastic_body(root: str, strategy: str) -> None:
    elastic_train.train(root, strategy)


def _lineage(root: Path) -> tuple[list[tuple[int, int, str]], list[int]]:
    """(world size, global step, checkpoint) per start, and the samples of every batch the final weights learned
    from: those of the first attempt before the step the second resumed from, then the second attempt's."""
    starts = [
        (int(ws), int(step), ckpt)
        for ws, step, ckpt in (line.split() for line in (root / "starts.log").read_text().splitlines())
    ]
    resumed_at = starts[-1][1]
    batches = [line.split() for f in root.glob("trained-*") for line in f.read_text().splitlines()]
    kept = [b for b in batches if (int(b[0]) == 0 and int(b[1]) < resumed_at) or (int(b[0]) > 0)]
    return starts, [(int(step), int(sample)) for _, step, *samples in kept for sample in samples]


@pytest.mark.parametrize("strategy", list(LOSSES))
def test_torchrun_loses_a_node_and_the_run_ends_on_the_other_as_if_uninterrupted(
    elastic_runs, rank_pool, tmp_path, strategy
):
    root, agents = elastic_runs[strategy]
    survivor, lost = agents[0].result(timeout=400), agents[1].result(timeout=400)
    assert survivor[0] == 0, survivor[2][-5000:]
    assert lost[0] == -signal.SIGKILL or lost[0] == 128 + signal.SIGKILL, lost
    starts, trained = _lineage(root)
    # from the checkpoint of step 2, the last complete one (the save of step 4 lost under fsdp left none)
    assert starts == [(4, 0, "None"), (2, 2, "epoch=0-step=2")], starts
    per_epoch = elastic_train.SAMPLES // elastic_train.GLOBAL_BATCH
    for epoch in range(elastic_train.STEPS // per_epoch):  # every sample trained once an epoch, none lost or twice
        learned = Counter(s for step, s in trained if step // per_epoch == epoch)
        assert learned == {i: 1 for i in range(elastic_train.SAMPLES)}, (epoch, learned)
    rank_pool(4).run(_uninterrupted_elastic_body, str(tmp_path), strategy)
    straight = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    final = torch.load(root / "final.pt", weights_only=True)
    assert final["meta"]["world_size"] == 2 and final["trainer"]["state"]["global_step"] == elastic_train.STEPS
    assert max_relative_difference(final["model"], straight) <= 1e-5


# ------------------------------------------------------------------ rough edges of a resume


class Scheduled(Recorded):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def test_a_resume_from_an_epochs_last_batch_steps_the_scheduler_without_torchs_warning(tmp_path):
    """The checkpoint of an epoch's last step is saved before the epoch's scheduler step; the resumed run takes
    that step first, before any optimizer step of its own process, which torch took for a misuse."""

    def fit(max_epochs: int, ckpt_path: str | None = None) -> tuple[Trainer, list[str]]:
        seed_everything(0)
        saver = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=6, save_top_k=-1, filename="{step}")
        trainer = Trainer(
            devices=1,
            max_epochs=max_epochs,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[saver],
            default_root_dir=str(tmp_path),
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(Scheduled(), DataLoader(dataset(), batch_size=8), ckpt_path=ckpt_path)
        return trainer, [str(w.message) for w in caught]

    straight, _ = fit(2)
    resumed, said = fit(2, str(tmp_path / "ckpt" / "step=6"))  # 6 batches an epoch: the first epoch's last
    assert not [w for w in said if "lr_scheduler.step()" in w], said
    assert resumed.lr_scheduler_configs[0].scheduler.get_last_lr() == [0.025]  # stepped twice, as uninterrupted
    assert max_relative_difference(resumed.strategy.full_state_dict(), straight.strategy.full_state_dict()) == 0
