"""The resolved configuration of a run: saved once (by rank 0) beside the logs as `config.yaml`, put inside every
checkpoint directory the run writes, handed to every logger as hyperparameters, and read back by `fit --ckpt_path`
to resume with the same configuration.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import yaml

from callbacks import Callback

from .sources import PRECEDENCE

CONFIG_FILENAME = "config.yaml"


def dump(parser: Any, config: Any) -> str:
    """The config as YAML with every key, None values included (jsonargparse 4.49 renamed skip_none)."""
    import jsonargparse

    major, minor = (int(part) for part in jsonargparse.__version__.split(".")[:2])
    keep = {"skip_unset": False} if (major, minor) >= (4, 49) else {"skip_none": False}
    return parser.dump(config, **keep)


def instantiate(parser: Any, config: Any) -> Any:
    """The objects the config describes (jsonargparse 4.49 renamed instantiate_classes)."""
    method = getattr(parser, "instantiate", None) or parser.instantiate_classes
    return method(config)


def header(command: list[str]) -> str:
    """The comment lines above a saved config: what made it and in which order the sources count."""
    shown = " ".join(command) if command else "(no arguments)"
    return (
        f"# The resolved configuration of this run, written by shardtrain's command line (trainer.cli.CLI).\n"
        f"# Command line: {shown}\n"
        f"# Precedence: {PRECEDENCE}.\n"
        f"# Run it again with: python <script> <subcommand> --config <this file>\n"
    )


def write_atomically(path: str, text: str) -> None:
    """Write aside, then rename: a reader never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    staging = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with open(staging, "w") as f:
        f.write(text)
    os.replace(staging, path)


class SaveConfigCallback(Callback):
    """Saves the command line's resolved config (Lightning's `SaveConfigCallback`): once per run, by rank 0, as
    `<log_dir>/config.yaml`; also in every checkpoint directory the run writes (atomically with it), and handed to
    every logger's `log_hyperparams`.

    Args:
        parser: the (sub)command's parser that parsed the config.
        config: the parsed config.
        config_filename: the file name, in the log folder and in checkpoints.
        overwrite: replace a config file already in the log folder (else it is an error: the folder holds another
            run's results).
        multifile: accepted for Lightning's signature; the config is always saved as one file.
        save_to_log_dir: write the file in the log folder (the checkpoints and loggers get it either way).
        command: the command line, written in the file's header.
    """

    def __init__(
        self,
        parser: Any,
        config: Any,
        config_filename: str = CONFIG_FILENAME,
        overwrite: bool = False,
        multifile: bool = False,
        save_to_log_dir: bool = True,
        command: list[str] | None = None,
    ) -> None:
        self.parser, self.config = parser, config
        self.config_filename, self.overwrite, self.save_to_log_dir = config_filename, overwrite, save_to_log_dir
        self.command = list(command or [])
        self.already_saved = False

    def text(self) -> str:
        """The config file's contents: the header, then the YAML."""
        return header(self.command) + dump(self.parser, self.config)

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        if self.already_saved:
            return
        text = self.text()
        trainer.checkpointer.texts[self.config_filename] = text  # every checkpoint directory of this run
        problem = None
        if self.save_to_log_dir and trainer.is_global_zero:
            path = os.path.join(trainer.log_dir or trainer.default_root_dir, self.config_filename)
            if os.path.isfile(path) and not self.overwrite:
                problem = (
                    f"{type(self).__name__}: {path} exists; not overwriting another run's results. Delete it, "
                    "log to another folder, or pass CLI(save_config_kwargs={'overwrite': True})"
                )
            else:
                write_atomically(path, text)
        problem = trainer.strategy.broadcast(problem)
        if problem is not None:
            raise RuntimeError(problem)
        if trainer.is_global_zero:
            values = yaml.safe_load(dump(self.parser, self.config)) or {}
            for logger in trainer.loggers:
                logger.log_hyperparams(values)
            self.save_config(trainer, module, stage)
        self.already_saved = True

    def save_config(self, trainer: Any, module: Any, stage: str) -> None:
        """Override to save the config somewhere else too; runs on rank 0 only (no collectives here)."""


def saved_config_of(ckpt_path: str, checkpoint_dirs: list[str], filename: str = CONFIG_FILENAME) -> str | None:
    """The config file inside the checkpoint `ckpt_path` ("last": the newest in `checkpoint_dirs`), or None."""
    from strategies.checkpoint.files import find_last

    path = find_last(*checkpoint_dirs) if ckpt_path == "last" else ckpt_path
    if path is None or not os.path.isdir(path):
        return None
    found = os.path.join(path, filename)
    return found if os.path.isfile(found) else None
