"""A torch.save file written while its tensors are still being read, so that the writer holds about one batch of
them at a time instead of the whole checkpoint (full checkpoints, `consolidate`)."""

from __future__ import annotations

import os
import struct
import uuid
import zipfile
from collections.abc import Iterator
from typing import Any

import torch

from . import unpickling


class StreamedFullFile:
    """A torch.save file written while its tensors are still being read.

    `skeleton` is the checkpoint with every tensor present at its final shape and dtype (the big ones may be
    uninitialised placeholders). torch.save writes its structure with the tensor bytes left blank
    (torch.serialization.skip_data); `fill(key, tensor)` then writes a tensor's bytes where torch.load reads
    them; `commit` checks that every placeholder was filled and renames the file into place. The structure is
    read back under the checkpoint allow-list unless `trust_pickled` (a skeleton from a trusted checkpoint).
    Keys are paths into the skeleton: ("model", name), ("optim", "state", name, "exp_avg"), ...
    """

    def __init__(
        self, path: str | os.PathLike, skeleton: Any, placeholders: set[tuple], trust_pickled: bool = False
    ) -> None:
        self.path = os.fspath(path)
        self.tmp = f"{self.path}.tmp-{uuid.uuid4().hex[:8]}"
        with torch.serialization.skip_data():
            torch.save(skeleton, self.tmp)
        self.offsets = _tensor_offsets(self.tmp, trust_pickled)
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


def _tensor_offsets(path: str, trust_pickled: bool) -> dict[tuple, int]:
    """Where each tensor's bytes lie in a torch.save file. torch.load(mmap=True) maps the whole file and makes
    every storage a view at its record's offset, so a tensor's address less the mapping's start is its offset;
    the mapping's start follows from the first data record, whose offset the zip directory gives."""
    loaded = unpickling.load(path, f"file {path!r}", trust_pickled, mmap=True, map_location="cpu")
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
