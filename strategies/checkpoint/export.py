"""Checkpoints out to one plain file and to safetensors in HuggingFace's layout, and weights in from safetensors.

Out, in one process: a batch of tensors at a time is read from the checkpoint and written into a file whose
layout was written first, so no process ever holds the whole model. In, under any strategy: each rank reads
only the slices of the safetensors files that fall in its own pieces (DCP's HuggingFaceStorageReader), so a
model built on the meta device is never materialized whole.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from ..sharding import FlatPieces
from ..sharding.state_dict import ModelShards
from .checkpointer import read_meta_item
from .format import META, MODEL, unwrapped
from .planners import ShardLoadPlanner
from .source import Source, open_source
from .streamed_file import StreamedFullFile
from .whole import assemble, tied_keys, weight_keys

BATCH_BYTES = 64 << 20  # read about this much of a checkpoint at a time
SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


# ---- one plain file ----------------------------------------------------------------------------------------
def consolidate(
    path: str | os.PathLike, out: str | os.PathLike, with_optimizer: bool = False, trust_pickled: bool = False
) -> None:
    """Write any checkpoint as one plain file that `torch.load` reads, in one process.

    The file is streamed: tensors are read and written a batch at a time, so the whole model is never held in
    memory.

    Args:
        path: the checkpoint directory or file.
        out: the file to write.
        with_optimizer: write everything (the same as `save_checkpoint(path, full=True)` writes) instead of only
            the model's state dict.
        trust_pickled: unpickle whatever the checkpoint holds (only for a checkpoint whose writer you trust).

    Raises:
        FileNotFoundError: if `path` is neither a file nor an existing directory.
        CheckpointError: if the checkpoint is incomplete, corrupted (a file fails its size or checksum check),
            of another format version, or a file that holds neither a state dict nor a full checkpoint; without
            `trust_pickled`, if what it reads holds pickled objects of types outside the allow-list.
    """
    source = open_source(path, trust_pickled)
    meta = read_meta_item(source)
    tied = tied_keys(meta)  # a full file holds them: tied again
    keys = [k for k, p in source.paths.items() if k not in tied and (with_optimizer or p[0] in (MODEL, META))]
    objects = source.read({k: None for k in keys if k not in source.tensors})
    placeholders = {
        k: torch.empty(source.tensors[k].shape, dtype=source.tensors[k].dtype)  # not resident
        for k in keys
        if k in source.tensors
    }
    nested = assemble(source, {**objects, **placeholders})
    skeleton = nested if with_optimizer else nested[MODEL]
    where = {k: source.paths[k] if with_optimizer else source.paths[k][1:] for k in placeholders}
    writer = StreamedFullFile(out, skeleton, set(where.values()), trust_pickled)
    del skeleton, nested
    try:
        for batch in _batches(source, list(placeholders)):
            for key, tensor in batch.items():
                writer.fill(where[key], tensor)
    except BaseException:
        writer.abort()
        raise
    writer.commit()


def _batches(source: Source, keys: list[str]) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of `keys` in full, read a batch of about BATCH_BYTES at a time."""
    batch: list[str] = []
    size = 0
    for key in [*keys, None]:
        if key is not None:
            meta = source.tensors[key]
            batch.append(key)
            size += meta.numel() * meta.element_size()
        if batch and (key is None or size >= BATCH_BYTES):
            plain = {k: torch.empty(source.tensors[k].shape, dtype=source.tensors[k].dtype) for k in batch}
            read = source.read(plain)
            yield read
            read.clear()  # the consumer's reference too: only one batch is ever held
            plain.clear()
            batch, size = [], 0


