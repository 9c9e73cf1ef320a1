"""Checkpoints on real ranks and real files: the directory format (torch's DCP plus our integrity metadata),
exact resume, resharding between strategies and world sizes, `last`, corruption, the consolidate tool and checks
against the model, and reading them with torch's own tools (async saves: test_checkpoint_async.py, safetensors:
test_safetensors.py)."""

from __future__ import annotations

import collections
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback, ModelCheckpoint
from strategies import FSDPStrategy, ZeroStrategy, get_strategy
from strategies.checkpoint import format as ckpt_format
from strategies.checkpoint.planners import ShardLoadPlanner
from strategies.checkpoint.streamed_file import StreamedFullFile
from tests.ranks import ROOT
from trainer import Trainer, TrainModule, seed_everything
from trainer import checkpoint as ckpt_io

VOCAB, DIM, SEQ = 11, 6, 5
SAMPLES, GLOBAL_BATCH = 48, 12  # 4 optimizer steps per epoch at any world size that divides 12
SHARDED = ("zero1", "zero2", "fsdp")


# -- model, data, trainer ----------------------------------------------------------------------------------
class TiedNet(nn.Module):
    """175 parameters (uneven over 2 and 3 ranks), a head tied to the embedding, and a buffer that counts."""

    def __init__(self, hidden: int = 7, dropout: float = 0.0, extra: bool = False, norm: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = nn.Sequential(nn.Linear(DIM, hidden), nn.Tanh(), nn.Dropout(dropout), nn.Linear(hidden, DIM))
        self.norm = nn.LayerNorm(DIM) if norm else nn.Identity()
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
    """A name of get_strategy, or "hsdp2" / "zero2-hybrid2": hybrid sharding in groups of 2 ranks."""
    if name == "fsdp":
        return FSDPStrategy(auto_wrap_policy={nn.Sequential})
    if name == "hsdp2":
        return FSDPStrategy(auto_wrap_policy={nn.Sequential}, hybrid_shard=2)
    if name == "zero2-hybrid2":
        return ZeroStrategy(stage=2, hybrid_shard=2)
    return get_strategy(name)


def make_trainer(root: str, strategy: str, devices: int, max_steps: int, **kwargs) -> Trainer:
    options = dict(
        logger=False, enable_progress_bar=False, enable_checkpointing=False, deterministic=True, default_root_dir=root
    )
    return Trainer(strategy=make_strategy(strategy), devices=devices, max_steps=max_steps, **{**options, **kwargs})


def fit(
    root: str,
    strategy: str,
    devices: int,
    max_steps: int,
    ckpt_path: str | None = None,
    save_to: str | None = None,
    module_kwargs: dict | None = None,
    **kwargs,
) -> tuple[Trainer, LM]:
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
    return ckpt_io.load_checkpoint(path)["optim"]["state"]


def assert_states_close(a: dict, b: dict, atol: float) -> None:
    assert list(a) == list(b)
    for key in a:
        if isinstance(a[key], dict):
            assert_states_close(a[key], b[key], atol)
        else:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=lambda m, k=key: f"{k}: {m}")


def keeps_determinism_setting(body: Callable) -> Callable:
    """Trainer(deterministic=True) switches torch to deterministic algorithms for the whole process; a body
    run on the shared rank pool switches it back so that later tests see the workers as they were."""

    @functools.wraps(body)
    def run(*args, **kwargs):
        before = torch.are_deterministic_algorithms_enabled()
        try:
            return body(*args, **kwargs)
        finally:
            torch.use_deterministic_algorithms(before)

    return run


@pytest.fixture(autouse=True)
def _restore_determinism():
    before = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(before)


# -- the format: every strategy at two ranks, read back with no process group --------------------------------
@keeps_determinism_setting
def _save_body(root: str, strategy: str) -> dict | None:
    trainer, module = fit(root, strategy, 2, max_steps=3, save_to=os.path.join(root, strategy))
    full = trainer.strategy.full_state_dict()
    keys = list(module.state_dict(keep_vars=True))  # under fsdp reading them is refused
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
    assert sorted(os.listdir(path)) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.json"]
    assert not [n for n in os.listdir(root) if ".tmp-" in n or ".old-" in n]

    state = ckpt_io.load_full_state_dict(path)
    assert list(state) == expected[strategy]["keys"] == list(expected[strategy]["full"])
    assert_states_close(state, expected[strategy]["full"], atol=0)
    assert state["net.head.weight"].data_ptr() == state["net.embed.weight"].data_ptr()  # the tie survives
    assert state["net.seen"].item() == 3  # buffers too

    meta = ckpt_io.read_meta(path)
    assert (meta["world_size"], meta["global_step"]) == (2, 3)
    assert ckpt_io.load_checkpoint(path)["meta"]["aliases"] == {"net.head.weight": "net.embed.weight"}
    chunks = stored_chunks(path)
    assert "model.net.head.weight" not in chunks  # a tied parameter is written once, under its first name
    for name, tensor in state.items():
        if name == "net.head.weight":
            continue
        # Written once in all (no chunk twice, even for replicated parameters), as rectangular chunks of the
        # original tensor that together cover it
        assert sum(math.prod(sizes) for _, sizes, _ in chunks[f"model.{name}"]) == tensor.numel(), name
    files = {file for entries in chunks.values() for _, _, file in entries}
    assert files == {"__0_0.distcp", "__1_0.distcp"}  # each rank writes its own pieces, ddp included
    # 175 parameters over 2 ranks: a parameter whose flat slice starts or ends inside a row is written as
    # several chunks (at most 3 for a matrix), each within one rank's pieces
    split = [n for n, c in chunks.items() if n.startswith("model.") and len({f for *_, f in c}) == 2]
    assert split and all(len(chunks[n]) <= 4 for n in split)


