"""The error of a checkpoint that cannot or may not be read, and how every rank comes to raise it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: incomplete, corrupted (a file fails its size or checksum check), of
    another format version, not a checkpoint, or holding pickled objects outside what loading admits without
    `trust_pickled=True`. A `ValueError`."""


def read_on_every_rank(read: Callable[[], T]) -> T:
    """`read()` on every rank, where each rank reads its own pieces of a checkpoint: a `CheckpointError` on some
    ranks (a corrupted file only they read) is raised on every rank, naming each rank's problem, instead of the
    others failing later in a collective with the transport's "connection closed". Collective when distributed."""
    error: CheckpointError | None = None
    result: Any = None
    try:
        result = read()
    except CheckpointError as raised:
        error = raised
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return result
    found: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(found, None if error is None else str(error))
    failed = [f"rank {rank}: {message}" for rank, message in enumerate(found) if message is not None]
    if error is not None:
        raise error
    if failed:
        raise CheckpointError("another rank could not read its part of the checkpoint: " + "; ".join(failed))
    return result
