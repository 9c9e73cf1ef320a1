"""Checkpoint directories: written by every rank in parallel, atomically, readable anywhere.

Layout of a checkpoint directory:
  meta.json      format version, world size, strategy, and each file's size and sha256
  rank<r>.pt     rank r's pieces of the model and optimizer state, keyed by parameter name, and its RNG states
  trainer.pt     epoch, step, schedulers, callbacks, loss scale, the module's on_save_checkpoint additions
Files are written into a temporary directory beside the target and renamed into place when every rank has
finished, so a crash during a save never damages an existing checkpoint.

A full checkpoint (`trainer.save_checkpoint(path, full=True)`) is one file that `torch.load` reads:
  {"state_dict": the model's state dict (original names and shapes),
   "optimizers": [{"class", "state": {parameter name: {key: full tensor or scalar}},
                   "param_groups": [hyperparameters and "param_names"]}],
   "trainer": what trainer.pt holds, "rng": [RNG states by rank], "meta": what meta.json holds, less "files"}
`load_checkpoint` returns any checkpoint in this layout. It is written by `StreamedFullFile` as it is gathered.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import uuid
import zipfile
from collections.abc import Iterator
from typing import Any

import torch

FORMAT_VERSION = 1
META = "meta.json"
TRAINER_STATE = "trainer.pt"


class CheckpointError(ValueError):
    pass


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _write(obj: Any, path: str) -> dict[str, Any]:
    torch.save(obj, path)
    return {"size": os.path.getsize(path), "sha256": sha256(path)}


def save_directory(
    path: str,
    rank_state: dict[str, Any],
    trainer_state: dict[str, Any] | None,
    strategy: Any,
    meta: dict[str, Any],
) -> None:
    """Collective: every rank calls it with its own `rank_state`; rank 0 also passes `trainer_state`."""
    path = os.path.abspath(os.fspath(path))
    staging = strategy.broadcast(f"{path}.tmp-{uuid.uuid4().hex[:8]}")
    if strategy.is_global_zero:
        _remove_leftovers(path, ".tmp-")  # staging folders of saves that crashed or were killed
        os.makedirs(staging, exist_ok=False)
    strategy.barrier()
    files = {
        f"rank{strategy.global_rank}.pt": _write(
            rank_state, os.path.join(staging, f"rank{strategy.global_rank}.pt")
        )
    }
    if strategy.is_global_zero:
        files[TRAINER_STATE] = _write(trainer_state, os.path.join(staging, TRAINER_STATE))
    all_files: dict[str, Any] = {}
    for part in strategy.all_gather_object(files):
        all_files.update(part)
    if strategy.is_global_zero:
        meta = {
            "format_version": FORMAT_VERSION,
            "world_size": strategy.world_size,
            **meta,
            "files": all_files,
        }
        with open(os.path.join(staging, META), "w") as f:
            json.dump(meta, f, indent=1)
        _replace_directory(staging, path)
    strategy.barrier()


def _replace_directory(staging: str, path: str) -> None:
    """Move the finished checkpoint into place; an older one at `path` is removed only afterwards. A crash
    between the two renames leaves the older one complete as `path.old-*`, which `find_last` still finds."""
    if os.path.exists(path):
        os.rename(path, f"{path}.old-{uuid.uuid4().hex[:8]}")
    os.rename(staging, path)
    _remove_leftovers(path, ".old-")


def _remove_leftovers(path: str, marker: str) -> None:
    """Remove the folders `<path><marker>*` beside `path`."""
    directory, name = os.path.split(path)
    for entry in os.listdir(directory) if os.path.isdir(directory) else []:
        if entry.startswith(name + marker):
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)


def read_meta(path: str) -> dict[str, Any]:
    path = os.fspath(path)
    meta_path = os.path.join(path, META)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"checkpoint {path!r} does not exist (a checkpoint is a directory with {META})"
        )
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{path!r} is not a complete checkpoint: {META} is missing")
    with open(meta_path) as f:
        return json.load(f)


def load_file(path: str, name: str, meta: dict[str, Any]) -> Any:
    """Load one file of a checkpoint after checking its size and checksum."""
    file_path = os.path.join(path, name)
    expected = meta["files"].get(name)
    if expected is None or not os.path.isfile(file_path):
        raise CheckpointError(f"checkpoint file {file_path!r} is missing")
    if os.path.getsize(file_path) != expected["size"] or sha256(file_path) != expected["sha256"]:
        raise CheckpointError(f"checkpoint file {file_path!r} is corrupted or truncated (checksum mismatch)")
    return torch.load(file_path, map_location="cpu", weights_only=False)


def _rank_files(meta: dict[str, Any]) -> list[str]:
    return sorted((n for n in meta["files"] if n.startswith("rank")), key=lambda n: int(n[4:-3]))


def _assemble(pieces_by_file: list[dict[str, dict[str, Any]]]) -> dict[str, torch.Tensor]:
    """Full tensors from pieces {"shape", "start", "end", "data"} spread over files."""
    full: dict[str, torch.Tensor] = {}
    for pieces in pieces_by_file:
        for name, piece in pieces.items():
            if name not in full:
                numel = 1
                for s in piece["shape"]:
                    numel *= s
                full[name] = torch.empty(numel, dtype=piece["data"].dtype)
            full[name][piece["start"] : piece["end"]] = piece["data"]
    return {name: t.view(pieces_shape(pieces_by_file, name)) for name, t in full.items()}


def pieces_shape(pieces_by_file: list[dict[str, dict[str, Any]]], name: str) -> list[int]:
    return next(p[name]["shape"] for p in pieces_by_file if name in p)


def load_rank_files(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    meta = read_meta(path)
    return meta, [load_file(path, name, meta) for name in _rank_files(meta)]


def load_full_state_dict(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The plain model state dict (original names and shapes) from any checkpoint this project writes (a
    directory, a full file or a consolidated file), in one process with no process group."""
    return load_checkpoint(path, weights_only=True)["state_dict"]


