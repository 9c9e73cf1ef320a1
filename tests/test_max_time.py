"""`Trainer(max_time=...)` as Lightning's: every rank stops together after the optimizer step that passes it (agreed
in the all-reduce after each training_step) and keeps a checkpoint, as the end of fit does."""

from __future__ import annotations

import datetime
import os
import time

import pytest
from torch.utils.data import DataLoader

from tests.test_parity import TiedLM, new_model, token_dataset
from trainer import Trainer
from trainer.arguments import check_max_time
from trainer.checkpoint import load_trainer_state


def test_max_time_takes_lightnings_forms():
    assert check_max_time("00:01:00:00") == datetime.timedelta(hours=1)
    assert check_max_time("1:00:00:30") == datetime.timedelta(days=1, seconds=30)
    assert check_max_time({"minutes": 2}) == datetime.timedelta(minutes=2)
    assert check_max_time(datetime.timedelta(seconds=5)) == datetime.timedelta(seconds=5)
    assert check_max_time(None) is None
    for bad in ("00:01:00", "1h", {"fortnights": 1}, 60, datetime.timedelta(0)):
        with pytest.raises(ValueError, match=r"max_time=.*DD:HH:MM:SS"):
            Trainer(max_time=bad)


class SlowOnRankOne(TiedLM):
    """Rank 1 alone takes longer than max_time over its fourth batch."""

    def training_step(self, batch, batch_idx):
        if self.global_rank == 1 and batch_idx == 3:
            time.sleep(2.0)
        return super().training_step(batch, batch_idx)


def _body(root: str) -> dict:
    trainer = Trainer(
        strategy="ddp",
        devices=2,
        max_epochs=3,
        max_time={"seconds": 1.5},
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(new_model(SlowOnRankOne), DataLoader(token_dataset(), batch_size=2))
    return {"step": trainer.global_step, "saved": sorted(os.listdir(os.path.join(root, "checkpoints")))}


def test_every_rank_stops_after_the_step_that_passes_max_time_and_keeps_a_checkpoint(rank_pool, tmp_path):
    results = rank_pool(2).run(_body, str(tmp_path))
    assert results[0] == results[1] == {"step": 4, "saved": ["epoch=0-step=4"]}
    saved = load_trainer_state(tmp_path / "checkpoints" / "epoch=0-step=4")
    assert saved["state"]["batches_done_in_epoch"] == 4  # it resumes inside the epoch
    assert saved["time_elapsed"] > 1.5  # and keeps counting from there, as Lightning's Timer
