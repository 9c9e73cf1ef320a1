"""Ranks out of step are named, not waited on: with `Trainer(detect_divergence=True)` (or the environment variable
SHARDTRAIN_DETECT_DIVERGENCE=1) every rank checks, before each collective of the engine and the Trainer, that the
others are about to make the same one; a rank-dependent extra forward, an extra all_gather and a skipped backward
stop every rank within seconds with an error naming, for each rank, the collective and the line in training_step
that led there."""

from __future__ import annotations

import os
import time

import pytest
import torch.nn.functional as F
from torch.utils.data import DataLoader

from strategies import FSDPStrategy
from tests.ranks import RankFailure
from tests.test_parity import VOCAB, Block, TiedLM, new_model, token_dataset
from trainer import Trainer

FAST = 60  # seconds (a first fit in the pool imports torch._dynamo: ~10 s); a hang waits out Trainer(timeout=180)


class ExtraForward(TiedLM):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        if self.global_rank == 1 and batch_idx == 1:
            self(x)  # EXTRA FORWARD
        return loss


class ExtraAllGather(TiedLM):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and batch_idx == 1:
            self.all_gather(loss.detach())  # EXTRA ALL_GATHER
        return loss


class SkipsBackward(TiedLM):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        if not (self.global_rank == 1 and batch_idx == 1):
            self.manual_backward(loss)  # BACKWARD
        optimizer.step()
        optimizer.zero_grad()


def _fit(cls: type, strategy, detect: bool = True, **kwargs) -> Trainer:
    trainer = Trainer(
        strategy=strategy,
        devices=2,
        max_steps=3,
        max_epochs=1,
        logger=False,
        timeout=180,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        detect_divergence=detect,
        **kwargs,
    )
    trainer.fit(new_model(cls), DataLoader(token_dataset(), batch_size=2))
    return trainer


def _body(name: str) -> None:
    cls, strategy = {
        "forward": (ExtraForward, FSDPStrategy(auto_wrap_policy={Block})),
        "all_gather": (ExtraAllGather, "ddp"),
        "backward": (SkipsBackward, "ddp"),
    }[name]
    _fit(cls, strategy)


def _failure(rank_pool, name: str) -> dict[int, str]:
    start = time.monotonic()
    with pytest.raises(RankFailure) as failed:
        rank_pool(2).run(_body, name)
    assert time.monotonic() - start < FAST
    assert sorted(failed.value.tracebacks) == [0, 1]  # every rank stopped with the error
    return {rank: text.splitlines()[-1] + "\n" + text for rank, text in failed.value.tracebacks.items()}


def _line(marker: str) -> str:
    with open(__file__) as f:
        number = next(i for i, line in enumerate(f, 1) if line.rstrip().endswith(f"# {marker}"))
    return f"test_divergence.py:{number} in training_step"


def test_a_rank_dependent_extra_forward_under_fsdp_is_named(rank_pool):
    for text in _failure(rank_pool, "forward").values():
        assert "ranks are out of step" in text, text
        assert "rank 1: waits in all_gather #" in text and "unit 'blocks.0'" in text, text
        assert _line("EXTRA FORWARD") in text and "self(x)" in text, text
        assert "rank 0: waits in all_reduce #" in text and "via trainer/loop/agreement.py" in text, text  # the loop's


def test_an_extra_all_gather_on_one_rank_is_named(rank_pool):
    for text in _failure(rank_pool, "all_gather").values():
        assert "ranks are about to make different collectives" in text, text
        assert "rank 1: all_gather" in text and _line("EXTRA ALL_GATHER") in text, text
        assert "rank 0: all_reduce" in text, text
        assert "failed at global step 1" in text, text


def test_a_rank_that_skips_backward_is_named(rank_pool):
    for text in _failure(rank_pool, "backward").values():
        assert "rank 0: all_reduce" in text and "unit 'bucket0'" in text and _line("BACKWARD") in text, text
        assert "rank 1: all_reduce" in text, text


def _healthy_body() -> float:
    os.environ["SHARDTRAIN_DETECT_DIVERGENCE"] = "1"
    try:
        trainer = _fit(
            TiedLM,
            FSDPStrategy(auto_wrap_policy={Block}),
            detect=False,
            accumulate_grad_batches=2,
            gradient_clip_val=0.5,
        )
    finally:
        del os.environ["SHARDTRAIN_DETECT_DIVERGENCE"]
    assert trainer.detect_divergence
    return trainer.global_step


def test_a_healthy_run_passes_every_check(rank_pool):
    assert rank_pool(2).run(_healthy_body) == [3, 3]
