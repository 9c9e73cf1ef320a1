"""Misuse a new user can make ends in the right numbers or a clear error (issue 10), on real ranks:

- evaluation data that does not divide by the world size: every sample is seen once, epoch metrics weigh batches
  by their size, predict returns each sample's output once and in order on rank 0;
- training data that does not divide: DistributedSampler's repeated samples are reported; iterable data of a
  different length on each rank ends the epoch on every rank together;
- validation that would never run: a clear error instead of a run without validation or checkpoints;
- a non-finite loss or gradient norm: an error naming the step, the rank and the value, or a skip on every rank;
- a second fit on the same Trainer: an error;
- precision="bf16-true": the batch is cast to bfloat16.
"""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from callbacks import ModelCheckpoint
from strategies import FSDPStrategy
from trainer import Trainer, TrainModule

QUIET = {
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "num_sanity_val_steps": 0,
    "enable_model_summary": False,
}
STRATEGIES = ("ddp", "fsdp")


def strategy(name: str):
    """fsdp with each Linear as a unit: forward passes all-gather, so every rank must take part in each."""
    return FSDPStrategy(auto_wrap_policy={nn.Linear}) if name == "fsdp" else name


def samples(n: int, seed: int = 0) -> TensorDataset:
    """(index, x, y): the index tells which samples a step saw."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.arange(n), torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g))


def loader(n: int, batch_size: int = 4, **kwargs) -> DataLoader:
    return DataLoader(samples(n), batch_size=batch_size, **kwargs)


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class Probe(TrainModule):
    """A small regression model that records the samples its evaluation steps saw.

    `nan_at`: (batch, rank) whose training loss is NaN; `nan_grad_at`: batch whose gradients are NaN while the
    loss stays finite; `none_at`: batch for which training_step returns None on every rank."""

    def __init__(self, nan_at=None, nan_grad_at=None, none_at=None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.nan_at, self.nan_grad_at, self.none_at = nan_at, nan_grad_at, none_at
        self.seen: list[int] = []

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        _, x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.log("train/loss", loss)
        if (batch_idx, rank()) == self.nan_at:
            loss = loss * float("nan")
        if batch_idx == self.nan_grad_at:
            loss = loss + 0.0 * torch.sqrt(out - out.detach()).sum()  # adds 0; its gradient is 0 * inf = NaN
        if batch_idx == self.none_at:
            return None
        return loss

    def _evaluate(self, batch, stage: str) -> None:
        index, x, y = batch
        self.log(f"{stage}/loss", F.mse_loss(self(x), y), sync_dist=True)
        self.log(f"{stage}/batch", float(len(index)), sync_dist=True, batch_size=1)  # a plain mean over batches

    def on_validation_batch_end(self, outputs, batch, batch_idx) -> None:
        self.seen += batch[0].tolist()

    def on_test_batch_end(self, outputs, batch, batch_idx) -> None:
        self.seen += batch[0].tolist()

    def validation_step(self, batch, batch_idx):
        self._evaluate(batch, "val")

    def test_step(self, batch, batch_idx):
        self._evaluate(batch, "test")

    def predict_step(self, batch, batch_idx):
        index, x, _ = batch
        return torch.cat([index[:, None].float(), self(x)], dim=1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def reference(weights: dict[str, torch.Tensor], n: int) -> tuple[float, torch.Tensor]:
    """One process: the mean loss over the n samples and each sample's prediction."""
    model = Probe()
    model.load_state_dict(weights)
    _, x, y = samples(n).tensors
    with torch.no_grad():
        out = model(x)
    return F.mse_loss(out, y).item(), out


def mean_batch(n: int, batch_size: int = 4) -> float:
    """The plain mean of batch sizes over the batches of 2 ranks that each take a contiguous half of n samples in
    as many batches as the larger half needs (a rank with no sample has none)."""
    batches = 2 * math.ceil(math.ceil(n / 2) / batch_size) if n >= 2 else 1
    return n / batches


# -------------------------------------------------------------------------------------- 1. uneven evaluation


