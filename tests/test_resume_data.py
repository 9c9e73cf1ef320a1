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
from torch.utils.data import DataLoader, Dataset, TensorDataset

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


def fit(
    root: str,
    name: str,
    workers: int,
    persistent: bool,
    max_steps: int,
    ckpt_path: str | None = None,
    save_to: str | None = None,
    stateful: bool = False,
) -> tuple[dict[str, torch.Tensor], int]:
    """(the weights, the samples this rank loaded)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    log_dir = os.path.join(root, f"rank{dist.get_rank()}")
    os.makedirs(log_dir)
    seed_everything(0)
    loader = (StatefulDataLoader if stateful else DataLoader)(
        Augmented(log_dir), batch_size=BATCH, shuffle=True, num_workers=workers, persistent_workers=persistent
    )
    strategy = FSDPStrategy() if name == "fsdp" else name
    trainer = Trainer(
        strategy=strategy,
        devices=2,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    trainer.fit(Regression(), loader, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    loads = sum(len(open(os.path.join(log_dir, f)).readlines()) for f in os.listdir(log_dir))
    return trainer.strategy.full_state_dict(), loads


def body_resume(root: str, name: str, workers: int, persistent: bool, stop: int, stateful: bool) -> dict:
    straight, _ = fit(os.path.join(root, "straight"), name, workers, persistent, TOTAL, stateful=stateful)
    path = os.path.join(root, "ckpt")
    fit(os.path.join(root, "first"), name, workers, persistent, stop, save_to=path, stateful=stateful)
    resumed, loads = fit(
        os.path.join(root, "resumed"), name, workers, persistent, TOTAL, ckpt_path=path, stateful=stateful
    )
    return {"straight": straight, "resumed": resumed, "loads": loads}


@pytest.mark.parametrize(
    "name, workers, persistent, stop, stateful",
    [
        ("ddp", 0, False, 3, False),
        ("ddp", 2, False, 8, True),  # a map-style StatefulDataLoader: rebuilt as one, resumed by the Trainer's sampler
        ("fsdp", 2, True, 3, False),
        ("fsdp", 0, False, 8, False),
    ],
)
def test_a_mid_epoch_resume_with_workers_and_augmentation_is_exact(
    rank_pool, tmp_path, name, workers, persistent, stop, stateful
):
    ranks = rank_pool(2).run(body_resume, str(tmp_path), name, workers, persistent, stop, stateful)
    for rank, result in enumerate(ranks):
        assert_states_close(result["resumed"], result["straight"], atol=0)
        assert result["loads"] == (TOTAL - stop) * BATCH, (rank, "batches trained before the resume were loaded")


def test_no_worker_of_a_stateful_dataloader_outlives_a_fit_that_stops_mid_epoch(tmp_path):
    """torchdata's StatefulDataLoader keeps its iterator, workers and all, for `state_dict` when fit stops in the
    middle of an epoch (max_steps), even without persistent_workers. Left alive, they were shut down by the
    garbage collector at some later allocation, joining each worker for 5 s there: the test suite saw a rank stall
    for 50 s inside a later run's checkpoint collective. Fit stops them at its end, as Lightning does."""
    import multiprocessing

    from torchdata.stateful_dataloader import StatefulDataLoader

    before = set(multiprocessing.active_children())
    loader = StatefulDataLoader(Augmented(str(tmp_path)), batch_size=BATCH, shuffle=True, num_workers=2)
    trainer = Trainer(
        devices=1,
        max_steps=3,  # of 12 batches an epoch
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Regression(), loader)
    assert set(multiprocessing.active_children()) - before == set()
    assert trainer.global_step == 3