def stored_chunks(path: str) -> dict[str, list[tuple[tuple, tuple, str]]]:
    """(offsets, sizes, file) of every chunk of every tensor of a DCP checkpoint, from its metadata."""
    metadata = FileSystemReader(path).read_metadata()
    out = collections.defaultdict(list)
    for index, info in metadata.storage_data.items():
        if index.offset is not None:
            chunk = next(c for c in metadata.state_dict_metadata[index.fqn].chunks if c.offsets == index.offset)
            out[index.fqn].append((tuple(chunk.offsets), tuple(chunk.sizes), info.relative_path))
    return dict(out)


def test_sharded_checkpoints_hold_the_same_optimizer_state_as_ddp(saved):
    root, _ = saved
    reference = optimizer_state(os.path.join(root, "ddp"))
    assert set(reference) == {
        "net.embed.weight",
        "net.block.0.weight",
        "net.block.0.bias",
        "net.block.3.weight",
        "net.block.3.bias",
        "net.norm.weight",
        "net.norm.bias",
    }
    for strategy in SHARDED:
        state = optimizer_state(os.path.join(root, strategy))
        assert sorted(state) == sorted(reference)
        for name in reference:
            assert state[name]["exp_avg"].shape == reference[name]["exp_avg"].shape
            assert float(state[name]["step"]) == 3.0
        assert_states_close({k: state[k] for k in reference}, reference, atol=1e-6)


# -- read by torch's own tools, in one process with no process group ---------------------------------------
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled, unavailable or uninitialized")
def test_torch_reads_the_checkpoint_with_its_own_tools_and_keys(saved, tmp_path):
    """What tools that read torchtitan/FSDP2 checkpoints do: dcp_to_torch_save, and dcp.load into a plain state
    dict of full tensors. Model and optimizer are keyed as torch's get_state_dict keys them, saved as
    {"model": ..., "optim": ...}."""
    root, expected = saved
    path = os.path.join(root, "fsdp")
    full = {k: v for k, v in expected["fsdp"]["full"].items() if k != "net.head.weight"}  # tied: stored once
    reference = optimizer_state(os.path.join(root, "ddp"))

    dcp_to_torch_save(path, tmp_path / "converted.pt")
    converted = torch.load(tmp_path / "converted.pt", weights_only=False)
    assert set(converted) == {"model", "optim", "trainer", "rng", "meta"}
    assert set(converted["model"]) == set(full)
    assert_states_close({k: converted["model"][k] for k in full}, full, atol=0)
    state = converted["optim"]["state"]
    assert_states_close({k: {e: state[k][e] for e in reference[k]} for k in reference}, reference, atol=1e-6)
    assert converted["optim"]["param_groups"][0]["params"] == [k for k in full if k != "net.seen"]
    assert converted["trainer"]["state"]["global_step"] == 3 and sorted(converted["rng"]) == ["0", "1"]

    plain = {
        "model": {k: torch.empty_like(v) for k, v in full.items()},
        "optim": {"state": {k: {"exp_avg": torch.empty_like(full[k]), "step": torch.tensor(0.0)} for k in reference}},
    }
    dcp.load(plain, checkpoint_id=path)
    assert_states_close(plain["model"], full, atol=0)
    for name, entries in plain["optim"]["state"].items():
        torch.testing.assert_close(entries["exp_avg"], reference[name]["exp_avg"], rtol=0, atol=1e-6)
        assert float(entries["step"]) == 3.0

    # The same keys, shapes and dtypes as dcp.save writes for get_state_dict of the same model and optimizer.
    module = LM()
    optimizer, _ = module.configure_optimizers()
    module.training_step(next(iter(loader())), 0).backward()
    optimizer.step()
    model_sd, optim_sd = get_state_dict(module, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "torch")
    theirs = FileSystemReader(tmp_path / "torch").read_metadata().state_dict_metadata
    ours = FileSystemReader(path).read_metadata().state_dict_metadata
    assert set(ours) == set(theirs) - {"model.net.head.weight"} | {"trainer", "rng.0", "rng.1", "meta"}
    for key, value in theirs.items():
        if isinstance(value, TensorStorageMetadata) and key in ours:
            assert (ours[key].size, ours[key].properties.dtype) == (value.size, value.properties.dtype), key