# ---- safetensors out -----------------------------------------------------------------------------------------
def export_safetensors(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    prefix: str = "",
    max_shard_size: int = 5 * 10**9,
    ema: bool = False,
    trainable_only: bool = False,
    trust_pickled: bool = False,
) -> list[str]:
    """Write a checkpoint's weights as safetensors in HuggingFace's layout, in one process, a batch at a time.

    The output is `model.safetensors` or, above `max_shard_size` bytes, `model-0000k-of-0000n.safetensors` files
    and `model.safetensors.index.json`. Tied names are written once, under the first.

    Args:
        path: the checkpoint directory or file.
        out_dir: the folder to write (made if missing).
        prefix: only names that start with it are written, without it (e.g. `"model."` for a HuggingFace model
            held as `self.model`).
        max_shard_size: the most bytes per file.
        ema: write `callbacks.EMA`'s average in place of each parameter it averages.
        trainable_only: write only the parameters that were trained (an adapter's, say).
        trust_pickled: unpickle whatever the checkpoint holds (only for a checkpoint whose writer you trust).

    Returns:
        The names left out for not starting with `prefix`.

    Raises:
        FileNotFoundError: if `path` is neither a file nor an existing directory.
        CheckpointError: if the checkpoint is incomplete, corrupted (a file fails its size or checksum check),
            of another format version, or a file that holds neither a state dict nor a full checkpoint; without
            `trust_pickled`, if what it reads holds pickled objects of types outside the allow-list.
        ValueError: with `ema=True`, if the checkpoint holds no EMA weights; with `trainable_only=True`, if it
            does not record which parameters were trainable; for a dtype safetensors does not have.
    """
    source = open_source(path, trust_pickled)
    meta = read_meta_item(source)
    reads = {
        source.paths[k][1]: read for k, read in weight_keys(source, meta, path, ema).items() if k in source.tensors
    }
    if trainable_only:
        reads = {name: read for name, read in reads.items() if name in _trainable(meta, path)}
    order = {name: i for i, name in enumerate(meta.get("state_dict_keys", []))}
    names = sorted(reads, key=lambda n: order.get(n, len(order)))
    kept = [(n.removeprefix(prefix), reads[n]) for n in names if n.startswith(prefix)]
    shards = _shards([(name, source.tensors[key]) for name, key in kept], max_shard_size)
    os.makedirs(out_dir, exist_ok=True)
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    keys = dict(kept)
    for file, shard in zip(files, shards):
        _write_safetensors(os.path.join(out_dir, file), source, [(name, keys[name]) for name in shard])
    if len(files) > 1:
        total = sum(source.tensors[key].numel() * source.tensors[key].element_size() for _, key in kept)
        index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, s in zip(files, shards) for n in s}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    return [n for n in names if not n.startswith(prefix)]


def _trainable(meta: dict[str, Any], path: Any) -> set[str]:
    if "trainable" not in meta:
        raise ValueError(
            f"checkpoint {os.fspath(path)!r} does not record which parameters were trainable (it was "
            "written by an older version); leave out trainable_only (--trainable-only)"
        )
    return set(meta["trainable"])


