"""Where a checkpoint is read from: a DCP directory, or one torch.save file (a full checkpoint, or the plain
state dict `consolidate` writes). Both are addressed by DCP's keys ("model.<name>", "optim.state.<name>.<key>",
"trainer", ...), know each key's path into the nested dict and each tensor's shape and dtype, and read tensors
into place (whole, or as the FlatPieces a rank needs) and objects.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..sharding import FlatPieces
from . import format, unpickling
from .format import LOADER, META, MODEL, RNG, TRAINER, CheckpointError
from .planners import ShardLoadPlanner


class DirectorySource:
    """A DCP checkpoint directory; each rank reads only what it asks for, every item checked (format.py) and
    every object unpickled under the allow-list (unpickling.py) unless `trust_pickled`."""

    def __init__(self, path: str, trust_pickled: bool = False) -> None:
        self.path, self.trust_pickled = path, trust_pickled
        self.meta_json = format.read_meta(path)
        format.check_files(path, self.meta_json)
        self.reader = format.VerifiedReader(path, self.meta_json, trust_pickled)
        metadata = self.reader.read_metadata()
        self.paths = {key: tuple(metadata.planner_data.get(key, (key,))) for key in metadata.state_dict_metadata}
        self.tensors = {
            key: torch.empty(md.size, dtype=md.properties.dtype, device="meta")
            for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }

    def read(self, plain: dict[str, Any], shards: dict[str, FlatPieces] | None = None) -> dict[str, Any]:
        """Fill the tensors of `plain` and `shards` in place; returns `plain` with its None values (objects) read."""
        state = dict(plain)
        planner = ShardLoadPlanner(shards or {}, self.trust_pickled)
        with format.unwrapped():
            dcp.load(state, storage_reader=self.reader, planner=planner, no_dist=True)
        if planner.refused:
            raise self._refused(planner.refused)
        return state

    def _refused(self, refused: dict[str, tuple[Any, list[str]]]) -> unpickling.Refused:
        where = "; ".join(
            f"{key!r} in {self.reader.storage_data[index].relative_path}" for key, (index, _) in sorted(refused.items())
        )
        found = sorted({name for _, names in refused.values() for name in names})
        return unpickling.Refused(f"checkpoint {self.path!r} (item {where})", found)


class FileSource:
    """One torch.save file, memory-mapped: a rank touches only the pages of what it reads. Unpickled under the
    allow-list (unpickling.py) unless `trust_pickled`."""

    def __init__(self, path: str, trust_pickled: bool = False) -> None:
        self.path = path
        try:
            loaded = unpickling.load(path, f"checkpoint file {path!r}", trust_pickled, map_location="cpu", mmap=True)
        except CheckpointError:
            raise
        except Exception as error:
            message = f"checkpoint file {path!r} cannot be read (truncated or not a checkpoint): {error}"
            raise CheckpointError(message) from error
        if isinstance(loaded, dict) and loaded and all(isinstance(v, torch.Tensor) for v in loaded.values()):
            loaded = {MODEL: loaded}  # a plain state dict: weights only
        if not (isinstance(loaded, dict) and isinstance(loaded.get(MODEL), dict)):
            raise CheckpointError(f"checkpoint file {path!r} holds neither a state dict nor a full checkpoint")
        self.values, self.paths = {}, {}
        for path_, value in leaves(loaded):
            key = ".".join(map(str, path_))
            self.values[key], self.paths[key] = value, path_
        self.tensors = {
            key: torch.empty(v.shape, dtype=v.dtype, device="meta")
            for key, v in self.values.items()
            if isinstance(v, torch.Tensor)
        }

    def read(self, plain: dict[str, Any], shards: dict[str, FlatPieces] | None = None) -> dict[str, Any]:
        state = dict(plain)
        for key, target in plain.items():
            if target is None:
                state[key] = self.values[key]
            else:
                target.copy_(self.values[key])
        for key, pieces in (shards or {}).items():
            flat = self.values[key].reshape(-1)
            for start, data in pieces.pieces:
                data.copy_(flat[start : start + data.numel()])
        return state


Source = DirectorySource | FileSource


def open_source(path: str | os.PathLike, trust_pickled: bool = False) -> Source:
    """The checkpoint at `path`, a file or a directory. `trust_pickled`: unpickle whatever it holds (only for a
    checkpoint whose writer is trusted); otherwise only the allow-list of unpickling.py."""
    path = os.fspath(path)
    return FileSource(path, trust_pickled) if os.path.isfile(path) else DirectorySource(path, trust_pickled)


def leaves(state: Mapping[str, Any]) -> Iterator[tuple[tuple, Any]]:
    """(path, value) of everything a checkpoint's nested dict holds, split as DCP splits it when it saves:
    into dicts and into lists that hold tensors or containers; the trainer state, meta and each rank's RNG
    states and loader state are single objects."""
    for top, value in state.items():
        if top in (TRAINER, META):
            yield (top,), value
        elif top in (RNG, LOADER):
            for rank, per_rank in value.items():
                yield (top, str(rank)), per_rank
        else:
            yield from _split((str(top),), value)


def _split(path: tuple, value: Any) -> Iterator[tuple[tuple, Any]]:
    if isinstance(value, Mapping):
        for key, item in value.items():
            yield from _split((*path, str(key)), item)
    elif isinstance(value, list) and any(isinstance(v, (torch.Tensor, Mapping, list)) for v in value):
        for index, item in enumerate(value):
            yield from _split((*path, index), item)
    else:
        yield path, value