@keeps_determinism_setting
def _reads_body(root: str, source: str) -> dict:
    """Resume fsdp at 2 ranks from `source`, counting what this rank reads."""
    touched, copied = set(), collections.Counter()
    real_read_item, real_resolve = ckpt_format.VerifiedReader.read_item, ShardLoadPlanner.resolve_tensor

    def read_item(self, stream, relative_path, info):
        touched.add((relative_path, info.offset, info.length))
        return real_read_item(self, stream, relative_path, info)

    def resolve_tensor(self, read_item):
        if read_item.dest_index.fqn in self.shards:  # pieces of parameters and element-wise state
            copied[read_item.dest_index.fqn.split(".")[0]] += math.prod(read_item.lengths)
        return real_resolve(self, read_item)

    ckpt_format.VerifiedReader.read_item, ShardLoadPlanner.resolve_tensor = read_item, resolve_tensor
    try:
        trainer, _ = fit(os.path.join(root, f"reads-{os.path.basename(source)}"), "fsdp", 2, 4, ckpt_path=source)
    finally:
        ckpt_format.VerifiedReader.read_item, ShardLoadPlanner.resolve_tensor = real_read_item, real_resolve
    own = sum(piece.numel for unit in trainer.strategy.engine.units for piece in unit.pieces)
    return {"touched": touched, "copied": dict(copied), "own": own, "rank": trainer.global_rank}


def test_each_rank_reads_only_the_chunks_that_overlap_its_pieces(saved, rank_pool):
    root, _ = saved
    for source in ("fsdp", "ddp"):
        path = os.path.join(root, source)
        chunks = _tensor_items(path)
        results = rank_pool(2).run(_reads_body, root, path)
        for result in results:
            # exactly its own pieces of the weights and of both Adam states: no other element is copied
            assert result["copied"] == {"model": result["own"], "optim": 2 * result["own"]}, source
            tensors = {(file, offset) for file, offset, _ in result["touched"]} & set(chunks)
            assert tensors and len(tensors) < len(chunks)
            if source == "fsdp":  # the same layout: a rank reads its own file's chunks and no other's
                tensors = {
                    item
                    for item in tensors
                    if chunks[item].endswith(("exp_avg", "exp_avg_sq"))
                    or chunks[item].startswith("model.net.")
                    and chunks[item] != "model.net.seen"
                }
                assert {file for file, _ in tensors} == {f"__{result['rank']}_0.distcp"}


def _tensor_items(path: str) -> dict[tuple[str, int], str]:
    """The key of every stored tensor item (chunk) of a DCP checkpoint, by (file, offset)."""
    storage = FileSystemReader(path).read_metadata().storage_data
    return {(info.relative_path, info.offset): index.fqn for index, info in storage.items() if index.offset is not None}


# -- the consolidate tool -------------------------------------------------------------------------------------
def test_consolidate_cli_writes_plain_files_torch_load_reads(saved, tmp_path):
    root, expected = saved
    source = os.path.join(root, "fsdp")
    env = {**os.environ, "PYTHONPATH": ROOT}
    command = [sys.executable, "-m", "trainer.checkpoint", "consolidate", source, "o.pt", "--with-optimizer"]
    job = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stdout + job.stderr
    assert job.stdout.strip() == "wrote o.pt"
    ckpt_io.main(["consolidate", source, str(tmp_path / "w.pt")])  # the same entry point, in this process
    assert sorted(os.listdir(tmp_path)) == ["o.pt", "w.pt"]

    weights = torch.load(tmp_path / "w.pt", weights_only=True)  # weights only: the model's plain state dict
    model_state = LM().state_dict()
    assert list(weights) == list(model_state)
    assert {k: v.shape for k, v in weights.items()} == {k: v.shape for k, v in model_state.items()}
    assert_states_close(weights, expected["fsdp"]["full"], atol=0)

    # Everything: what torch's dcp_to_torch_save writes (model and optimizer state keyed as torch's
    # get_state_dict keys them), tied names included, in one plain file.
    full = torch.load(tmp_path / "o.pt", weights_only=True)
    assert set(full) == {"model", "optim", "trainer", "rng", "meta"}
    assert_states_close(full["model"], weights, atol=0)
    assert full["model"]["net.head.weight"].data_ptr() == full["model"]["net.embed.weight"].data_ptr()
    optimizer = full["optim"]
    assert_states_close(optimizer["state"], optimizer_state(source), atol=0)
    for name, entries in optimizer["state"].items():
        assert entries["exp_avg"].shape == entries["exp_avg_sq"].shape == model_state[name].shape
    (group,) = optimizer["param_groups"]
    assert group["lr"] == pytest.approx(0.01)
    assert group["params"] == [k for k in model_state if k in optimizer["state"]]  # once each, model order
    assert full["meta"]["optimizers"] == [{"class": "Adam"}]