def test_a_stateful_dataloader_stays_one_when_the_trainer_splits_it():
    from torchdata.stateful_dataloader import StatefulDataLoader

    from trainer.data.loaders import distributed_loader
    from trainer.data.resume_sampler import ResumableSampler

    given = StatefulDataLoader(TensorDataset(torch.arange(10)), batch_size=2, shuffle=True, snapshot_every_n_steps=3)
    rebuilt = distributed_loader(given, world_size=2, rank=1, seed=0, argument="train_dataloaders")
    assert type(rebuilt) is StatefulDataLoader and isinstance(rebuilt.sampler, ResumableSampler)
    assert rebuilt.snapshot_every_n_steps == 3 and rebuilt.batch_size == 2
    assert len([i for (batch,) in rebuilt for i in batch.tolist()]) == 5  # rank 1's half


# ------------------------------------------------------------------ a stream: HuggingFace IterableDataset by rank

ROWS, SHARDS, STREAM_BATCH = 36, 4, 3  # at 2 ranks: 2 shards, 18 rows, 6 batches per rank and epoch
STREAM_TOTAL, STREAM_STOP = 12, 4  # two epochs, resumed from the checkpoint of step 4


def _load_row(row: dict, log_dir: str) -> dict:
    """A row's features, as a stream reads them; each load is written to `log_dir` (from the workers too)."""
    with open(os.path.join(log_dir, f"loads-{os.getpid()}"), "a") as f:
        f.write(f"{row['idx']}\n")
    g = torch.Generator().manual_seed(row["idx"])
    return {"x": torch.randn(FEATURES, generator=g).tolist(), "y": [float(row["idx"] % 5)]}


def stream_loader(
    log_dir: str,
    rank: int,
    world_size: int,
    workers: int,
    stateful: bool,
    split: bool = True,
    shuffle_buffer: int | None = None,
):
    """A HuggingFace IterableDataset built from local rows in 4 shards (shuffled through a buffer of
    `shuffle_buffer` rows when given), split by rank, read by torchdata's StatefulDataLoader or a plain
    DataLoader."""
    import datasets
    from datasets.distributed import split_dataset_by_node
    from torchdata.stateful_dataloader import StatefulDataLoader

    stream = datasets.Dataset.from_dict({"idx": list(range(ROWS))}).to_iterable_dataset(num_shards=SHARDS)
    stream = stream.map(_load_row, fn_kwargs={"log_dir": log_dir})
    if shuffle_buffer is not None:
        stream = stream.shuffle(seed=7, buffer_size=shuffle_buffer)
    if split:
        stream = split_dataset_by_node(stream, rank=rank, world_size=world_size)
    loader_class = StatefulDataLoader if stateful else DataLoader
    return loader_class(stream.with_format("torch"), batch_size=STREAM_BATCH, num_workers=workers)


class StreamRegression(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.trained: list[int] = []  # the rows of each batch trained, in order

    def training_step(self, batch, batch_idx):
        self.trained += batch["idx"].tolist()
        return F.mse_loss(self.net(batch["x"]), batch["y"])


def fit_stream(root: str, name: str, workers: int, stateful: bool, ckpt_path: str | None = None, **kwargs) -> dict:
    """One run on the stream: the weights, the rows trained and the rows loaded (by this rank), the warnings."""
    import warnings

    from callbacks import ModelCheckpoint

    rank, world_size = dist.get_rank(), dist.get_world_size()
    log_dir = os.path.join(root, f"rank{rank}")
    os.makedirs(log_dir)
    seed_everything(0)
    callbacks = [
        ModelCheckpoint(
            dirpath=os.path.join(root, "ckpt"),
            every_n_train_steps=STREAM_STOP,
            save_top_k=-1,
            filename="{step}",
            async_save=kwargs.pop("async_save", False),
        )
    ]
    trainer = Trainer(
        strategy=FSDPStrategy() if name == "fsdp" else name,
        devices=world_size,
        max_steps=kwargs.pop("max_steps", STREAM_TOTAL),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        default_root_dir=root,
    )
    module = StreamRegression()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, stream_loader(log_dir, rank, world_size, workers, stateful, **kwargs), ckpt_path=ckpt_path)
    loads = [int(line) for f in os.listdir(log_dir) for line in open(os.path.join(log_dir, f))]
    return {
        "weights": trainer.strategy.full_state_dict(),
        "trained": module.trained,
        "loads": loads,
        "warnings": [str(w.message) for w in caught],
    }


