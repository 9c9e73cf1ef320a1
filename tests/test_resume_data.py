"""Exact resume with real data loading: DataLoader workers (and persistent ones), shuffling, and a dataset that
augments with torch's random numbers in `__getitem__`, resumed in the middle of an epoch under ddp and fsdp.

The resumed run must end with the uninterrupted run's weights exactly, and must not load the batches that were
trained before the checkpoint again (each load is counted in a file, from the workers too).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from strategies import FSDPStrategy
from tests.test_checkpoint import assert_states_close
from trainer import Trainer, TrainModule, seed_everything

SAMPLES, FEATURES, BATCH = 48, 8, 4  # 6 batches per rank and epoch at 2 ranks
TOTAL = 12  # two epochs


class Augmented(Dataset):
    """Features with noise drawn from torch's generator at every load; each load is written to `log_dir`."""

    def __init__(self, log_dir: str) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(SAMPLES, FEATURES, generator=g), torch.randn(SAMPLES, 1, generator=g)
        self.log_dir = log_dir

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        with open(os.path.join(self.log_dir, f"loads-{os.getpid()}"), "a") as f:
            f.write(f"{index}\n")
        return self.x[index] + 0.5 * torch.randn(FEATURES), self.y[index]


class Regression(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def fit(root: str, name: str, workers: int, persistent: bool, max_steps: int, ckpt_path: str | None = None,
        save_to: str | None = None) -> tuple[dict[str, torch.Tensor], int]:
    """(the weights, the samples this rank loaded)."""
    log_dir = os.path.join(root, f"rank{dist.get_rank()}")
    os.makedirs(log_dir)
    seed_everything(0)
    loader = DataLoader(Augmented(log_dir), batch_size=BATCH, shuffle=True, num_workers=workers,
                        persistent_workers=persistent)
    strategy = FSDPStrategy() if name == "fsdp" else name
    trainer = Trainer(strategy=strategy, devices=2, max_steps=max_steps, logger=False, enable_progress_bar=False,
                      enable_checkpointing=False, enable_model_summary=False, default_root_dir=root)
    trainer.fit(Regression(), loader, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    loads = sum(len(open(os.path.join(log_dir, f)).readlines()) for f in os.listdir(log_dir))
    return trainer.strategy.full_state_dict(), loads


def body_resume(root: str, name: str, workers: int, persistent: bool, stop: int) -> dict:
    straight, _ = fit(os.path.join(root, "straight"), name, workers, persistent, TOTAL)
    path = os.path.join(root, "ckpt")
    fit(os.path.join(root, "first"), name, workers, persistent, stop, save_to=path)
    resumed, loads = fit(os.path.join(root, "resumed"), name, workers, persistent, TOTAL, ckpt_path=path)
    return {"straight": straight, "resumed": resumed, "loads": loads}


@pytest.mark.parametrize("name, workers, persistent, stop", [
    ("ddp", 0, False, 3),
    ("ddp", 2, False, 8),
    ("fsdp", 2, True, 3),
    ("fsdp", 0, False, 8),
])
def test_a_mid_epoch_resume_with_workers_and_augmentation_is_exact(rank_pool, tmp_path, name, workers, persistent,
                                                                   stop):
    for rank, result in enumerate(rank_pool(2).run(body_resume, str(tmp_path), name, workers, persistent, stop)):
        assert_states_close(result["resumed"], result["straight"], atol=0)
        assert result["loads"] == (TOTAL - stop) * BATCH, (rank, "batches trained before the resume were loaded")
