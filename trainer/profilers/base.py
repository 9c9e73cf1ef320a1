"""The `Profiler` contract: what the Trainer tells a profiler during fit (every rank)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..trainer import Trainer


class Profiler:
    """The base of profilers: told when fit starts, after every optimizer step, and when fit ends, on every rank.

    Subclass it for a profiler of your own and pass it as `Trainer(profiler=...)`.

    Args:
        dirpath: the folder of the report (and traces); `None` for the run's log directory.
        filename: the report goes to `<dirpath>/fit-<filename>.txt`; `None` prints it on rank 0.
    """

    def __init__(self, dirpath: str | os.PathLike | None = None, filename: str | None = None) -> None:
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.filename = filename
        self._summary = ""

    def setup(self, trainer: Trainer) -> None:
        """Called when fit starts, after the strategy is set up; the default resolves `dirpath`.

        Args:
            trainer: the Trainer.
        """
        if self.dirpath is None:
            self.dirpath = trainer.log_dir or trainer.default_root_dir

    def step(self, trainer: Trainer) -> None:
        """Called after each optimizer step.

        Args:
            trainer: the Trainer.
        """

    def teardown(self, trainer: Trainer, success: bool) -> None:
        """Called when fit ends; with `success` on every rank alike, so a report may gather from all of them.

        Args:
            trainer: the Trainer.
            success: whether fit ended without an error.
        """

    def summary(self) -> str:
        """The last report, as text (`""` before one was made)."""
        return self._summary

    def _report(self, trainer: Trainer, text: str) -> None:
        """Print `text` on rank 0, or write it to `<dirpath>/fit-<filename>.txt` (as Lightning names it)."""
        self._summary = text
        if not trainer.is_global_zero:
            return
        if self.filename is None:
            print(text, flush=True)
            return
        os.makedirs(self.dirpath, exist_ok=True)
        with open(os.path.join(self.dirpath, f"fit-{self.filename}.txt"), "w") as f:
            f.write(text + "\n")
