"""DCP planners for tensors held as flat pieces (`FlatPieces`): each box of a piece is one chunk of the tensor.

Saving, a rank declares its boxes as chunks of the original tensor (DCP's chunk metadata: offsets and sizes)
and hands DCP views of its own memory to write; everything else goes through DCP's default planner. Loading, a
rank asks for the boxes it needs, and DCP's resharding reads only the stored chunks that overlap them, copying
straight into the rank's memory.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..sharding import FlatPieces
from . import unpickling

_SAME_SIZE_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class Pickled:
    """An object written as one DCP item under `key`: its torch.save bytes, which every DCP reader loads back as
    the object (DCP would split a dict into one item per key, and drop empty ones). Saving warns if the object
    holds types that loading admits only with trust_pickled=True."""

    def __init__(self, obj: Any, key: str) -> None:
        self.data = io.BytesIO()
        torch.save(obj, self.data)
        unpickling.warn_if_refused(obj, self.data, key)


class ShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, with FlatPieces values (leaves of the nested state dict) written box by box
    and Pickled values as their bytes."""

    def create_local_plan(self) -> SavePlan:
        shards = {k: v for k, v in self.state_dict.items() if isinstance(v, FlatPieces)}
        rest = {k: v for k, v in self.state_dict.items() if k not in shards}
        plan = create_default_local_save_plan(rest, self.is_coordinator)
        items = [*plan.items, *(item for fqn, pieces in shards.items() for item in _write_items(fqn, pieces))]
        self.plan = dataclasses.replace(plan, items=items, planner_data=self.mappings)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        value = self.state_dict[write_item.index.fqn]
        if isinstance(value, FlatPieces):
            return _own_storage(value.view(tuple(write_item.index.offset)))
        if isinstance(value, Pickled):
            return value.data
        return super().resolve_data(write_item)


def _write_items(fqn: str, pieces: FlatPieces) -> list[WriteItem]:
    properties = TensorProperties(dtype=pieces.dtype)
    return [
        WriteItem(
            index=MetadataIndex(fqn, offsets),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                properties=properties,
                size=torch.Size(pieces.shape),
            ),
        )
        for offsets, sizes, _ in pieces.boxes()
    ]


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or on the CPU an alias of it whose storage is only its own bytes. DCP's writer copies a view of a
    larger storage (torch.save would write all of it) and keeps the copies until the file is written: a box of
    a parameter shard would cost its size again."""
    tensor = tensor.detach()
    same_size = _SAME_SIZE_INTS.get(tensor.element_size())
    if tensor.device.type != "cpu" or same_size is None or tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return torch.from_numpy(tensor.view(same_size).numpy()).view(tensor.dtype)


class ShardLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner over a state dict keyed as DCP stores it (None where an object is to be read),
    plus FlatPieces targets (`shards`, by the same keys) read box by box. Objects are unpickled under the
    allow-list (DCP's planner unpickles anything); what it refuses is listed in `refused`, by key, for the
    caller to raise once dcp.load is done (an error raised inside DCP's reader comes back wrapped)."""

    def __init__(self, shards: dict[str, FlatPieces], trust_pickled: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.shards, self.trust_pickled = shards, trust_pickled
        self.refused: dict[str, tuple[Any, list[str]]] = {}  # key -> (storage index, types found)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            self.state_dict[fqn] = unpickling.load(value, f"item {fqn!r}", self.trust_pickled)
        except unpickling.Refused as refused:
            self.refused[fqn] = (read_item.storage_index, refused.found)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        for fqn, pieces in self.shards.items():
            saved = self.metadata.state_dict_metadata[fqn]
            if tuple(saved.size) != tuple(pieces.shape):
                raise ValueError(f"{fqn}: saved with shape {list(saved.size)}, loaded into {list(pieces.shape)}")
            chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s, _ in pieces.boxes()]
            plan.items += create_read_items_for_chunk_list(fqn, saved, chunks)
        return plan

    def resolve_tensor(self, read_item: Any) -> torch.Tensor:
        pieces = self.shards.get(read_item.dest_index.fqn)
        if pieces is None:
            return super().resolve_tensor(read_item)
        box = pieces.view(tuple(read_item.dest_index.offset))
        for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            box = box.narrow(dim, offset, length)
        return box