# -- corruption -------------------------------------------------------------------------------------------
def _flip_byte(path: str, offset: int | None = None) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2 if offset is None else offset)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _item_of(path: str, prefix: str, file: str) -> tuple[int, int]:
    """(offset, length) of a stored item of a key that starts with `prefix` in `file` of a DCP checkpoint."""
    storage = FileSystemReader(path).read_metadata().storage_data
    return next(
        (info.offset, info.length)
        for index, info in storage.items()
        if index.fqn.startswith(prefix) and info.relative_path == file
    )


def test_a_corrupted_or_truncated_file_is_named_and_refused(saved, tmp_path):
    """DCP checks nothing; meta.json keeps each file's size and a checksum of every item in it, and every item
    is checked as it is read."""
    root, _ = saved
    flipped, cut, bad_metadata = str(tmp_path / "flipped"), str(tmp_path / "cut"), str(tmp_path / "bad_metadata")
    for copy in (flipped, cut, bad_metadata):
        shutil.copytree(os.path.join(root, "zero2"), copy)
    offset, length = _item_of(flipped, "model.net.", "__1_0.distcp")  # a weight: read by any load
    _flip_byte(os.path.join(flipped, "__1_0.distcp"), offset + length - 20)
    with open(os.path.join(cut, "__0_0.distcp"), "r+b") as f:
        f.truncate(100)
    _flip_byte(os.path.join(bad_metadata, ".metadata"))

    with pytest.raises(ValueError, match=r"flipped/__1_0\.distcp.*corrupted"):
        ckpt_io.load_full_state_dict(flipped)
    with pytest.raises(ValueError, match=r"cut/__0_0\.distcp.*truncated"):
        ckpt_io.load_full_state_dict(cut)
    with pytest.raises(ValueError, match=r"bad_metadata/\.metadata.*corrupted"):
        ckpt_io.load_full_state_dict(bad_metadata)
    with pytest.raises(ValueError, match=r"flipped/__1_0\.distcp"):
        fit(str(tmp_path), "single", 1, max_steps=4, ckpt_path=flipped)
    with pytest.raises(ValueError, match=r"cut/__0_0\.distcp"):
        ckpt_io.consolidate(cut, str(tmp_path / "out.pt"))
    assert not os.path.exists(tmp_path / "out.pt")
    with pytest.raises(ValueError, match=r"cut/__0_0\.distcp"):  # refused even where only the trainer state is read
        ckpt_io.load_trainer_state(cut)

    os.remove(os.path.join(flipped, "meta.json"))
    with pytest.raises(ValueError, match=r"meta\.json is missing"):
        ckpt_io.load_full_state_dict(flipped)


def _damaged_resume_body(root: str, path: str) -> str:
    """Resume from `path` on this pool's ranks; the error this rank raised."""
    with pytest.raises(ckpt_io.CheckpointError) as raised:
        fit(os.path.join(root, str(dist.get_rank())), "fsdp", 2, max_steps=4, ckpt_path=path)
    return str(raised.value)


def test_a_file_that_only_one_rank_reads_is_named_by_every_rank(saved, rank_pool, tmp_path):
    """Each rank reads and checks its own pieces: the rank that finds a damaged item raises, and the others say
    which rank found what, instead of failing at their next collective with gloo's "connection closed"."""
    root, _ = saved
    flipped = str(tmp_path / "flipped")
    shutil.copytree(os.path.join(root, "fsdp"), flipped)
    offset, length = _item_of(flipped, "model.net.", "__1_0.distcp")  # rank 1's shard of a weight
    _flip_byte(os.path.join(flipped, "__1_0.distcp"), offset + length - 20)
    said = rank_pool(2).run(_damaged_resume_body, str(tmp_path), flipped)
    damaged = re.escape(f"checkpoint file {os.path.join(flipped, '__1_0.distcp')!r} is corrupted")
    assert re.match(damaged, said[1]), said
    assert re.match(r"another rank could not read its part of the checkpoint: rank 1: " + damaged, said[0]), said


def test_the_trainer_state_of_a_weights_only_file_is_refused_by_name(tmp_path):
    weights = str(tmp_path / "weights.pt")
    torch.save(nn.Linear(2, 2).state_dict(), weights)  # a plain state dict: what consolidate writes
    with pytest.raises(ckpt_io.CheckpointError, match=r"weights\.pt' holds weights only: there is no trainer state"):
        ckpt_io.load_trainer_state(weights)


# -- checked against the model before a resume --------------------------------------------------------------
def test_a_checkpoint_of_another_model_lists_every_difference_at_once(saved, tmp_path):
    root, _ = saved
    path = os.path.join(root, "fsdp")
    seed_everything(0)
    module = LM(optimizer="sgd", hidden=8, extra=True, norm=False)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = make_trainer(str(tmp_path), "single", 1, max_steps=1)
    with pytest.raises(ValueError) as error:
        trainer.fit(module, loader(), ckpt_path=path)

    lines = str(error.value).splitlines()
    assert path in lines[0]
    assert sorted(line.strip() for line in lines[1:]) == [
        "class of optimizer 0: checkpoint Adam, module SGD",
        "missing: net.gate.bias",
        "missing: net.gate.weight",
        "shape of net.block.0.bias: checkpoint [7], model [8]",
        "shape of net.block.0.weight: checkpoint [7, 6], model [8, 6]",
        "shape of net.block.3.weight: checkpoint [6, 7], model [6, 8]",
        "unexpected: net.norm.bias",
        "unexpected: net.norm.weight",
    ]
    assert trainer.global_step == 0
    assert_states_close(dict(module.state_dict()), before, atol=0)  # refused before anything was loaded