def body_stream_resume(root: str, name: str, workers: int, stateful: bool, async_save: bool) -> dict:
    straight = fit_stream(os.path.join(root, "straight"), name, workers, stateful, async_save=async_save)
    checkpoint = os.path.join(root, "straight", "ckpt", f"step={STREAM_STOP}")
    resumed = fit_stream(os.path.join(root, "resumed"), name, workers, stateful, ckpt_path=checkpoint)
    return {"straight": straight, "resumed": resumed, "checkpoint": checkpoint}


@pytest.mark.parametrize(
    "name, workers, stateful, async_save",
    [
        ("ddp", 2, True, False),  # torchdata's StatefulDataLoader: its state holds each worker's position
        ("fsdp", 0, False, True),  # a plain DataLoader without workers: the HuggingFace dataset's own state
    ],
)
def test_a_resumed_stream_reads_on_from_the_loaders_own_state(rank_pool, tmp_path, name, workers, stateful, async_save):
    """Nothing trained before the checkpoint is loaded again, every row is trained once per epoch, and the resumed
    run ends with the uninterrupted run's weights exactly."""
    from collections import Counter

    ranks = rank_pool(2).run(body_stream_resume, str(tmp_path), name, workers, stateful, async_save)
    for rank, result in enumerate(ranks):
        straight, resumed = result["straight"], result["resumed"]
        trained_before = straight["trained"][: STREAM_STOP * STREAM_BATCH]
        assert Counter(straight["trained"]) == {row: 2 for row in set(straight["trained"])}, rank  # once an epoch
        assert len(set(straight["trained"])) == ROWS // 2, rank
        assert resumed["trained"] == straight["trained"][STREAM_STOP * STREAM_BATCH :], rank
        # each row loaded once for each time the resumed run trains it: none of those trained before again
        assert Counter(resumed["loads"]) == Counter(resumed["trained"]), (rank, sorted(resumed["loads"]))
        assert len(resumed["loads"]) == (STREAM_TOTAL - STREAM_STOP) * STREAM_BATCH  # 24 rows, not 36
        assert not set(trained_before) - set(straight["trained"][STREAM_BATCH * 6 :]), rank  # (all back in epoch 2)
        assert_states_close(resumed["weights"], straight["weights"], atol=0)
        assert not [w for w in straight["warnings"] + resumed["warnings"] if "same first training batch" in w]
        assert not [w for w in resumed["warnings"] if "loaded again" in w]
    if stateful:  # another world size: the rest of each rank's stream (test_a_split_huggingface_stream_...), or
        checkpoint = ranks[0]["checkpoint"]  # the opt-out, which says what it does
        assert all(torch.isfinite(w).all() for w in fit_one_process(str(tmp_path / "one"), checkpoint).values())
        with pytest.warns(UserWarning, match="some samples train twice and as many not at all"):
            weights = fit_one_process(str(tmp_path / "opt-out"), checkpoint, restore_loader_state=False)
        assert all(torch.isfinite(w).all() for w in weights.values())


