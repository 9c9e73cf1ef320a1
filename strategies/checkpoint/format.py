"""The checkpoint format: a torch Distributed Checkpoint (DCP) directory plus our integrity metadata.

    path/.metadata          DCP's: every tensor's shape, dtype and chunks, and where each item lies
    path/__<r>_0.distcp     the items rank r wrote: its chunks of the model and optimizer state, its RNG states
    path/meta.json          ours, written last: format version, global step, world size, and for every file its
                            size and the CRC32 of each item in it; a directory without it is not a checkpoint

Inside, the keys are those DCP gives {"model": ..., "optim": ..., "trainer": ..., "rng": ..., "meta": ...}:
    model.<name>                   the model's state dict (a tied parameter once, under its first name)
    optim.state.<name>.<key>       optimizer state, keyed as torch's get_state_dict keys it
    optim.param_groups.<i>.<key>   each group's hyperparameters and "params" (its parameters' names)
    trainer                        epoch, step, position, schedulers, callbacks, loss scale, on_save_checkpoint
    rng.<rank>                     each rank's RNG states
    loader.<rank>                  each rank's training-loader state, where the loader keeps one and the
                                   checkpoint is in the middle of an epoch (trainer/data/loader_state.py)
    meta                           world size, strategy, global step, tied aliases, state-dict keys, optimizer classes
    ema.<name>                     with callbacks.EMA: the moving average of each trainable parameter, sharded like
                                   "model" (callbacks may add such sharded state under keys of their own)
A full file (one torch.save file) is that nested dict, with the tied names in "model" too.

DCP checks nothing it reads, so every item is checked against its CRC32 as it is read (`VerifiedReader`), and
every file's size when a checkpoint is opened: a damaged file is named and refused, and a rank that reads only
its own chunks checks only those. Every pickle in it (`.metadata`, the object items) is unpickled with an
allow-list (unpickling.py): reading a checkpoint never runs code from it.
"""

from __future__ import annotations

import io
import json
import os
import warnings
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from . import unpickling
from .errors import CheckpointError

FORMAT_VERSION = 2
META_FILE = "meta.json"
DCP_METADATA = ".metadata"
MODEL, TRAINER, RNG, META = "model", "trainer", "rng", "meta"
LOADER = "loader"
EMA = "ema"  # callbacks.EMA's key
BLOCK = 1 << 22

# Loads always run in one process (no_dist: a rank plans its own reads), and saves do without a process group;
# DCP warns about both on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def optim_key(index: int) -> str:
    """The top-level key of optimizer `index` ("optim" for the first, as torch's examples save it)."""
    return "optim" if index == 0 else f"optim_{index}"


@contextmanager
def unwrapped(rank: int = 0) -> Iterator[None]:
    """DCP reports an error of any rank as a CheckpointException (a BaseException) carrying every rank's; raise
    this rank's own error instead (or, when only others failed, a RuntimeError naming them)."""
    try:
        yield
    except CheckpointException as error:
        own = error.failures.get(rank)
        if own is not None:
            raise own[0] from None
        ranks = {r: repr(failure[0]) for r, failure in error.failures.items()}
        raise RuntimeError(f"checkpoint I/O failed on other ranks: {ranks}") from None


# ---- meta.json ---------------------------------------------------------------------------------------------
def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    """The description a checkpoint directory keeps in `meta.json` (format version, global step, epoch, world
    size, the files and their checksums, ...), checked.

    Args:
        path: the checkpoint directory.

    Returns:
        The parsed `meta.json`.

    Raises:
        FileNotFoundError: if `path` is not a directory.
        CheckpointError: if `meta.json` is missing, corrupted, changed after it was written, or of another format
            version.
    """
    path = os.fspath(path)
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist (a checkpoint is a directory with {META_FILE})")
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{path!r} is not a complete checkpoint: {META_FILE} is missing")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except ValueError as error:
        raise CheckpointError(f"checkpoint file {meta_path!r} is corrupted: {error}") from error
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path!r} is a checkpoint of format version {meta.get('format_version')}; this version reads "
            f"{FORMAT_VERSION} (torch's DCP) only"
        )
    if meta.pop("checksum", None) != _meta_checksum(meta):
        raise CheckpointError(
            f"checkpoint file {meta_path!r} was changed after it was written: its checksum does "
            "not match its contents (world size, step or file table edited or damaged)"
        )
    return meta


