"""Bad input gets a clear error: wrong Trainer arguments in the constructor, before any rank is started; a missing
checkpoint; a training_step that returns something other than a loss; and a batch skipped (None) by only some
ranks, reported on every rank instead of hanging. A batch that every rank skips is simply not trained on."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tests.ranks import RankFailure
from tests.test_parity import TiedLM, max_relative_difference, new_model, token_dataset
from trainer import Trainer
from trainer.launch import launcher

QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}


@pytest.fixture
def no_rank_may_start(monkeypatch):
    """Trainer(devices=2) in this process would start ranks by re-running pytest; an argument error must come
    first, so starting ranks here fails the test."""

    def refuse(num_ranks: int):
        raise AssertionError(f"the Trainer started {num_ranks} ranks before checking its arguments")

    monkeypatch.setattr(launcher, "launch_local_ranks", refuse)


@pytest.mark.parametrize(
    ("argument", "value", "choices"),
    [
        ("strategy", "deepspeed", ["'ddp'", "'zero1'", "'zero2'", "'fsdp'", "'auto'"]),
        ("precision", "64", ["'32'", "'bf16-mixed'", "'16-mixed'", "'bf16-true'"]),
        ("devices", 0, ["positive int", "'auto'"]),
        ("devices", "two", ["positive int", "'auto'"]),
        ("accelerator", "tpu", ["'auto'", "'cpu'", "'cuda'"]),
    ],
)
def test_a_wrong_argument_is_a_value_error_naming_it_and_the_choices(no_rank_may_start, argument, value, choices):
    kwargs = {"devices": 2, argument: value}
    with pytest.raises(ValueError) as info:
        Trainer(**kwargs, **QUIET)
    message = str(info.value)
    assert f"{argument}={value!r}" in message
    for choice in choices:
        assert choice in message, (choice, message)


def test_a_strategy_of_the_wrong_type_is_a_type_error(no_rank_may_start):
    with pytest.raises(TypeError, match="strategy must be a name or a Strategy"):
        Trainer(strategy=3, devices=2, **QUIET)


def one_process_trainer(**kwargs) -> Trainer:
    return Trainer(strategy="single", devices=1, max_steps=2, **QUIET, **kwargs)


def loader(batch_size: int = 2) -> DataLoader:
    return DataLoader(token_dataset(16), batch_size=batch_size, shuffle=False)


def test_a_missing_checkpoint_is_a_clear_error(tmp_path):
    missing = tmp_path / "does" / "not" / "exist"
    with pytest.raises(FileNotFoundError, match=re.escape(f"checkpoint {str(missing)!r} does not exist")):
        one_process_trainer().fit(new_model(), loader(), ckpt_path=str(missing))


class Returns(TiedLM):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return {
            "string": "loss",
            "vector": loss * torch.ones(3),
            "dict without loss": {"total": loss},
            "detached": loss.detach(),
            "dict with loss": {"loss": loss, "extra": 1},
        }[self.kind]


@pytest.mark.parametrize(
    ("kind", "described"),
    [
        ("string", "got str"),
        ("vector", "shape (3,)"),
        ("dict without loss", "got dict"),
        ("detached", "requires_grad=False"),
    ],
)
def test_training_step_must_return_a_loss(kind, described):
    with pytest.raises(TypeError, match="training_step") as info:
        one_process_trainer().fit(new_model(Returns, kind=kind), loader())
    assert "batch 0" in str(info.value) and described in str(info.value)


def test_a_dict_holding_the_loss_is_accepted():
    trainer = one_process_trainer()
    trainer.fit(new_model(Returns, kind="dict with loss"), loader())
    assert trainer.global_step == 2


# ------------------------------------------------------------------------------------------- skipped batches


class SkipsBatches(TiedLM):
    """Returns None for the listed batches of the listed ranks (every rank if `ranks` is None)."""

    def __init__(self, batches: set[int], ranks: set[int] | None = None) -> None:
        super().__init__()
        self.batches, self.ranks = batches, ranks

    def training_step(self, batch, batch_idx):
        rank = dist.get_rank() if dist.is_initialized() else 0
        if batch_idx in self.batches and (self.ranks is None or rank in self.ranks):
            return None
        return super().training_step(batch, batch_idx)


def fit_skipping(
    batches: set[int], ranks: set[int] | None, devices: int, batch_size: int, accumulate: int = 1
) -> Trainer:
    trainer = Trainer(
        strategy="ddp" if devices > 1 else "single",
        devices=devices,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        **QUIET,
    )
    trainer.fit(new_model(SkipsBatches, batches=batches, ranks=ranks), loader(batch_size))
    return trainer


def body_every_rank_skips() -> tuple[int, dict[str, torch.Tensor]]:
    trainer = fit_skipping({1}, None, dist.get_world_size(), 2)
    return trainer.global_step, trainer.strategy.full_state_dict()


def test_a_batch_every_rank_skips_is_not_trained_on(rank_pool):
    ranks = rank_pool(2).run(body_every_rank_skips)
    # 16 samples, 2 ranks of batch 2: 4 batches, one of them skipped.
    assert [step for step, _ in ranks] == [3, 3]
    reference = fit_skipping({1}, None, 1, 4)
    assert reference.global_step == 3
    assert max_relative_difference(ranks[0][1], reference.strategy.full_state_dict()) <= 1e-5
    trained_on_all = fit_skipping(set(), None, 1, 4).strategy.full_state_dict()
    assert max_relative_difference(ranks[0][1], trained_on_all) > 1e-3  # the skip did change the outcome


def body_last_micro_batch_skipped() -> dict[str, torch.Tensor]:
    return fit_skipping({1}, None, dist.get_world_size(), 2, accumulate=2).strategy.full_state_dict()


def test_a_skipped_last_micro_batch_still_averages_the_window(rank_pool):
    """Batch 1 closes the first accumulation window and is skipped: the gradients of batch 0, kept local by
    no_sync, must still be averaged over the ranks before the step (the ranks would drift apart otherwise)."""
    ranks = rank_pool(2).run(body_last_micro_batch_skipped)
    assert max_relative_difference(ranks[0], ranks[1]) == 0
    reference = fit_skipping({1}, None, 1, 4, accumulate=2).strategy.full_state_dict()
    assert max_relative_difference(ranks[0], reference) <= 1e-5


def body_one_rank_skips() -> str:
    try:
        fit_skipping({2}, {1}, dist.get_world_size(), 2)
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_batch_skipped_by_one_rank_only_is_an_error_on_every_rank(rank_pool):
    pool = rank_pool(2)
    pool.call_timeout = 60.0  # a hang fails the test in a minute instead of five
    try:
        messages = pool.run(body_one_rank_skips)
    except RankFailure as failure:  # e.g. a rank stuck in a collective
        pytest.fail(f"not a clean error on every rank:\n{failure}")
    finally:
        pool.call_timeout = 300.0
    for message in messages:
        assert "training_step returned None on rank(s) [1]" in message, message
        assert "batch 2" in message