def fit_one_process(root: str, checkpoint: str, shuffle_buffer: int | None = None, **fit_kwargs) -> dict:
    os.makedirs(os.path.join(root, "rank0"))
    trainer = Trainer(
        devices=1,
        max_steps=STREAM_TOTAL,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    module = StreamRegression()
    loader = stream_loader(os.path.join(root, "rank0"), 0, 1, 0, True, shuffle_buffer=shuffle_buffer)
    trainer.fit(module, loader, ckpt_path=checkpoint, **fit_kwargs)
    return trainer.strategy.full_state_dict()


def body_shuffled_stream_resume(root: str, name: str, workers: int, stateful: bool) -> dict:
    straight = fit_stream(os.path.join(root, "straight"), name, workers, stateful, shuffle_buffer=6)
    checkpoint = os.path.join(root, "straight", "ckpt", f"step={STREAM_STOP}")
    resumed = fit_stream(os.path.join(root, "resumed"), name, workers, stateful, ckpt_path=checkpoint, shuffle_buffer=6)
    return {"straight": straight, "resumed": resumed, "checkpoint": checkpoint}


@pytest.mark.parametrize(
    "name, workers, stateful",
    [
        ("ddp", 0, False),  # the HuggingFace dataset's own state, without workers
        ("fsdp", 2, True),  # torchdata's StatefulDataLoader with 2 workers (datasets failed loading its state)
    ],
)
def test_a_resumed_shuffled_stream_trains_every_row_of_the_epoch_once(rank_pool, tmp_path, name, workers, stateful):
    """A HuggingFace shuffle buffer is not in the stream's state: rows in the buffer at the checkpoint would never
    be trained. The resume reads the epoch again and skips the batches trained, which is exact, and says so."""
    from collections import Counter

    ranks = rank_pool(2).run(body_shuffled_stream_resume, str(tmp_path), name, workers, stateful)
    per_epoch = 6 * STREAM_BATCH  # 18 rows per rank and epoch
    for rank, result in enumerate(ranks):
        straight, resumed = result["straight"], result["resumed"]
        first_epoch = (
            straight["trained"][: STREAM_STOP * STREAM_BATCH] + resumed["trained"][: (6 - STREAM_STOP) * STREAM_BATCH]
        )
        assert Counter(first_epoch) == {row: 1 for row in set(first_epoch)} and len(first_epoch) == per_epoch, rank
        assert resumed["trained"] == straight["trained"][STREAM_STOP * STREAM_BATCH :], rank
        assert_states_close(resumed["weights"], straight["weights"], atol=0)
        said = [w for w in resumed["warnings"] if "shuffle buffer" in w]
        assert len(said) == 1 and "exact" in said[0], (rank, resumed["warnings"])
    if not stateful:  # on another number of ranks: each rank's stream read again (test_a_split_huggingface_...),
        checkpoint = ranks[0]["checkpoint"]  # or the opt-out, which says what it does
        fit_one_process(str(tmp_path / "one"), checkpoint, shuffle_buffer=6)
        with pytest.warns(
            UserWarning,
            match=r"skips its first 24 samples \(24 in all\), so in this epoch some "
            "samples train twice and as many not at all",
        ):
            fit_one_process(str(tmp_path / "opt-out"), checkpoint, shuffle_buffer=6, restore_loader_state=False)


def body_stream_to_an_epochs_end(root: str, checkpoint: str) -> None:
    trainer = Trainer(
        strategy="ddp",
        devices=2,
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=root,
    )
    log_dir = os.path.join(root, f"rank{dist.get_rank()}")
    os.makedirs(log_dir)
    seed_everything(0)
    trainer.fit(StreamRegression(), stream_loader(log_dir, dist.get_rank(), 2, 0, True))  # 6 batches: one epoch
    trainer.save_checkpoint(checkpoint)


def test_a_stream_checkpoint_at_an_epochs_end_resumes_on_another_number_of_ranks(rank_pool, tmp_path):
    """A checkpoint after an epoch's last batch (here fit's max_steps ends there) leaves nothing of that epoch to
    train: on one rank the next epoch starts the stream afresh, split over the new ranks, each row once."""
    from collections import Counter

    checkpoint = str(tmp_path / "at-the-end")
    rank_pool(2).run(body_stream_to_an_epochs_end, str(tmp_path / "two"), checkpoint)
    os.makedirs(tmp_path / "one" / "rank0")
    trainer = Trainer(
        devices=1,
        max_steps=6 + ROWS // STREAM_BATCH,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path / "one"),
    )
    module = StreamRegression()
    trainer.fit(module, stream_loader(str(tmp_path / "one" / "rank0"), 0, 1, 0, True), ckpt_path=checkpoint)
    assert Counter(module.trained) == {row: 1 for row in range(ROWS)}
    assert (trainer.current_epoch, trainer.global_step) == (1, 6 + ROWS // STREAM_BATCH)


def body_unsplit_stream(root: str) -> list[str]:
    return fit_stream(root, "ddp", 0, True, max_steps=1, split=False)["warnings"]


def test_a_stream_not_split_by_rank_is_reported_in_the_first_step(rank_pool, tmp_path):
    ranks = rank_pool(2).run(body_unsplit_stream, str(tmp_path))
    reported = [w for w in ranks[0] if "same first training batch" in w]
    assert len(reported) == 1 and "split_dataset_by_node" in reported[0], ranks[0]
    assert not [w for w in ranks[1] if "same first training batch" in w]


@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_a_stage_stops_the_persistent_workers_of_its_loaders_when_it_ends(tmp_path, stage):
    """A loader with persistent workers keeps them (and its iterator) between epochs. Once a stage ends the Trainer
    stops them, as Lightning does, instead of leaving them to the garbage collector: that finalizes the iterator at
    any allocation, on one rank, and its worker shutdown then blocked that rank while the other waited in a
    collective (seen in this file's resume test, in the rank pool)."""
    import multiprocessing

    class Validated(Regression):
        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self.training_step(batch, batch_idx))

    loader = DataLoader(Augmented(str(tmp_path)), batch_size=BATCH, num_workers=2, persistent_workers=True)
    trainer = Trainer(
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    if stage == "fit":
        trainer.fit(Validated(), loader, loader)
    else:
        trainer.validate(Validated(), loader)
    assert multiprocessing.active_children() == []


# ------------------------------------------------------------------ LitData's StreamingDataset, in its own format

LIT_ROWS, LIT_BATCH = 48, 2  # global batches of 8: 6 steps an epoch


def _lit_row(index: int) -> dict:
    g = torch.Generator().manual_seed(index)
    return {"idx": index, "x": torch.randn(FEATURES, generator=g), "y": torch.randn(1, generator=g)}


@pytest.fixture(scope="module")
def lit_data(tmp_path_factory) -> str:
    """48 rows written by LitData's own `optimize` (its binary chunks and index.json), 6 rows a chunk."""
    litdata = pytest.importorskip("litdata")
    folder = str(tmp_path_factory.mktemp("litdata") / "rows")
    litdata.optimize(fn=_lit_row, inputs=list(range(LIT_ROWS)), output_dir=folder, chunk_size=6, num_workers=1)
    return folder


class LitRegression(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))  # no dropout: any world size
        self.trained: list[int] = []

    def training_step(self, batch, batch_idx):
        self.trained += batch["idx"].tolist()
        return F.mse_loss(self.net(batch["x"]), batch["y"])


def lit_loader(data: str, workers: int):
    from litdata import StreamingDataLoader, StreamingDataset

    dataset = StreamingDataset(data, shuffle=True, seed=3, drop_last=True)
    return StreamingDataLoader(dataset, batch_size=LIT_BATCH, num_workers=workers)


def fit_library_stream(
    root: str, make_loader, data: str, name: str, workers: int, max_steps: int, ckpt_path: str | None = None
) -> dict:
    """A run on a library's shuffled stream (`make_loader(data, workers)`), which splits itself by rank: the
    weights, every rank's rows trained."""
    from callbacks import ModelCheckpoint

    seed_everything(0)
    loader = make_loader(data, workers)
    saver = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=4, save_top_k=-1, filename="{step}")
    devices = dist.get_world_size() if dist.is_initialized() else 1
    trainer = Trainer(
        strategy=FSDPStrategy() if name == "fsdp" else name,
        devices=devices,
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saver],
        default_root_dir=root,
        global_batch_size=8,
    )
    module = LitRegression()
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    trained = trainer.strategy.all_gather_object(module.trained)
    return {"weights": trainer.strategy.full_state_dict(), "trained": trained}