class GroupedLM(LM):
    """Adam with two parameter groups: `first` and the rest."""

    def __init__(self, first: tuple[str, ...] = ("net.embed.weight",)) -> None:
        super().__init__()
        self.first = first

    def configure_optimizers(self):
        named = dict(self.named_parameters())
        first = [p for n, p in named.items() if n in self.first]
        rest = [p for n, p in named.items() if n not in self.first]
        return torch.optim.Adam([{"params": first, "lr": 0.02}, {"params": rest}], lr=0.01)


def test_different_parameter_groups_are_refused_before_anything_is_loaded(saved, tmp_path):
    root, _ = saved
    seed_everything(0)
    first = make_trainer(str(tmp_path), "single", 1, max_steps=2)
    first.fit(GroupedLM(), loader())
    first.save_checkpoint(tmp_path / "grouped.pt", full=True)  # a full file is checked the same way
    with pytest.raises(ValueError, match=r"save_checkpoint\(full=True\): .* is a directory"):
        first.save_checkpoint(tmp_path, full=True)
    (tmp_path / "a_file").write_text("")
    with pytest.raises(ValueError, match=r"save_checkpoint\(full=True\): cannot make the folder of"):
        first.save_checkpoint(tmp_path / "a_file" / "full.pt", full=True)
    new_file = tmp_path / "new" / "folder" / "full.pt"
    first.save_checkpoint(new_file, full=True)  # its folder is made
    assert ckpt_io.load_full_state_dict(new_file).keys() == first.module.state_dict().keys()

    def refusal(module: LM, path: str) -> list[str]:
        trainer = make_trainer(str(tmp_path), "single", 1, max_steps=3)
        before = {k: v.clone() for k, v in module.state_dict().items()}
        with pytest.raises(ValueError) as error:
            trainer.fit(module, loader(), ckpt_path=path)
        assert trainer.global_step == 0
        assert_states_close(dict(module.state_dict()), before, atol=0)
        return [line.strip() for line in str(error.value).splitlines()[1:]]

    one_group = os.path.join(root, "fsdp")
    assert refusal(GroupedLM(), one_group) == ["parameter groups of optimizer 0: checkpoint 1, module 2"]
    moved = GroupedLM(first=("net.embed.weight", "net.norm.weight"))
    assert refusal(moved, str(tmp_path / "grouped.pt")) == [
        "missing in optimizer 0 group 0: net.norm.weight",
        "unexpected in optimizer 0 group 1: net.norm.weight",
    ]
    ckpt_io.consolidate(os.path.join(root, "fsdp"), str(tmp_path / "weights.pt"))
    with pytest.raises(ValueError, match=r"weights\.pt' holds weights only"):
        fit(str(tmp_path), "single", 1, max_steps=4, ckpt_path=str(tmp_path / "weights.pt"))


def test_a_resume_reads_and_checks_each_item_it_needs_once(saved, tmp_path, monkeypatch):
    """One process resuming a 2-rank checkpoint needs all of it but the other world size's RNG states: it reads
    (and checks) each of those items once."""
    root, _ = saved
    path = os.path.join(root, "zero2")
    read = collections.Counter()
    real_read_item = ckpt_format.VerifiedReader.read_item

    def counting_read_item(self, stream, relative_path, info):
        read[relative_path, info.offset] += 1
        return real_read_item(self, stream, relative_path, info)

    monkeypatch.setattr(ckpt_format.VerifiedReader, "read_item", counting_read_item)
    trainer, _ = fit(str(tmp_path), "single", 1, max_steps=4, ckpt_path=path)
    assert trainer.global_step == 4
    storage = FileSystemReader(path).read_metadata().storage_data
    needed = {(info.relative_path, info.offset) for index, info in storage.items() if not index.fqn.startswith("rng.")}
    assert set(read) == needed and set(read.values()) == {1}


# -- a full checkpoint: one file, gathered unit by unit -------------------------------------------------------
@keeps_determinism_setting
def _full_body(root: str, strategy: str) -> dict | None:
    args = dict(module_kwargs={"dropout": 0.2})
    straight, _ = fit(os.path.join(root, "a"), strategy, 2, 10, **args)
    first, _ = fit(os.path.join(root, "b"), strategy, 2, 6, save_to=os.path.join(root, "dir"), **args)
    first.save_checkpoint(os.path.join(root, "full.pt"), full=True)
    resumed, _ = fit(os.path.join(root, "c"), strategy, 2, 10, ckpt_path=os.path.join(root, "full.pt"), **args)
    return rank_zero(
        resumed,
        {
            "final": straight.strategy.full_state_dict(),
            "step": resumed.global_step,
            "resumed": resumed.strategy.full_state_dict(),
        },
    )