def body_uneven_evaluation(name: str, sizes: list[int]) -> dict:
    trainer = Trainer(strategy=strategy(name), devices=2, max_epochs=1, timeout=20, **QUIET)
    module = Probe()
    trainer.fit(module, loader(16, shuffle=True), loader(63))  # 2 steps, then validation
    result = {
        "fit": (float(trainer.callback_metrics["val/loss"]), module.seen),
        "weights": trainer.strategy.full_state_dict(),
    }
    for n in sizes:
        module.seen = []
        validated = trainer.validate(module, loader(n))[0]
        result[("validate", n)] = (validated["val/loss"], validated["val/batch"], module.seen)
        module.seen = []
        tested = trainer.test(module, loader(n))[0]
        result[("test", n)] = (tested["test/loss"], tested["test/batch"], module.seen)
        result[("predict", n)] = trainer.predict(module, loader(n))
    return result


@pytest.mark.parametrize("name", STRATEGIES)
def test_evaluation_sees_every_sample_once_with_one_process_metrics(rank_pool, name):
    sizes = [63, 9, 1]  # 9: 2 batches each (4 + 1, 3 + 1 samples); 1: rank 1 has none
    ranks = rank_pool(2).run(body_uneven_evaluation, name, sizes)
    weights = ranks[0]["weights"]
    loss, _ = reference(weights, 63)
    for r in ranks:
        assert r["fit"][0] == pytest.approx(loss, rel=1e-5)
    assert sorted(ranks[0]["fit"][1] + ranks[1]["fit"][1]) == list(range(63))
    for n in sizes:
        loss, predictions = reference(weights, n)
        for stage in ("validate", "test"):
            seen = ranks[0][(stage, n)][2] + ranks[1][(stage, n)][2]
            assert sorted(seen) == list(range(n)), (stage, n)  # each sample once, no padding
            for r in ranks:
                assert r[(stage, n)][0] == pytest.approx(loss, rel=1e-5), (stage, n)
                assert r[(stage, n)][1] == pytest.approx(mean_batch(n)), (stage, n)  # batch_size=1 overrides
        assert ranks[1][("predict", n)] is None
        predicted = torch.cat(ranks[0][("predict", n)])
        assert torch.equal(predicted[:, 0], torch.arange(n).float())  # once each, in dataset order
        torch.testing.assert_close(predicted[:, 1:], predictions, rtol=1e-5, atol=1e-6)


def test_evaluation_shares_come_in_as_many_batches_on_every_rank_where_they_can():
    from trainer.data.loaders import ShardBatchSampler

    def sizes(n: int, ranks: int, batch_size: int) -> list[list[int]]:
        return [[len(b) for b in ShardBatchSampler(n, ranks, r, batch_size)] for r in range(ranks)]

    assert sizes(9, 2, 2) == [[2, 2, 1], [2, 1, 1]]  # a few batches one sample smaller
    assert sizes(63, 2, 4) == [[4] * 8, [4] * 7 + [3]]
    assert sizes(9, 1, 4) == [[4, 4, 1]]  # one rank: the loader's own batches
    assert sizes(9, 2, 1) == [[1] * 5, [1] * 4]  # no way: rank 1 sits out the last step
    assert sizes(1, 2, 4) == [[1], []]
    batches = [list(ShardBatchSampler(9, 3, r, 2)) for r in range(3)]
    assert [i for rank in batches for batch in rank for i in batch] == list(range(9))  # in order, each once


class Heads(Probe):
    """Splits its features into heads with view(b, heads, -1), as GPT and HuggingFace attention do: a batch of
    0 samples cannot be viewed so, whatever the model."""

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        h = h.view(h.shape[0], 2, -1).flip(1).reshape(h.shape[0], -1)
        return self.net[2](h)


def body_uneven_evaluation_of_heads(name: str) -> tuple[float, list[int]]:
    trainer = Trainer(strategy=strategy(name), devices=2, timeout=20, **QUIET)
    module = Heads()
    metrics = trainer.validate(module, loader(9))[0]  # batches of 4 and 1 on rank 0, 3 and 1 on rank 1
    return metrics["val/loss"], module.seen


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_rank_that_ran_out_of_evaluation_data_does_not_feed_the_model_an_empty_batch(rank_pool, name):
    ranks = rank_pool(2).run(body_uneven_evaluation_of_heads, name)
    _, x, y = samples(9).tensors
    with torch.no_grad():
        want = F.mse_loss(Heads()(x), y).item()
    assert sorted(ranks[0][1] + ranks[1][1]) == list(range(9))
    assert ranks[0][0] == pytest.approx(want, rel=1e-5) and ranks[1][0] == pytest.approx(want, rel=1e-5)