def fit_lit(root: str, data: str, name: str, workers: int, max_steps: int, ckpt_path: str | None = None) -> dict:
    return fit_library_stream(root, lit_loader, data, name, workers, max_steps, ckpt_path)


def body_lit(root: str, data: str, name: str, workers: int, max_steps: int, ckpt_path: str | None = None) -> dict:
    return fit_lit(os.path.join(root, f"{dist.get_world_size()}"), data, name, workers, max_steps, ckpt_path)


@pytest.mark.parametrize(
    "name, workers, before, after",
    [
        ("ddp", 0, 2, 2),  # the same world size: LitData's own state, exactly
        ("fsdp", 2, 4, 2),  # with workers, 4 -> 2 ranks: LitData's elastic resume
        ("ddp", 0, 2, 1),  # 2 -> 1 rank
    ],
)
def test_litdata_resumes_from_its_own_state_on_fewer_ranks(rank_pool, tmp_path, lit_data, name, workers, before, after):
    """The first epoch's rows: those trained before the checkpoint of step 4 and those after it, each once.
    (LitData 0.2.76 refuses more ranks than the checkpoint's when a rank's share of the epoch would be shorter
    than what each old rank had read: its own ValueError, from the loader.)"""
    from collections import Counter

    straight = rank_pool(before).run(body_lit, str(tmp_path / "straight"), lit_data, name, workers, 12)[0]
    checkpoint = str(tmp_path / "straight" / str(before) / "ckpt" / "step=4")
    if after == 1:
        resumed = fit_lit(str(tmp_path / "resumed"), lit_data, name, workers, 12, checkpoint)
    else:
        resumed = rank_pool(after).run(body_lit, str(tmp_path / "resumed"), lit_data, name, workers, 12, checkpoint)[0]
    trained_before = [i for rank in straight["trained"] for i in rank[: 32 // before]]  # 4 steps of 8 rows
    rest = [i for rank in resumed["trained"] for i in rank[: (LIT_ROWS - 32) // after]]
    assert Counter(trained_before + rest) == {i: 1 for i in range(LIT_ROWS)}, (sorted(trained_before), sorted(rest))
    if after == before:
        assert resumed["trained"] == [rank[32 // before :] for rank in straight["trained"]]
        assert_states_close(resumed["weights"], straight["weights"], atol=0)


# ------------------------------------------------------------------ MosaicML's StreamingDataset, in its MDS format

MDS_ROWS = 48  # 8 shards of 6 rows; global batches of 8: 6 steps an epoch


@pytest.fixture(scope="module")
def mds_data(tmp_path_factory) -> str:
    """48 rows written by MosaicML's own `MDSWriter` (its `.mds` shards and `index.json`), 6 rows a shard."""
    streaming = pytest.importorskip("streaming")
    folder = str(tmp_path_factory.mktemp("mds") / "rows")
    columns = {"idx": "int", "x": f"ndarray:float32:{FEATURES}", "y": "ndarray:float32:1"}
    with streaming.MDSWriter(out=folder, columns=columns, size_limit=6 * 80) as writer:
        for index in range(MDS_ROWS):
            row = _lit_row(index)
            writer.write({"idx": index, "x": row["x"].numpy(), "y": row["y"].numpy()})
    return folder


def mds_loader(data: str, workers: int):
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()  # what an earlier run in this process left behind
    dataset = StreamingDataset(local=data, shuffle=True, shuffle_seed=3, batch_size=LIT_BATCH)
    return StreamingDataLoader(dataset, batch_size=LIT_BATCH, num_workers=workers)


def fit_mds(root: str, data: str, name: str, workers: int, max_steps: int, ckpt_path: str | None = None) -> dict:
    return fit_library_stream(root, mds_loader, data, name, workers, max_steps, ckpt_path)


def body_mds(root: str, data: str, name: str, workers: int, max_steps: int, ckpt_path: str | None = None) -> dict:
    return fit_mds(os.path.join(root, f"{dist.get_world_size()}"), data, name, workers, max_steps, ckpt_path)


@pytest.mark.parametrize(
    "name, workers, before, after",
    [
        ("ddp", 0, 2, 2),  # the same world size: MosaicML's own state, exactly
        ("zero2", 2, 2, 2),
        ("hsdp", 0, 2, 2),
        ("fsdp", 2, 4, 2),  # with workers, 4 -> 2 ranks: MosaicML's elastic resume
        ("zero2", 0, 2, 4),  # 2 -> 4 ranks
        ("ddp", 0, 2, 1),  # 2 -> 1 rank
    ],
)
def test_mosaicml_streaming_resumes_from_its_own_state(rank_pool, tmp_path, mds_data, name, workers, before, after):
    """The first epoch's rows: those trained before the checkpoint of step 4 and those after it, each once; at the
    same world size, the uninterrupted run's rows and weights exactly."""
    from collections import Counter

    straight = rank_pool(before).run(body_mds, str(tmp_path / "straight"), mds_data, name, workers, 12)[0]
    checkpoint = str(tmp_path / "straight" / str(before) / "ckpt" / "step=4")
    if after == 1:
        resumed = fit_mds(str(tmp_path / "resumed"), mds_data, name, workers, 12, checkpoint)
    else:
        resumed = rank_pool(after).run(body_mds, str(tmp_path / "resumed"), mds_data, name, workers, 12, checkpoint)[0]
    trained_before = [i for rank in straight["trained"] for i in rank[: 32 // before]]  # 4 steps of 8 rows
    rest = [i for rank in resumed["trained"] for i in rank[: (MDS_ROWS - 32) // after]]
    assert Counter(trained_before + rest) == {i: 1 for i in range(MDS_ROWS)}, (sorted(trained_before), sorted(rest))
    if after == before:
        assert resumed["trained"] == [rank[32 // before :] for rank in straight["trained"]]
        assert_states_close(resumed["weights"], straight["weights"], atol=0)


# ------------------------------------------------------------------ a HuggingFace stream on another number of ranks

ELASTIC_GLOBAL_BATCH = 12  # 3 optimizer steps an epoch of 36 rows, at any number of ranks


class ElasticStreamRegression(StreamRegression):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))  # no dropout: any world size

    def training_step(self, batch, batch_idx):
        self.trained += [(self.trainer.current_epoch, i) for i in batch["idx"].tolist()]
        return F.mse_loss(self.net(batch["x"]), batch["y"])

    def on_train_epoch_end(self) -> None:
        if self.trainer.current_epoch == 0:  # the next epoch splits the stream as its number of ranks does
            self.first_epoch_weights = self.trainer.strategy.full_state_dict()


def fit_elastic_stream(
    root: str, name: str, workers: int, stateful: bool, buffer: int | None, ckpt: str | None
) -> dict:
    """A run of 6 steps (two epochs) on the split stream at this pool's number of ranks, a checkpoint every step."""
    from callbacks import ModelCheckpoint

    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    root = os.path.join(root, str(world_size))
    log_dir = os.path.join(root, f"rank{rank}")
    os.makedirs(log_dir)
    seed_everything(0)
    saver = ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = Trainer(
        strategy=FSDPStrategy() if name == "fsdp" else name,
        devices=world_size,
        max_steps=6,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[saver],
        default_root_dir=root,
        global_batch_size=ELASTIC_GLOBAL_BATCH,
    )
    module = ElasticStreamRegression()
    loader = stream_loader(log_dir, rank, world_size, workers, stateful, shuffle_buffer=buffer)
    trainer.fit(module, loader, ckpt_path=ckpt)
    return {"weights": module.first_epoch_weights, "trained": trainer.strategy.all_gather_object(module.trained)}


def _rows_of_epoch(epoch: int, runs: list[tuple[dict, int | None]]) -> list[int]:
    """An epoch's rows trained by each run, over all its ranks: each rank's first `rows` (None: all)."""
    trained = []
    for run, rows in runs:
        for ranks_rows in run["trained"]:
            epoch_rows = [i for e, i in ranks_rows if e == epoch]
            trained += epoch_rows[:rows]
    return trained


@pytest.mark.parametrize(
    "name, workers, stateful, buffer, before, after",
    [
        ("ddp", 0, False, None, 2, 1),  # the dataset's own state, no workers: two ranks' parts read by one
        ("fsdp", 2, True, None, 2, 4),  # torchdata's StatefulDataLoader and its workers: parts dealt to two ranks
        ("zero2", 0, False, 6, 4, 2),  # a shuffle buffer: each old rank's stream read again and skipped
    ],
)
def test_a_split_huggingface_stream_resumes_on_another_number_of_ranks(
    rank_pool, tmp_path, name, workers, stateful, buffer, before, after
):
    """A checkpoint after step 1 (12 of the epoch's 36 rows), resumed on another number of ranks with the same
    global batch: every row of the epoch trained once, the epoch ends with the uninterrupted run's weights, and the
    next epoch reads the stream as split for the new number of ranks, each row once. Then a checkpoint written
    inside that resumed epoch, resumed on a third number of ranks: the same."""
    from collections import Counter

    def run(ranks: int, root: str, ckpt: str | None) -> dict:
        if ranks == 1:
            return fit_elastic_stream(str(tmp_path / root), name, workers, stateful, buffer, ckpt)
        return rank_pool(ranks).run(fit_elastic_stream, str(tmp_path / root), name, workers, stateful, buffer, ckpt)[0]

    every_row_once = {i: 1 for i in range(ROWS)}
    straight = run(before, "straight", None)
    resumed = run(after, "resumed", str(tmp_path / "straight" / str(before) / "ckpt" / "step=1"))
    before_rows, after_rows = ELASTIC_GLOBAL_BATCH // before, ELASTIC_GLOBAL_BATCH // after  # each rank's, a step
    assert Counter(_rows_of_epoch(0, [(straight, before_rows), (resumed, None)])) == every_row_once
    assert Counter(_rows_of_epoch(1, [(resumed, None)])) == every_row_once
    assert_states_close(resumed["weights"], straight["weights"], atol=1e-5)
    third = 1 if after != 1 else 4
    again = run(third, "again", str(tmp_path / "resumed" / str(after) / "ckpt" / "step=2"))
    runs = [(straight, before_rows), (resumed, after_rows), (again, None)]
    assert Counter(_rows_of_epoch(0, runs)) == every_row_once
    assert_states_close(again["weights"], straight["weights"], atol=1e-5)


@pytest.mark.parametrize("old, new", [(2, 1), (4, 2), (4, 3), (2, 4), (2, 3), (3, 8), (4, 4)])
def test_the_old_ranks_remainders_are_dealt_to_the_new_ranks_each_batch_once(old, new):
    """Every batch of every old rank's remainder goes to exactly one new rank, whatever the two sizes."""
    from collections import Counter

    from trainer.data.stream_remainder import old_ranks_of

    batches = 12  # of each old rank's remainder
    taken = Counter()
    for rank in range(new):
        for part, turn, sharing in old_ranks_of(old, new, rank):
            taken.update((part, b) for b in range(batches) if b % sharing == turn)
    assert taken == {(part, b): 1 for part in range(old) for b in range(batches)}
