"""What reading a checkpoint may unpickle. Unpickling can run any code its writer put in the file, so every pickle
a checkpoint holds (a one-file checkpoint, DCP's `.metadata`, DCP's object items) is read with an allow-list:
what torch's `weights_only` loader admits (tensors, containers, numbers, strings, dtypes: so torch's RNG states
and optimizer and scheduler states too), DCP's metadata classes, paths, the project's own state types
(`admit`), and what the user registered with `torch.serialization.add_safe_globals`. Anything else is a
`CheckpointError` that names the type and where it was found, unless the caller passes `trust_pickled=True` for
a file whose writer it trusts.
"""

from __future__ import annotations

import importlib
import io
import pathlib
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO, Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from .errors import CheckpointError

OPT_IN = (
    "Load it only if you trust whoever wrote it: pass trust_pickled=True (on the command line "
    "--trust-pickled); or register the types with torch.serialization.add_safe_globals"
)

_DCP_CLASSES = [
    dcp_metadata.Metadata,
    dcp_metadata.TensorStorageMetadata,
    dcp_metadata.BytesStorageMetadata,
    dcp_metadata.ChunkStorageMetadata,
    dcp_metadata.TensorProperties,
    dcp_metadata.MetadataIndex,
    dcp_metadata.StorageMeta,
]
_PATHS = [pathlib.PurePath, pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.Path, pathlib.PosixPath]
# Further names DCP's `.metadata` holds: where each item lies in a file, TensorProperties' memory format and
# torch's reducer of a torch.layout. Private in their modules, so looked up by name (absent ones are skipped).
_DCP_NAMED = [
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"),
]
# Plain data that pickle names as a global and torch's weights_only loader admits by default.
_PLAIN = [OrderedDict, set, frozenset, complex, torch.Size]
_STATE_TYPES: list[type] = []  # the project's own (admit)


def admit(cls: type) -> type:
    """Admit one of the project's own plain-data state types to checkpoints (usable as a class decorator)."""
    if cls not in _STATE_TYPES:
        _STATE_TYPES.append(cls)
    return cls


def allowed() -> list[Any]:
    """What a checkpoint may name besides what torch's weights_only loader admits by default."""
    named = [getattr(importlib.import_module(module), name, None) for module, name in _DCP_NAMED]
    return [*_DCP_CLASSES, *_PATHS, *(obj for obj in named if obj is not None), *_STATE_TYPES]


def _name(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _allowed_names() -> dict[str, Any]:
    """Every global the `.metadata` unpickler admits, by "module.name"; with the user's safe globals."""
    names = {_name(obj): obj for obj in [*_PLAIN, *allowed()]}  # as pickle names a global: module, qualname
    for entry in torch.serialization.get_safe_globals():
        obj, name = entry if isinstance(entry, tuple) else (entry, _name(entry))
        names[name] = obj
    return names


# ---- torch.save files: one-file checkpoints and DCP's object items -------------------------------------------
@contextmanager
def _admitted() -> Iterator[None]:
    """torch's safe_globals with the allow-list, less what the user registered already (leaving the context
    removes what it added: theirs must stay)."""
    theirs = set(map(id, torch.serialization.get_safe_globals()))
    with torch.serialization.safe_globals([obj for obj in allowed() if id(obj) not in theirs]):
        yield


def load(file: str | IO[bytes], where: str, trust_pickled: bool = False, **kwargs: Any) -> Any:
    """`torch.load(file, **kwargs)` under the allow-list (everything, with `trust_pickled`).

    Raises:
        CheckpointError: if the file names a type outside the allow-list (`where` says where it was found).
    """
    if trust_pickled:
        return torch.load(file, weights_only=False, **kwargs)
    try:
        with _admitted():
            return torch.load(file, weights_only=True, **kwargs)
    except pickle.UnpicklingError as error:
        found = unsafe_globals(file) or _refused_construct(error)
        if not found:  # neither a type nor a construct: a damaged or foreign file, which the caller names
            raise
        raise Refused(where, found) from None


def _refused_construct(error: pickle.UnpicklingError) -> list[str]:
    """What torch's weights_only loader refused when no global was outside the allow-list (a dict subclass
    filled item by item, say), from its message; [] for a pickle that is just damaged."""
    _, marker, rest = str(error).partition("WeightsUnpickler error:")
    reason = rest.strip().split("\n")[0].strip()
    return [f"(unsupported: {reason})"] if marker and reason else []


def unsafe_globals(file: str | IO[bytes]) -> list[str]:
    """The types and functions a torch.save file names outside the allow-list (read without unpickling it);
    [] where the file is not one torch.save wrote."""
    if not isinstance(file, str):
        file.seek(0)
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except (ValueError, RuntimeError, OSError, pickle.UnpicklingError):
        return []
    admitted = set(_allowed_names())
    return sorted(name for name in found if name not in admitted)


class Refused(CheckpointError):
    """A pickle that names types outside the allow-list (`found`); nothing of it was unpickled."""

    def __init__(self, where: str, found: list[str]) -> None:
        super().__init__(
            f"{where} holds pickled objects of type {', '.join(found)}, which a checkpoint may hold only "
            f"if trusted (unpickling them could run code): nothing was loaded. {OPT_IN}"
        )
        self.found = found


# ---- DCP's .metadata ---------------------------------------------------------------------------------------
class MetadataUnpickler(pickle.Unpickler):
    """pickle's unpickler for DCP's `.metadata`, admitting only the allow-list (DCP's reader admits anything)."""

    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        self.names = _allowed_names()

    def find_class(self, module: str, name: str) -> Any:
        obj = self.names.get(f"{module}.{name}")
        if obj is None and module == "torch":  # dtypes (torch.float32) and layouts are pickled by name
            obj = getattr(torch, name, None)
            obj = obj if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)) else None
        if obj is None:
            raise _NotAdmitted(f"{module}.{name}")
        return obj