# ---------------------------------------------------------------------------------------- 2. uneven training


def body_repeated_samples(drop_last: bool) -> tuple[list[str], int]:
    trainer = Trainer(strategy="ddp", devices=2, max_epochs=2, **QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Probe(), loader(63, drop_last=drop_last))
    return [str(w.message) for w in caught if "repeat" in str(w.message)], trainer.global_step


def test_samples_repeated_by_the_distributed_sampler_are_reported_once_on_rank_zero(rank_pool):
    (on_rank0, steps), (on_rank1, _) = rank_pool(2).run(body_repeated_samples, False)
    assert steps == 16  # 63 samples padded to 64: 8 batches of 4 per rank and epoch
    assert len(on_rank0) == 1 and on_rank1 == []
    assert "1 sample" in on_rank0[0] and "drop_last=True" in on_rank0[0], on_rank0
    (on_rank0, steps), (on_rank1, _) = rank_pool(2).run(body_repeated_samples, True)
    assert (on_rank0, on_rank1, steps) == ([], [], 14)


class RankStream(IterableDataset):
    """Yields `counts[rank]` samples: the ranks run out at different times."""

    def __init__(self, counts: list[int]) -> None:
        self.counts = counts

    def __iter__(self):
        _, x, y = samples(max(self.counts)).tensors
        for i in range(self.counts[rank()]):
            yield torch.tensor(i), x[i], y[i]