def write_meta(directory: str, meta: dict[str, Any]) -> None:
    """Write meta.json, the file that makes a checkpoint directory complete, with a checksum of its own contents
    (the files' checksums live in it, so it is covered too), and flush it to disk."""
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump({**meta, "checksum": _meta_checksum(meta)}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _meta_checksum(meta: dict[str, Any]) -> int:
    return zlib.crc32(json.dumps(meta, sort_keys=True).encode())


def file_integrity(directory: str, name: str, items: list[tuple[int, int]]) -> dict[str, Any]:
    """The size of file `name` and the CRC32 of each of its items, given as (offset, length)."""
    crcs = {}
    with open(os.path.join(directory, name), "rb") as f:
        for offset, length in sorted(items):
            crcs[str(offset)] = _crc32(f, offset, length)
    return {"size": os.path.getsize(os.path.join(directory, name)), "crc32": crcs}


def _crc32(stream: IO[bytes], offset: int, length: int) -> int:
    stream.seek(offset)
    crc, left = 0, length
    while left > 0:
        block = stream.read(min(BLOCK, left))
        if not block:
            break
        crc, left = zlib.crc32(block, crc), left - len(block)
    return crc


def check_files(path: str, meta: dict[str, Any]) -> None:
    """Every file meta.json lists is there with its recorded size."""
    for name, info in meta["files"].items():
        file_path = os.path.join(path, name)
        if not os.path.isfile(file_path):
            raise CheckpointError(f"checkpoint file {file_path!r} is missing")
        size = os.path.getsize(file_path)
        if size != info["size"]:
            raise CheckpointError(
                f"checkpoint file {file_path!r} is truncated or corrupted: {size} bytes, {info['size']} expected"
            )


# ---- reading ------------------------------------------------------------------------------------------------
class VerifiedReader(FileSystemReader):
    """DCP's file reader, checking each item it reads (and .metadata) against the CRC32s in meta.json. Object
    items are unpickled by the load planner (planners.ShardLoadPlanner admits only the allow-list)."""

    def __init__(self, path: str, meta: dict[str, Any], trust_pickled: bool = False) -> None:
        super().__init__(path)
        self.directory, self.meta, self.trust_pickled = os.fspath(path), meta, trust_pickled
        self._metadata = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """DCP's metadata, checked, and unpickled under the allow-list (DCP's own reader unpickles anything)."""
        if self._metadata is None:
            path = os.path.join(self.directory, DCP_METADATA)
            with open(path, "rb") as f:
                self._check(f, DCP_METADATA, 0, self.meta["files"][DCP_METADATA]["size"])
                f.seek(0)
                metadata = unpickling.load_metadata(f, f"checkpoint file {path!r}", self.trust_pickled)
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = getattr(self, "load_id", None)  # as DCP's reader does
            self._metadata = metadata
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: dict[str, list] = {}
        for request in plan.items:
            per_file.setdefault(self.storage_data[request.storage_index].relative_path, []).append(request)
        for relative_path, requests in per_file.items():
            with open(os.path.join(self.directory, relative_path), "rb") as stream:
                for request in requests:
                    self._read(stream, relative_path, request, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read(self, stream: IO[bytes], relative_path: str, request: Any, planner: LoadPlanner) -> None:
        item = self.read_item(stream, relative_path, self.storage_data[request.storage_index])
        if request.type == LoadItemType.BYTE_IO:
            planner.load_bytes(request, io.BytesIO(item.read()))
            return
        tensor = torch.load(item, map_location="cpu", weights_only=True)
        for dim, (offset, length) in enumerate(zip(request.storage_offsets, request.lengths)):
            tensor = tensor.narrow(dim, offset, length)
        target = planner.resolve_tensor(request).detach()
        target.copy_(tensor)
        planner.commit_tensor(request, target)

    def read_item(self, stream: IO[bytes], relative_path: str, info: Any) -> IO[bytes]:
        """The bytes of one item, once their CRC32 is checked (they are read twice: no copy is kept)."""
        self._check(stream, relative_path, info.offset, info.length)
        return _Slice(stream, info.offset, info.length)

    def _check(self, stream: IO[bytes], relative_path: str, offset: int, length: int) -> None:
        expected = self.meta["files"].get(relative_path, {}).get("crc32", {}).get(str(offset))
        if expected is None or _crc32(stream, offset, length) != expected:
            raise CheckpointError(
                f"checkpoint file {os.path.join(self.directory, relative_path)!r} is corrupted: the checksum of "
                f"its item at byte {offset} does not match meta.json"
            )


class _Slice(io.RawIOBase):
    """Bytes [offset, offset + length) of a file, as a file of their own (what torch.load reads an item from)."""

    def __init__(self, stream: IO[bytes], offset: int, length: int) -> None:
        super().__init__()
        self.stream, self.offset, self.length, self.position = stream, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.position

    def seek(self, position: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence]
        self.position = max(0, min(self.length, base + position))
        return self.position

    def readinto(self, buffer: Any) -> int:
        size = min(len(buffer), self.length - self.position)
        if size <= 0:
            return 0
        self.stream.seek(self.offset + self.position)
        data = self.stream.read(size)
        buffer[: len(data)] = data
        self.position += len(data)
        return len(data)