class _NotAdmitted(pickle.UnpicklingError):
    """A global outside the allow-list (a corrupted pickle raises other UnpicklingErrors)."""


def load_metadata(file: IO[bytes], where: str, trust_pickled: bool = False) -> Any:
    """DCP's Metadata from its pickle under the allow-list (everything, with `trust_pickled`).

    Raises:
        CheckpointError: if it names a type outside the allow-list, or is not a pickle.
    """
    try:
        metadata = (pickle.Unpickler if trust_pickled else MetadataUnpickler)(file).load()
    except _NotAdmitted as error:
        raise Refused(where, [str(error)]) from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError) as error:
        raise CheckpointError(f"{where} is corrupted: {error!r}") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{where} is not DCP's metadata: it holds a {type(metadata).__name__}")
    return metadata


# ---- saving: what loading will refuse --------------------------------------------------------------------------
_warned: set[tuple[str, tuple[str, ...]]] = set()
_PLAIN_LEAVES = (torch.Tensor, str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


def warn_if_refused(obj: Any, data: io.BytesIO, key: str) -> None:
    """Warn (once per key and types) that `obj`, just saved in `data` under `key`, needs the opt-in to load."""
    found = tuple(unsafe_globals(data))
    data.seek(0)
    if found and (key, found) not in _warned:
        _warned.add((key, found))
        at = ", ".join(_paths(obj, key)[:5])
        warnings.warn(
            f"checkpoint item {key!r} holds objects of type {', '.join(found)} (at {at}): they are saved, "
            "but loading the checkpoint refuses them unless given trust_pickled=True (--trust-pickled). "
            "Save plain data (tensors, numbers, strings, lists, dicts) instead, or register the types with "
            "torch.serialization.add_safe_globals where the checkpoint is loaded",
            stacklevel=3,
        )


def _paths(obj: Any, path: str) -> list[str]:
    """Where `obj` holds something other than plain data and containers."""
    if isinstance(obj, dict):
        return [p for key, value in obj.items() for p in _paths(value, f"{path}[{key!r}]")]
    if isinstance(obj, (list, tuple, set, frozenset)) and type(obj) in (list, tuple, set, frozenset):
        return [p for i, value in enumerate(obj) for p in _paths(value, f"{path}[{i}]")]
    return [] if isinstance(obj, _PLAIN_LEAVES) else [f"{path}: {type(obj).__module__}.{type(obj).__qualname__}"]