def body_uneven_stream(name: str) -> dict:
    trainer = Trainer(strategy=strategy(name), devices=2, max_epochs=2, timeout=10, **QUIET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(Probe(), DataLoader(RankStream([10, 6]), batch_size=2))  # 5 and 3 batches
    return {
        "step": trainer.global_step,
        "weights": trainer.strategy.full_state_dict(),
        "warnings": [str(w.message) for w in caught if "unused" in str(w.message)],
    }


@pytest.mark.parametrize("name", STRATEGIES)
def test_iterable_data_of_uneven_length_ends_the_epoch_on_every_rank_together(rank_pool, name):
    ranks = rank_pool(2).run(body_uneven_stream, name)
    assert [r["step"] for r in ranks] == [6, 6]  # 3 steps per epoch: rank 1 ran out after 3 batches
    for key, value in ranks[0]["weights"].items():
        assert torch.equal(value, ranks[1]["weights"][key])
    assert len(ranks[0]["warnings"]) == 2 and ranks[1]["warnings"] == []  # once per epoch, on rank 0
    assert "rank 0: 2" in ranks[0]["warnings"][0] and "rank 1: 0" in ranks[0]["warnings"][0]


def body_uneven_stream_evaluation(name: str, counts: list[list[int]]) -> list[tuple[float, list[int]]]:
    trainer = Trainer(strategy=strategy(name), devices=2, timeout=10, **QUIET)
    module = Probe()
    results = []
    for per_rank in counts:
        module.seen = []
        metrics = trainer.validate(module, DataLoader(RankStream(per_rank), batch_size=2))[0]
        results.append((metrics["val/loss"], module.seen))
    return results


def test_iterable_evaluation_data_of_uneven_length_is_evaluated_in_full(rank_pool):
    counts = [[7, 2], [3, 0]]  # 4 batches against 1; a rank with none at all
    ranks = rank_pool(2).run(body_uneven_stream_evaluation, "fsdp", counts)
    for i, per_rank in enumerate(counts):
        assert [r[i][1] for r in ranks] == [list(range(n)) for n in per_rank]
        _, x, y = samples(max(per_rank)).tensors
        index = torch.cat([torch.arange(n) for n in per_rank])
        with torch.no_grad():
            want = F.mse_loss(Probe()(x[index]), y[index]).item()
        assert ranks[0][i][0] == pytest.approx(want, rel=1e-5) and ranks[1][i][0] == pytest.approx(want, rel=1e-5)


# ----------------------------------------------------------------------------- 4. validation that never runs


def test_val_check_interval_zero_is_a_value_error():
    with pytest.raises(ValueError, match="val_check_interval=0"):
        Trainer(val_check_interval=0, **QUIET)


def body_interval_longer_than_epoch() -> str:
    trainer = Trainer(strategy="ddp", devices=2, max_epochs=1, val_check_interval=2, **QUIET)
    try:
        trainer.fit(Probe(), loader(8), loader(8))  # 1 training batch per rank
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_val_check_interval_longer_than_the_epoch_is_an_error_naming_both_numbers(rank_pool):
    for message in rank_pool(2).run(body_interval_longer_than_epoch):
        assert "val_check_interval=2" in message and "1 training batch" in message, message


def body_monitored_metric_never_logged(root: str) -> str:
    saver = ModelCheckpoint(os.path.join(root, "ckpts"), monitor="val/loss")
    trainer = Trainer(
        strategy="ddp",
        devices=2,
        max_epochs=1,
        check_val_every_n_epoch=2,
        logger=False,
        enable_progress_bar=False,
        callbacks=[saver],
    )
    try:
        trainer.fit(Probe(), loader(16), loader(8))
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_model_checkpoint_whose_metric_was_never_logged_is_an_error_listing_the_logged_keys(rank_pool, tmp_path):
    for message in rank_pool(2).run(body_monitored_metric_never_logged, str(tmp_path)):
        assert "monitor='val/loss'" in message and "'train/loss'" in message, message


# ------------------------------------------------------------------------------------------ 5. non-finite loss


def body_nonfinite(name: str, module_kwargs: dict, **trainer_kwargs) -> dict:
    trainer = Trainer(strategy=strategy(name), devices=2, max_epochs=1, **QUIET, **trainer_kwargs)
    module = Probe(**module_kwargs)
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(module, loader(48))  # 6 steps
        except FloatingPointError as e:
            error = str(e)
    weights = trainer.strategy.full_state_dict()
    return {
        "error": error,
        "step": trainer.global_step,
        "weights": weights,
        "finite": all(bool(torch.isfinite(w).all()) for w in weights.values()),
        "skipped": trainer.callback_metrics.get("skipped_nonfinite_steps"),
        "warnings": [str(w.message) for w in caught if "non-finite" in str(w.message)],
    }


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_nonfinite_loss_stops_every_rank_naming_the_step_rank_and_value(rank_pool, name):
    ranks = rank_pool(2).run(body_nonfinite, name, {"nan_at": (2, 1)})
    for r in ranks:
        assert r["error"] is not None and r["step"] == 2, r["error"]
        assert "global step 2" in r["error"] and "rank 1: nan" in r["error"] and "on_nonfinite" in r["error"]
        assert r["finite"]  # stopped before the NaN reached the weights


def body_skip_against_none(name: str) -> dict:
    skipped = body_nonfinite(name, {"nan_at": (2, 1)}, on_nonfinite="skip")
    trainer = Trainer(strategy=strategy(name), devices=2, max_epochs=1, **QUIET)
    trainer.fit(Probe(none_at=2), loader(48))  # every rank leaves out batch 2
    skipped["reference"] = trainer.strategy.full_state_dict()
    return skipped


def test_on_nonfinite_skip_skips_the_step_on_every_rank_and_counts_it(rank_pool):
    ranks = rank_pool(2).run(body_skip_against_none, "fsdp")
    for r in ranks:
        assert r["error"] is None and r["step"] == 6  # a skipped step counts, as an fp16 overflow does
        assert r["skipped"] == 1
        for key, value in r["weights"].items():
            assert torch.equal(value, r["reference"][key]), key
    assert len(ranks[0]["warnings"]) == 1 and "global step 2" in ranks[0]["warnings"][0]
    assert ranks[1]["warnings"] == []


def test_a_nonfinite_gradient_norm_stops_training_when_clipping(rank_pool):
    ranks = rank_pool(2).run(body_nonfinite, "fsdp", {"nan_grad_at": 3}, gradient_clip_val=1.0)
    for r in ranks:
        assert r["error"] is not None and "gradient norm" in r["error"] and "global step 3" in r["error"]
        assert r["finite"] and r["step"] == 3


def test_on_nonfinite_is_checked_in_the_constructor():
    with pytest.raises(ValueError, match=r"on_nonfinite='warn'.*'error'.*'skip'.*'ignore'"):
        Trainer(on_nonfinite="warn", **QUIET)


# -------------------------------------------------------------------------------------------------- 6. fit twice


def body_fit_twice() -> str:
    trainer = Trainer(strategy="ddp", devices=2, max_epochs=1, **QUIET)
    module = Probe()
    trainer.fit(module, loader(16))
    try:
        trainer.fit(module, loader(16))
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_second_fit_on_the_same_trainer_is_an_error(rank_pool):
    for message in rank_pool(2).run(body_fit_twice):
        assert "fit" in message and "new Trainer" in message, message


# ------------------------------------------------------------------------------------------------- 7. bf16-true


def body_bf16_true(name: str) -> dict:
    trainer = Trainer(strategy=strategy(name), devices=2, max_epochs=1, precision="bf16-true", **QUIET)
    trainer.fit(Probe(), loader(24), loader(8))  # 3 steps, then validation
    return {
        "val": float(trainer.callback_metrics["val/loss"]),
        "step": trainer.global_step,
        "dtypes": {w.dtype for w in trainer.strategy.full_state_dict().values()},
    }


@pytest.mark.parametrize("name", STRATEGIES)
def test_bf16_true_casts_the_batch_to_bfloat16(rank_pool, name):
    for r in rank_pool(2).run(body_bf16_true, name):
        assert r["step"] == 3 and math.isfinite(r["val"]) and r["dtypes"] == {torch.bfloat16}


# ------------------------------------------------------------------------------- 8. disk full, 10. meta.json


class Wide(Probe):
    """Probe with a wider layer, so that a checkpoint takes a few hundred KiB."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def body_disk_full(root: str, small: str) -> dict:
    trainer = Trainer(strategy=strategy("fsdp"), devices=2, max_steps=2, default_root_dir=root, **QUIET)
    trainer.fit(Wide(), loader(16))
    path = os.path.join(small, "last")
    trainer.save_checkpoint(path)
    good = trainer.strategy.full_state_dict()
    if trainer.is_global_zero:  # leave less free space than a checkpoint takes
        stat = os.statvfs(small)
        with open(os.path.join(small, "filler"), "wb") as f:
            f.write(b"\0" * (stat.f_bavail * stat.f_frsize - 64 * 1024))
    trainer.strategy.barrier()
    with torch.no_grad():
        trainer.strategy.engine.units[0].master.add_(1.0)  # so that a second, complete save would differ
    try:
        trainer.save_checkpoint(path)
        error = None
    except OSError as raised:
        error = (type(raised).__mro__[1].__name__, raised.errno, str(raised))
    trainer.strategy.barrier()
    if trainer.is_global_zero:
        os.remove(os.path.join(small, "filler"))
    return {"error": error, "listing": sorted(os.listdir(small)), "good": good}


@pytest.fixture
def small_filesystem(tmp_path):
    """A 2 MiB tmpfs (needs the right to mount, as root in a container usually has; else the test is skipped)."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here to fill a disk for real: {done.stderr.decode().strip()}")
    yield str(mount)
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_fails_the_save_alike_on_every_rank_and_keeps_the_previous_checkpoint(
    rank_pool, tmp_path, small_filesystem
):
    from trainer.checkpoint import load_full_state_dict

    ranks = rank_pool(2).run(body_disk_full, str(tmp_path), small_filesystem)
    errors = {r["error"] for r in ranks}
    assert len(errors) == 1, errors  # every rank raises the same error
    base, errno, message = errors.pop()
    assert base == "OSError" and errno == 28, message
    assert "No space left on device" in message and os.path.join(small_filesystem, "last") in message
    assert ranks[0]["listing"] == ["last"]  # the staging folder is gone
    kept = load_full_state_dict(os.path.join(small_filesystem, "last"))
    assert all(torch.equal(kept[k], v) for k, v in ranks[0]["good"].items())  # the previous one, intact


def test_an_edited_meta_json_is_refused_by_name(tmp_path):
    import json

    from trainer.checkpoint import CheckpointError, load_full_state_dict

    trainer = Trainer(devices=1, max_steps=1, default_root_dir=tmp_path, **QUIET)
    trainer.fit(Probe(), loader(8))
    path = tmp_path / "ckpt"
    trainer.save_checkpoint(path)
    meta = json.loads((path / "meta.json").read_text())
    meta["world_size"] = 4
    (path / "meta.json").write_text(json.dumps(meta, indent=1))
    with pytest.raises(CheckpointError, match=r"meta\.json.*changed after it was written"):
        load_full_state_dict(path)
    with pytest.raises(CheckpointError, match=r"meta\.json"):
        Trainer(devices=1, max_steps=2, **QUIET).fit(Probe(), loader(8), ckpt_path=str(path))