@pytest.mark.parametrize("strategy", ["zero2", "fsdp"])
def test_a_full_checkpoint_is_one_file_that_resumes_exactly(rank_pool, tmp_path, strategy):
    result = rank_pool(2).run(_full_body, str(tmp_path), strategy)[0]
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("full")) == ["full.pt"]

    full = torch.load(tmp_path / "full.pt")  # plain torch.load, weights_only by default
    directory = ckpt_io.load_checkpoint(tmp_path / "dir")
    assert set(full) == set(directory) == {"model", "optim", "trainer", "rng", "meta"}
    assert (full["meta"]["world_size"], full["meta"]["global_step"], sorted(full["rng"])) == (2, 6, ["0", "1"])
    assert_states_close(full["model"], directory["model"], atol=0)
    assert full["model"]["net.head.weight"].data_ptr() == full["model"]["net.embed.weight"].data_ptr()
    from_file = ckpt_io.load_full_state_dict(tmp_path / "full.pt")
    assert_states_close(from_file, directory["model"], atol=0)
    assert from_file["net.head.weight"].data_ptr() == from_file["net.embed.weight"].data_ptr()
    assert full["optim"]["param_groups"] == directory["optim"]["param_groups"]
    assert_states_close(full["optim"]["state"], directory["optim"]["state"], atol=0)
    assert full["meta"] == directory["meta"] and full["meta"]["optimizers"] == [{"class": "Adam"}]
    for rank in ("0", "1"):
        assert torch.equal(full["rng"][rank]["torch"], directory["rng"][rank]["torch"])
        assert full["rng"][rank]["torch"].any()
    for key in ("state", "lr_schedulers", "module_extra"):
        assert full["trainer"][key] == directory["trainer"][key]

    assert result["step"] == 10
    assert_states_close(result["resumed"], result["final"], atol=0)


def test_a_streamed_full_file_refuses_to_commit_with_tensors_never_gathered(tmp_path):
    """A full file is written layout first, then each tensor's bytes as it is read from the checkpoint; a
    tensor whose bytes never came would read as garbage, so the file is not put in place."""
    skeleton = {"state_dict": {"a": torch.empty(4, 3), "b": torch.empty(2)}, "rng": [torch.arange(5)]}
    placeholders = {("state_dict", "a"), ("state_dict", "b")}
    path = tmp_path / "full.pt"

    writer = StreamedFullFile(path, skeleton, placeholders)
    writer.fill(("state_dict", "a"), torch.arange(12.0).view(4, 3))
    with pytest.raises(RuntimeError, match=r"no data was gathered for \[\"\('state_dict', 'b'\)\"\]"):
        writer.commit()
    assert os.listdir(tmp_path) == []

    writer = StreamedFullFile(path, skeleton, placeholders)
    writer.fill(("state_dict", "a"), torch.arange(12.0).view(4, 3))
    writer.fill(("state_dict", "b"), torch.tensor([7.0, 8.0]))
    writer.commit()
    loaded = torch.load(path)
    assert torch.equal(loaded["state_dict"]["a"], torch.arange(12.0).view(4, 3))
    assert torch.equal(loaded["state_dict"]["b"], torch.tensor([7.0, 8.0]))
    assert torch.equal(loaded["rng"][0], torch.arange(5)) and os.listdir(tmp_path) == ["full.pt"]


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
            "scheduler_epoch": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
            "adam_steps": sorted({float(s["step"]) for s in optimizer.state.values()}),
        }


@keeps_determinism_setting
def _resume_body(root: str, strategy: str, devices: int, stop: int, total: int) -> dict | None:
    root = os.path.join(root, f"{strategy}-{stop}")
    args = dict(module_kwargs={"dropout": 0.2})
    straight, _ = fit(os.path.join(root, "a"), strategy, devices, total, **args)
    final = straight.strategy.full_state_dict()
    path = os.path.join(root, "ckpt")
    first, _ = fit(os.path.join(root, "b"), strategy, devices, stop, save_to=path, **args)
    saved = first.strategy.full_state_dict()
    snapshot = Snapshot()
    resumed, _ = fit(os.path.join(root, "c"), strategy, devices, total, ckpt_path=path, callbacks=[snapshot], **args)
    return rank_zero(
        resumed,
        {
            "final": final,
            "saved": saved,
            "start": snapshot.start,
            "path": path,
            "resumed": resumed.strategy.full_state_dict(),
            "step": resumed.global_step,
            "epoch": resumed.current_epoch,
        },
    )


@pytest.mark.parametrize(
    "strategy, devices, stop",
    [
        ("single", 1, 6),  # mid-epoch (4 steps per epoch)
        ("ddp", 2, 4),  # at an epoch boundary
        ("ddp", 2, 6),
        ("zero2", 2, 5),
        ("fsdp", 2, 6),
    ],
)
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


