"""Writing a checkpoint: every rank writes its own pieces with DCP, in parallel and with nothing gathered, into a
staging folder that is renamed into place once rank 0 has written meta.json (every file's size and its items'
checksums). Synchronously, or in the background with DCP's async_save: the state is copied first (the only
stall), at most one save is in flight, and the next save and `wait` wait for it. A save that fails on any rank
fails alike on every rank, and the previous checkpoint at the path is untouched.

The Trainer's checkpoints and a plain loop's `strategy.save` both write through `CheckpointWriter`.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import AsyncStager
from torch.utils._pytree import tree_map

from ..sharding import FlatPieces
from . import files, format, unpickling
from .planners import ShardSavePlanner

log = logging.getLogger(__name__)
DISK_FULL_BYTES = 1 << 20  # less free space than this after a failed write: the disk is full


class Snapshot(AsyncStager):
    """DCP's staging step for async saves: a copy of every tensor and piece in CPU memory, so that training can
    change the originals while the copy is written."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return tree_map(_copy, state_dict)


def _copy(value: Any) -> Any:
    if isinstance(value, FlatPieces):
        return FlatPieces(value.shape, value.dtype, [(s, d.detach().to("cpu", copy=True)) for s, d in value.pieces])
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    return value


class CheckpointWriter:
    """Writes checkpoints; at most one save in flight."""

    def __init__(self) -> None:
        self._pending: Future | None = None
        self._executor: ThreadPoolExecutor | None = None

    def save(
        self,
        state: dict[str, Any],
        path: str | os.PathLike,
        summary: dict[str, Any],
        async_save: bool = False,
        links: list[str] = (),
        on_done: Callable[[], None] | None = None,
        texts: dict[str, str] | None = None,
    ) -> None:
        """Write this rank's `state` (a nested dict of FlatPieces, tensors and Pickled objects) as a checkpoint at
        `path`, with `summary` in meta.json (collective: every rank calls it); also put it at each of `links`
        (hard links), then call `on_done` on rank 0. With `async_save` this returns once the state is copied;
        the files are written in the background. `texts` (file name to contents, e.g. the run's config.yaml) are
        written by rank 0 into the checkpoint folder, listed in meta.json and renamed into place with it."""
        self.wait()
        path = os.path.abspath(os.fspath(path))
        group = _checkpoint_group()
        staging = _broadcast(files.staging_path(path), group)
        if group is None or dist.get_rank() == 0:
            files.remove_leftovers(path)  # staging folders of saves that crashed or were killed
            os.makedirs(staging)
        if group is not None:
            dist.barrier(group=group)
        finish = _Finish(staging, path, [os.path.abspath(p) for p in links], on_done, summary, group, texts)
        options = dict(
            storage_writer=FileSystemWriter(staging),
            planner=ShardSavePlanner(),
            process_group=group,
            no_dist=group is None,
        )
        with finish.failing_alike():
            with format.unwrapped(finish.rank):
                if not async_save:
                    finish(dcp.save(state, **options))
                    return
                upload = dcp.async_save(state, async_stager=Snapshot(), **options)
        self._executor = self._executor or ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self._pending = self._executor.submit(_finish_upload, upload, finish)

    def wait(self, raise_errors: bool = True) -> None:
        """Wait for the save in flight, if any; its error is raised (or, with `raise_errors=False`, logged)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
        except BaseException as error:
            if raise_errors:
                raise
            log.error("the checkpoint save in flight failed: %r", error)


def _finish_upload(upload: Future, finish: _Finish) -> None:
    with finish.failing_alike():
        with format.unwrapped(finish.rank):
            metadata = upload.result()
        finish(metadata)


class _Finish:
    """After DCP wrote the files: each rank checksums the items in its files, rank 0 writes meta.json and renames
    the staging folder into place, then links and `on_done`. Every rank learns whether it worked."""

    def __init__(
        self,
        staging: str,
        path: str,
        links: list[str],
        on_done: Any,
        summary: dict,
        group: Any,
        texts: dict[str, str] | None = None,
    ) -> None:
        self.staging, self.path, self.links, self.on_done = staging, path, links, on_done
        self.summary, self.group, self.texts = summary, group, dict(texts or {})
        self.rank = dist.get_rank() if group is not None else 0

    def __call__(self, metadata: Any) -> None:
        mine: dict[str, list[tuple[int, int]]] = {}
        for info in _storage_data(metadata, self.staging).values():
            if info.relative_path.startswith(f"__{self.rank}_"):
                mine.setdefault(info.relative_path, []).append((info.offset, info.length))
        try:
            report = {name: format.file_integrity(self.staging, name, items) for name, items in mine.items()}
        except Exception as error:
            report = error
        reports = _gather(report, self.group)
        error = self._complete(reports) if self.rank == 0 else None
        message = None if error is None else f"checkpoint {self.path!r} was not completed: {error!r}"
        message = _broadcast(message, self.group)
        if error is not None:
            raise error
        if message is not None:
            raise RuntimeError(message)

    @contextmanager
    def failing_alike(self) -> Iterator[None]:
        """A save that fails on any rank (the disk is full, say) fails on every rank with the same error, naming
        the checkpoint and the first failing rank's error (an OSError with its errno when that was one), and the
        staging folder is removed: the previous checkpoint at `path` is untouched."""
        try:
            yield
        except Exception as error:
            own = None if isinstance(error, _Agreed) else _describe_failure(error, self.staging)
            failures = _all_gather((self.rank, own), self.group)
            if self.rank == 0:
                files.remove(self.staging)
            raise _agreed(self.path, [f for f in failures if f[1] is not None]) from error

    def _complete(self, reports: list[Any]) -> BaseException | None:
        try:
            for report in reports:
                if isinstance(report, BaseException):
                    raise report
            table = {name: info for report in reports for name, info in report.items()}
            size = os.path.getsize(os.path.join(self.staging, format.DCP_METADATA))
            table[format.DCP_METADATA] = format.file_integrity(self.staging, format.DCP_METADATA, [(0, size)])
            for name, text in self.texts.items():
                table[name] = _write_text(self.staging, name, text)
            summary = {"format": "torch.distributed.checkpoint", "format_version": format.FORMAT_VERSION}
            format.write_meta(self.staging, {**summary, **self.summary, "files": table})
            files.replace_directory(self.staging, self.path)
            for link in self.links:
                files.link_directory(self.path, link)
            if self.on_done is not None:
                self.on_done()
        except Exception as error:
            return error
        return None


def _write_text(directory: str, name: str, text: str) -> dict[str, Any]:
    """A text file beside the DCP files (in the staging folder, so it is renamed into place with them)."""
    if os.path.basename(name) != name or name in (format.DCP_METADATA, format.META_FILE) or name.startswith("__"):
        raise ValueError(f"checkpoint text file {name!r}: use a plain file name that is not one of the checkpoint's")
    data = text.encode()
    with open(os.path.join(directory, name), "wb") as f:
        f.write(data)
    return format.file_integrity(directory, name, [(0, len(data))])


# (the default group it was made for, the checkpoint group), held weakly: torch.distributed holds both until
# destroy_process_group, and a group kept past that runs gloo's worker threads into interpreter shutdown
_GROUP: list[Any] = [lambda: None, lambda: None]


def _storage_data(metadata: Any, staging: str) -> dict[Any, Any]:
    """Where each item was written. torch 2.11's writer records it on a copy of the metadata that dcp.save returns
    (newer releases on the returned one), so it is then read from the .metadata file the save wrote."""
    if metadata.storage_data is not None:
        return metadata.storage_data
    path = os.path.join(staging, format.DCP_METADATA)
    with open(path, "rb") as f:  # as every .metadata is read: under the allow-list
        return unpickling.load_metadata(f, f"checkpoint file {path!r}").storage_data


def _checkpoint_group() -> Any:
    """A gloo group of all ranks for checkpoint collectives, apart from training's (async saves run them in a
    background thread); None without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = _GROUP[1]()
    if _GROUP[0]() is not dist.group.WORLD or group is None:
        group = dist.new_group(backend="gloo")
        _GROUP[:] = [weakref.ref(dist.group.WORLD), weakref.ref(group)]
    return group


