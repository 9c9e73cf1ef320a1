"""Checkpoint directories on disk: written aside and renamed into place, found again, removed.

A checkpoint is written into a staging folder beside its path (`path.tmp-<id>`) and renamed into place once it
is complete, so a crash during a save never damages an existing checkpoint; an existing one is renamed aside
(`path.old-<id>`) first and removed only after the new one is in place. `ModelCheckpoint` uses the same rules.
"""

from __future__ import annotations

import os
import shutil
import uuid

from .format import META_FILE, read_meta

STAGING, REPLACED = ".tmp-", ".old-"


def staging_path(path: str) -> str:
    return f"{path}{STAGING}{uuid.uuid4().hex[:8]}"


def replace_directory(staging: str, path: str) -> None:
    """Move the finished checkpoint into place; an older one at `path` is removed only afterwards. A crash
    between the two renames leaves the older one complete as `path.old-*`, which `find_last` still finds."""
    if os.path.exists(path):
        os.rename(path, f"{path}{REPLACED}{uuid.uuid4().hex[:8]}")
    os.rename(staging, path)
    remove_leftovers(path, REPLACED)


def link_directory(source: str, path: str) -> None:
    """A second checkpoint at `path` with the files of `source` (hard links where the file system allows),
    put in place as atomically as a save."""
    staging = staging_path(path)
    os.makedirs(staging)
    for name in os.listdir(source):
        try:
            os.link(os.path.join(source, name), os.path.join(staging, name))
        except OSError:
            shutil.copy2(os.path.join(source, name), os.path.join(staging, name))
    replace_directory(staging, path)


def remove_leftovers(path: str, marker: str = STAGING) -> None:
    """Remove the folders `<path><marker>*` beside `path` (staging folders of saves that crashed)."""
    directory, name = os.path.split(path)
    for entry in os.listdir(directory) if os.path.isdir(directory) else []:
        if entry.startswith(name + marker):
            remove(os.path.join(directory, entry))


def remove_incomplete(directory: str) -> None:
    """Remove every staging folder in `directory` (when no save is running)."""
    for entry in os.listdir(directory) if os.path.isdir(directory) else []:
        if STAGING in entry:
            remove(os.path.join(directory, entry))


def remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def find_last(*directories: str) -> str | None:
    """The newest complete checkpoint directory under any of `directories`, as `ckpt_path="last"` finds it.

    Complete checkpoints are those with `meta.json`; the newest is the one with the highest recorded global step
    (then the latest). Staging folders never count; `X.old-*` (left by a crash while `X` was being replaced)
    counts only while `X` is missing.

    Args:
        *directories: folders to search (those that do not exist are skipped).

    Returns:
        The checkpoint's path, or None if there is none.

    Raises:
        CheckpointError: if a checkpoint's `meta.json` is corrupted or of another format version.
    """
    found = []
    for directory in directories:
        entries = os.listdir(directory) if os.path.isdir(directory) else []
        for entry in entries:
            full = os.path.join(directory, entry)
            replaced = REPLACED in entry and os.path.exists(full.rsplit(REPLACED, 1)[0])
            if STAGING in entry or replaced or not os.path.isfile(os.path.join(full, META_FILE)):
                continue
            meta = read_meta(full)
            found.append((meta.get("global_step", -1), os.path.getmtime(os.path.join(full, META_FILE)), full))
    return max(found)[2] if found else None