# -- ModelCheckpoint and ckpt_path="last" ---------------------------------------------------------------------
def _plant_incomplete_checkpoints(dirpath: str) -> None:
    """A newer-looking directory without meta.json, and a complete-looking leftover of an interrupted save."""
    shutil.copytree(os.path.join(dirpath, "last"), os.path.join(dirpath, "epoch=9-step=99"))
    os.remove(os.path.join(dirpath, "epoch=9-step=99", "meta.json"))
    shutil.copytree(os.path.join(dirpath, "last"), os.path.join(dirpath, "epoch=9-step=98.tmp-0123abcd"))
    meta_path = os.path.join(dirpath, "epoch=9-step=98.tmp-0123abcd", "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    with open(meta_path, "w") as f:
        json.dump({**meta, "global_step": 98}, f)


@keeps_determinism_setting
def _last_body(root: str) -> dict | None:
    args = dict(module_kwargs={"dropout": 0.2})
    straight, _ = fit(os.path.join(root, "a"), "zero1", 2, 10, **args)
    dirpath = os.path.join(root, "ckpts")

    def saver() -> ModelCheckpoint:
        return ModelCheckpoint(dirpath, every_n_train_steps=3, save_last=True, save_top_k=2)

    # The first run is started as a restarted one would be: "last" finds nothing yet and training starts afresh.
    first, _ = fit(
        os.path.join(root, "b"), "zero1", 2, 7, ckpt_path="last", callbacks=[saver()], enable_checkpointing=True, **args
    )
    listed = sorted(os.listdir(dirpath))
    if first.is_global_zero:
        _plant_incomplete_checkpoints(dirpath)
    first.strategy.barrier()
    snapshot = Snapshot()
    resumed, _ = fit(
        os.path.join(root, "c"),
        "zero1",
        2,
        10,
        ckpt_path="last",
        callbacks=[saver(), snapshot],
        enable_checkpointing=True,
        **args,
    )
    return rank_zero(
        resumed,
        {
            "first_ckpt_path": first.ckpt_path,
            "listed": listed,
            "resumed_from": resumed.ckpt_path,
            "start_step": snapshot.start["global_step"],
            "step": resumed.global_step,
            "final": straight.strategy.full_state_dict(),
            "resumed": resumed.strategy.full_state_dict(),
        },
    )


def test_fit_resumes_from_the_newest_complete_checkpoint_with_last(rank_pool, tmp_path):
    result = rank_pool(2).run(_last_body, str(tmp_path))[0]

    assert result["first_ckpt_path"] is None
    assert result["listed"] == ["epoch=0-step=3", "epoch=1-step=6", "last"]
    dirpath = os.path.realpath(tmp_path / "ckpts")
    assert result["resumed_from"] in (os.path.join(dirpath, "last"), os.path.join(dirpath, "epoch=1-step=6"))
    assert (result["start_step"], result["step"]) == (6, 10)
    assert_states_close(result["resumed"], result["final"], atol=0)
    assert ckpt_io.find_last(dirpath) == os.path.join(dirpath, "last")  # newest complete: step 9's `last`
    assert ckpt_io.load_trainer_state(os.path.join(dirpath, "last"))["state"]["global_step"] == 9


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # resumed at an epoch's end
def test_last_finds_the_checkpoints_of_an_earlier_logger_version(tmp_path):
    """A restarted run logs to a new TensorBoard version; with the default dirpath, "last" must still find
    the checkpoints the previous run wrote under its own version."""
    options = dict(ckpt_path="last", logger=True, enable_checkpointing=True)
    first, _ = fit(str(tmp_path), "single", 1, 5, callbacks=[ModelCheckpoint(every_n_train_steps=2)], **options)
    snapshot = Snapshot()
    with pytest.warns(UserWarning, match="dirpath changed"):
        second, _ = fit(
            str(tmp_path), "single", 1, 6, callbacks=[ModelCheckpoint(every_n_train_steps=2), snapshot], **options
        )

    assert first.ckpt_path is None
    assert os.path.basename(second.log_dir) == "version_1"
    assert second.ckpt_path == os.path.join(os.path.realpath(first.log_dir), "checkpoints", "epoch=0-step=4")
    assert snapshot.start["global_step"] == 4


def test_a_checkpoint_saved_after_validate_resumes_a_fit_that_checkpoints(tmp_path):
    """A checkpoint saved after validate() records the stage it was saved in; resuming fit from it must still be
    a fit (ModelCheckpoint saves only while fitting)."""

    class Validated(LM):
        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val/loss", F.cross_entropy(self.net(x).flatten(0, 1), y.flatten()))

    trainer, module = make_trainer(str(tmp_path), "single", 1, 4), Validated()
    trainer.fit(module, loader())
    trainer.validate(module, loader())
    trainer.save_checkpoint(str(tmp_path / "after_validate"))
    dirpath = tmp_path / "resumed"
    saver = ModelCheckpoint(dirpath=str(dirpath), every_n_train_steps=1)
    resumed, _ = fit(
        str(tmp_path),
        "single",
        1,
        6,
        ckpt_path=str(tmp_path / "after_validate"),
        callbacks=[saver],
        enable_checkpointing=True,
    )
    assert resumed.global_step == 6 and resumed.state.stage == "fit"
    assert os.listdir(dirpath) == ["epoch=1-step=6"]  # saved every step; save_top_k=1 keeps the newest


# -- atomic writes --------------------------------------------------------------------------------------------
def test_a_failed_save_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpts" / "last")
    trainer, _ = fit(str(tmp_path), "single", 1, max_steps=2, save_to=path)
    good = ckpt_io.load_full_state_dict(path)

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt_format, "write_meta", disk_full)  # every file but meta.json is written
    trainer.module.net.embed.weight.data.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        trainer.save_checkpoint(path)
    monkeypatch.undo()

    assert_states_close(ckpt_io.load_full_state_dict(path), good, atol=0)
    assert os.listdir(tmp_path / "ckpts") == ["last"]  # the failed attempt's staging folder is removed
    assert ckpt_io.find_last(str(tmp_path / "ckpts")) == path

    trainer.save_checkpoint(path)  # a good save replaces it
    assert os.listdir(tmp_path / "ckpts") == ["last"]
    assert torch.equal(ckpt_io.load_full_state_dict(path)["net.embed.weight"], good["net.embed.weight"] + 1)