class CheckpointOSError(OSError):
    """A save that failed with an OS error on some rank (a full disk, say), raised alike on every rank."""


class CheckpointWriteError(RuntimeError):
    """A save that failed otherwise on some rank, raised alike on every rank."""


_Agreed = (CheckpointOSError, CheckpointWriteError)


def _describe_failure(error: Exception, staging: str) -> tuple[bool, int | None, str]:
    """(an OS error?, its errno, its text). torch.save's zip writer reports a write that the disk refused as a
    RuntimeError ("unexpected pos ..."), losing the OSError: on a full disk it is reported as one."""
    if isinstance(error, OSError):
        return True, error.errno, str(error)
    full = shutil.disk_usage(os.path.dirname(staging)).free < DISK_FULL_BYTES
    if full and "unexpected pos" in str(error):
        return True, errno.ENOSPC, f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)} (torch.save: {error})"
    return False, None, str(error)


def _agreed(path: str, failures: list[tuple[int, tuple[bool, int | None, str]]]) -> Exception:
    """The same error on every rank: the first OS error of any rank (the cause others only see the effects of),
    else the first failing rank's error."""
    if not failures:
        return CheckpointWriteError(f"checkpoint {path!r} was not written: another rank failed")
    rank, (os_error, code, text) = min(failures, key=lambda f: (not f[1][0], f[0]))
    message = f"checkpoint {path!r} was not written (rank {rank}): {text}"
    if not os_error:
        return CheckpointWriteError(message)
    return CheckpointOSError(code, message) if code is not None else CheckpointOSError(message)


def _all_gather(obj: Any, group: Any) -> list[Any]:
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _gather(obj: Any, group: Any) -> list[Any] | None:
    if group is None:
        return [obj]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def _broadcast(obj: Any, group: Any) -> Any:
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
