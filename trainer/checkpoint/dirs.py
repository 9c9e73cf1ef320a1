"""Where a trainer's checkpoints go, and whether a full checkpoint file can be written at a path."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from callbacks import Logger, ModelCheckpoint


def checkpoint_dirs(
    checkpoint_callback: ModelCheckpoint | None, logger: Logger | None, default_root_dir: str
) -> list[str]:
    """Where checkpoints go: the ModelCheckpoint's dirpath, or by default `<log_dir>/checkpoints`; a restarted run
    logs to a new logger version, so then the checkpoints folders of every version count. (Also used by the
    command line, before a Trainer exists, to find the config of `--ckpt_path last`.)"""
    directory = checkpoint_callback.dirpath if checkpoint_callback else None
    if directory:
        return [directory]
    log_dir = logger.log_dir if logger else default_root_dir
    dirs = [os.path.join(log_dir or default_root_dir, "checkpoints")]
    root = getattr(logger, "root_dir", None)
    if root is not None and os.path.isdir(root):
        dirs += [os.path.join(root, v, "checkpoints") for v in sorted(os.listdir(root))]
    return dirs


def full_file_problem(path: str) -> str | None:
    """Why a full checkpoint cannot be written at `path`, or None (after making its folder)."""
    if os.path.isdir(path):
        return f"{path!r} is a directory; use a file path"
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    except OSError as error:
        return f"cannot make the folder of {path!r}: {error}"
    return None