def test_a_crash_while_a_checkpoint_is_replaced_leaves_the_old_one_to_resume(tmp_path):
    """Replacing `last` renames the old one aside, then the new one into place; a crash in between leaves
    only `last.old-*`: it still counts as the newest checkpoint, and the next save removes it."""
    ckpts = tmp_path / "ckpts"
    trainer, _ = fit(str(tmp_path), "single", 1, max_steps=2, save_to=str(ckpts / "last"))
    good = ckpt_io.load_full_state_dict(ckpts / "last")
    os.rename(ckpts / "last", ckpts / "last.old-0123abcd")  # what the crash leaves
    shutil.copytree(ckpts / "last.old-0123abcd", ckpts / "last.tmp-4567cdef")  # and an unfinished staging folder

    found = ckpt_io.find_last(str(ckpts))
    assert found == str(ckpts / "last.old-0123abcd")
    assert_states_close(ckpt_io.load_full_state_dict(found), good, atol=0)

    trainer.save_checkpoint(ckpts / "last")
    assert os.listdir(ckpts) == ["last"] and ckpt_io.find_last(str(ckpts)) == str(ckpts / "last")


# -- resharding: fsdp at 2 -> zero2 at 3 -> ddp at 1 -> fsdp at 4 ---------------------------------------------
class SaveAtStart(Callback):
    """Writes a checkpoint as training starts, i.e. right after `fit` loaded one: what the load produced."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, module) -> None:
        trainer.save_checkpoint(self.path)


@keeps_determinism_setting
def _reshard_phase(root: str, strategy: str, devices: int, source: str | None, max_steps: int) -> None:
    name = f"{strategy}{devices}"
    callbacks = [SaveAtStart(os.path.join(root, f"{name}-loaded"))] if source else []
    fit(
        os.path.join(root, name),
        strategy,
        devices,
        max_steps,
        ckpt_path=source,
        save_to=os.path.join(root, name + "-end"),
        callbacks=callbacks,
        module_kwargs={"optimizer": "sgd"},
    )


def _assert_same_checkpoint_state(a: str, b: str, atol: float) -> None:
    assert_states_close(ckpt_io.load_full_state_dict(a), ckpt_io.load_full_state_dict(b), atol=atol)
    opt_a, opt_b = optimizer_state(a), optimizer_state(b)
    assert sorted(opt_a) == sorted(opt_b) and all("momentum_buffer" in v for v in opt_a.values())
    assert_states_close({k: opt_a[k] for k in opt_b}, opt_b, atol=atol)
    state_a, state_b = ckpt_io.load_trainer_state(a), ckpt_io.load_trainer_state(b)
    assert state_a["state"] == state_b["state"] and state_a["lr_schedulers"] == state_b["lr_schedulers"]


def test_a_checkpoint_moves_between_strategies_and_world_sizes(rank_pool, tmp_path):
    root = str(tmp_path)
    phases = [("fsdp", 2, 3), ("zero2", 3, 6), ("ddp", 1, 9), ("fsdp", 4, 14)]  # 4 steps per epoch
    source = None
    for strategy, devices, max_steps in phases:
        if devices == 1:
            _reshard_phase(root, strategy, devices, source, max_steps)
        else:
            rank_pool(devices).run(_reshard_phase, root, strategy, devices, source, max_steps)
        name = f"{strategy}{devices}"
        meta = ckpt_io.read_meta(os.path.join(root, name + "-end"))
        assert (meta["world_size"], meta["global_step"]) == (devices, max_steps)
        if source is not None:  # loading resharded weights, momentum buffers and trainer state exactly
            _assert_same_checkpoint_state(os.path.join(root, name + "-loaded"), source, atol=0)
        source = os.path.join(root, name + "-end")

    _reshard_phase(root, "single", 1, None, 14)  # the run that was never stopped, in one process
    _assert_same_checkpoint_state(source, os.path.join(root, "single1-end"), atol=1e-5)