def _full_state_dict(meta: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    state = _assemble([r["model"] for r in ranks])
    for alias, first in meta.get("aliases", {}).items():
        state[alias] = state[first]
    order = meta.get("state_dict_keys") or list(state)
    return {k: state[k] for k in order}


def full_optimizer_state(per_file: list[dict[str, Any]], order: list[str] | None = None) -> dict[str, Any]:
    """One optimizer's {"class", "state", "param_groups"} in full from its pieces in several files: state keyed by
    parameter name; state and each group's names in `order` (the model's state-dict order) when given."""
    state: dict[str, dict[str, Any]] = {}
    for file_state in per_file:
        for name, entries in file_state["state"].items():
            state.setdefault(name, {})
            for key, value in entries.items():
                state[name].setdefault(key, value)
    for name, entries in state.items():
        for key, value in list(entries.items()):
            if isinstance(value, dict) and "start" in value:
                entries[key] = _assemble(
                    [{name: f["state"][name][key]} for f in per_file if name in f["state"]]
                )[name]
    rank = {name: position for position, name in enumerate(order or [])}
    state = {name: state[name] for name in sorted(state, key=lambda n: rank.get(n, len(rank)))}
    groups = [dict(g) for g in per_file[0]["param_groups"]]
    for i, group in enumerate(groups):
        names = list(dict.fromkeys(n for f in per_file for n in f["param_groups"][i]["param_names"]))
        group["param_names"] = sorted(names, key=lambda n: rank.get(n, len(rank)))  # a split one is in 2 files
    return {"class": per_file[0].get("class"), "state": state, "param_groups": groups}


def load_full_optimizer_state(
    ranks: list[dict[str, Any]], index: int, order: list[str] | None = None
) -> tuple[dict[str, Any], list[dict]]:
    """Optimizer `index`'s state in full, keyed by parameter name, and its parameter groups."""
    full = full_optimizer_state([r["optimizers"][index] for r in ranks], order)
    return full["state"], full["param_groups"]


def load_checkpoint(path: str | os.PathLike, weights_only: bool = False) -> dict[str, Any]:
    """Any checkpoint (a directory or one file) in the full-file layout, each file read and verified once.
    With `weights_only`, only "state_dict" and "meta" are filled in. A plain state dict file (from
    `consolidate`) has only "state_dict"."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return _load_full_file(path)
    meta, ranks = load_rank_files(path)
    checkpoint = {"state_dict": _full_state_dict(meta, ranks), "meta": meta}
    if not weights_only:
        order = meta.get("state_dict_keys")
        count = len(ranks[0]["optimizers"])
        checkpoint["optimizers"] = [full_optimizer_state([r["optimizers"][i] for r in ranks], order)
                                    for i in range(count)]
        checkpoint["trainer"] = load_file(path, TRAINER_STATE, meta)
        checkpoint["rng"] = [r["rng"] for r in ranks]
    return checkpoint


def _load_full_file(path: str) -> dict[str, Any]:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:
        message = f"checkpoint file {path!r} cannot be read (truncated or not a checkpoint): {error}"
        raise CheckpointError(message) from error
    if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
        return {"meta": {}, **obj}
    if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return {"state_dict": obj, "meta": {}}
    raise CheckpointError(f"checkpoint file {path!r} holds neither a state dict nor a full checkpoint")


def save_file(obj: Any, path: str | os.PathLike) -> None:
    """torch.save `obj` to `path` atomically: written beside it, then renamed over it."""
    path = os.fspath(path)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class StreamedFullFile:
    """A full checkpoint file written while its tensors are still being gathered, so that the writer holds
    about one unit at a time instead of the whole checkpoint.

    `skeleton` is the checkpoint with every tensor present at its final shape and dtype (the big ones may be
    uninitialised placeholders). torch.save writes its structure with the tensor bytes left blank
    (torch.serialization.skip_data); `fill(key, tensor)` then writes a tensor's bytes where torch.load reads
    them; `commit` checks that every placeholder was filled and renames the file into place.
    Keys are paths into the skeleton: ("state_dict", name), ("optimizers", 0, "state", name, "exp_avg"), ...
    """

    def __init__(self, path: str | os.PathLike, skeleton: Any, placeholders: set[tuple]) -> None:
        self.path = os.fspath(path)
        self.tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:8]}"
        with torch.serialization.skip_data():
            torch.save(skeleton, self.tmp)
        self.offsets = _tensor_offsets(self.tmp)
        # by offset: tied entries share their bytes, so filling one fills all of them
        self.unfilled = {self.offsets[key]: key for key in placeholders if key in self.offsets}
        self.fd = os.open(self.tmp, os.O_WRONLY)
        for key, tensor in _tensor_leaves(skeleton):  # the small tensors already in the skeleton (RNG states, ...)
            if key not in placeholders:
                self.fill(key, tensor)

    def fill(self, key: tuple, tensor: torch.Tensor) -> None:
        if key not in self.offsets:
            return  # an empty tensor: no bytes
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        written = 0
        while written < len(data):
            written += os.pwrite(self.fd, data[written:], self.offsets[key] + written)
        self.unfilled.pop(self.offsets[key], None)

    def commit(self) -> None:
        if self.unfilled:
            self.abort()
            missing = sorted(map(str, self.unfilled.values()))[:5]
            raise RuntimeError(f"full checkpoint {self.path!r}: no data was gathered for {missing}")
        os.fsync(self.fd)
        os.close(self.fd)
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        os.close(self.fd)
        os.remove(self.tmp)


def _tensor_leaves(obj: Any, key: tuple = ()) -> Iterator[tuple[tuple, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield key, obj
    elif isinstance(obj, dict):
        for k, value in obj.items():
            yield from _tensor_leaves(value, (*key, k))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _tensor_leaves(value, (*key, i))


def _tensor_offsets(path: str) -> dict[tuple, int]:
    """Where each tensor's bytes lie in a torch.save file. torch.load(mmap=True) maps the whole file and makes
    every storage a view at its record's offset, so a tensor's address less the mapping's start is its offset;
    the mapping's start follows from the first data record, whose offset the zip directory gives."""
    loaded = torch.load(path, mmap=True, map_location="cpu", weights_only=False)
    addresses = {
        key: t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
        for key, t in _tensor_leaves(loaded)
        if t.numel()
    }
    if not addresses:
        return {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as f:
        records = [info for info in archive.infolist() if "/data/" in info.filename and info.file_size]
        first = min(records, key=lambda info: info.header_offset)
        f.seek(first.header_offset)
        name_length, extra_length = struct.unpack("<HH", f.read(30)[26:30])  # the local file header
        first_data = first.header_offset + 30 + name_length + extra_length
    start = min(addresses.values()) - first_data
    return {key: address - start for key, address in addresses.items()}


def load_trainer_state(path: str | os.PathLike) -> dict[str, Any]:
    path = os.fspath(path)
    if os.path.isfile(path):
        return _load_full_file(path)["trainer"]
    return load_file(path, TRAINER_STATE, read_meta(path))


def find_last(*directories: str) -> str | None:
    """The newest complete checkpoint (one with meta.json) under any of `directories`, by its recorded global
    step (then by time). Staging folders never count; `X.old-*` (left by a crash while X was being replaced)
    counts only while X is missing."""
    found = []
    for directory in directories:
        entries = os.listdir(directory) if os.path.isdir(directory) else []
        for entry in entries:
            full = os.path.join(directory, entry)
            replaced = ".old-" in entry and os.path.exists(full.rsplit(".old-", 1)[0])
            if ".tmp-" in entry or replaced or not os.path.isfile(os.path.join(full, META)):
                continue
            meta = read_meta(full)
            found.append((meta.get("global_step", -1), os.path.getmtime(os.path.join(full, META)), full))
    return max(found)[2] if found else None


def consolidate(path: str, out: str, with_optimizer: bool = False) -> None:
    """Write any checkpoint as one plain file that torch.load reads."""
    checkpoint = load_checkpoint(path, weights_only=not with_optimizer)
    result: dict[str, Any] = checkpoint["state_dict"]
    if with_optimizer:
        result = {"state_dict": result, "optimizers": checkpoint.get("optimizers", [])}
    save_file(result, out)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m trainer.checkpoint", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    merge = commands.add_parser("consolidate", help="write a checkpoint as one plain torch.load file")
    merge.add_argument("checkpoint")
    merge.add_argument("out")
    merge.add_argument("--with-optimizer", action="store_true", help="keep optimizer state keyed by name")
    args = parser.parse_args(argv)
    consolidate(args.checkpoint, args.out, with_optimizer=args.with_optimizer)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