def _shards(tensors: list[tuple[str, torch.Tensor]], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, meta in tensors:
        nbytes = meta.numel() * meta.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_safetensors(file: str, source: Source, entries: list[tuple[str, str]]) -> None:
    """One safetensors file: its header (every tensor's dtype, shape and place) first, then each tensor's bytes
    as it is read; written aside and renamed into place."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, key in entries:
        meta = source.tensors[key]
        if meta.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: safetensors has no dtype {meta.dtype}")
        nbytes = meta.numel() * meta.element_size()
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[meta.dtype],
            "shape": list(meta.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    tmp = f"{file}.tmp"
    with open(tmp, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little") + encoded)
        for batch in _batches(source, [key for _, key in entries]):
            for tensor in batch.values():
                f.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, file)


# ---- safetensors in ------------------------------------------------------------------------------------------
def load_safetensors(
    trainer: Any,
    path: str | os.PathLike,
    prefix: str = "",
    key_mapping: dict[str, str] | None = None,
    strict: bool = True,
) -> list[str]:
    """Load weights from safetensors files in HuggingFace's layout into the trainer's model, under any strategy.

    Every rank reads only the slices that fall in its own pieces, so a model built on the meta device is never
    materialized whole. Call it on every rank once the model is set up (for example in `on_fit_start`).

    Args:
        trainer: the Trainer whose module is set up (any object whose `strategy` has set the model up).
        path: a folder of safetensors files, or the only safetensors file of its folder.
        prefix: `prefix` + a name in the files is the model's name (`"model."` for a HuggingFace model held as
            `self.model`); the model's entries without it are not loaded.
        key_mapping: `{regular expression: replacement}`, as in transformers' `from_pretrained`, turning the
            model's names (without `prefix`) into the files' (`{r"\\.base_layer\\.": "."}` for a peft model, whose
            wrapped layers keep the pretrained weight as `base_layer.weight`).
        strict: every parameter must be in the files. With `False` the parameters the files lack keep their
            values (new LoRA adapters, say).

    Returns:
        The names of the parameters the files lack (empty with `strict=True`), as torch's `load_state_dict`
        returns them.

    Raises:
        ValueError: if `path` is not a folder of safetensors files or the only one of its folder; if a
            parameter's shape differs from the file's, or (with `strict=True`) a parameter is missing.
    """
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    folder = _safetensors_folder(os.fspath(path))
    reader = HuggingFaceStorageReader(folder)
    saved = reader.read_metadata().state_dict_metadata
    model = trainer.strategy.model_state()
    in_files = _file_names(model.shapes(), prefix, key_mapping)
    missing = _check_pretrained(model, saved, in_files, path, prefix, strict)
    plain, shards = {}, {}
    targets = model.load_targets({})
    for name, target in targets.items():
        if in_files.get(name) in saved:
            (shards if isinstance(target, FlatPieces) else plain)[in_files[name]] = target
    with unwrapped():
        dcp.load(plain, storage_reader=reader, planner=ShardLoadPlanner(shards), no_dist=True)
    model.load_state_dict(targets)
    return missing


def _file_names(names: Any, prefix: str, key_mapping: dict[str, str] | None) -> dict[str, str]:
    """The name in the files of each of the model's state-dict entries that starts with `prefix`."""
    out = {}
    for name in names:
        if name.startswith(prefix):
            mapped = name.removeprefix(prefix)
            for pattern, replacement in (key_mapping or {}).items():
                mapped = re.sub(pattern, replacement, mapped)
            out[name] = mapped
    return out


def _safetensors_folder(path: str) -> str:
    if os.path.isdir(path):
        return path
    folder = os.path.dirname(os.path.abspath(path))
    others = [n for n in os.listdir(folder) if n.endswith(".safetensors") and n != os.path.basename(path)]
    if not os.path.isfile(path) or others:
        raise ValueError(
            f"load_safetensors: path={path!r} must be a folder of safetensors files, or the only "
            "safetensors file of its folder"
        )
    return folder


def _check_pretrained(
    model: ModelShards, saved: dict[str, Any], in_files: dict[str, str], path: Any, prefix: str, strict: bool
) -> list[str]:
    """Every parameter of the model must be in the files with its shape (buffers are loaded where present; with
    `strict=False` parameters may be missing: their names are returned)."""
    aliases = model.aliases()
    params = {name for name, _ in model.module.named_parameters()}
    problems, missing = [], []
    for name, (shape, _) in model.shapes().items():
        stored = saved.get(in_files[name]) if name in in_files else None
        if name in aliases or (stored is None and name not in params):
            continue
        if stored is None:
            missing.append(name)
        elif list(stored.size) != list(shape):
            problems.append(f"shape of {name}: safetensors {list(stored.size)}, model {list(shape)}")
    problems += [f"missing: {name}" for name in missing] if strict else []
    if problems:
        raise ValueError(
            f"load_safetensors({os.fspath(path)!r}, prefix={prefix!r}) does not fit this model:\n  "
            + "\n  ".join(problems)
        )
    return missing
