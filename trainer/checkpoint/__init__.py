"""A trainer's checkpoints, in torch's Distributed Checkpoint (DCP) format plus our integrity metadata
(strategies/checkpoint/: the format, writing and reading pieces, which a plain loop's strategy.save/load use too):
saved by every rank in parallel, atomically, synchronously or in the background (save.py); loaded by each rank
reading only what it needs, or whole in one process (load.py); exported to one plain file or to safetensors, and
weights imported from safetensors (export.py). `python -m trainer.checkpoint --help` for the command line."""

from strategies.checkpoint.files import find_last
from strategies.checkpoint.format import CheckpointError, read_meta

from .command import main
from .export import consolidate, export_safetensors, load_safetensors
from .load import load_checkpoint, load_full_state_dict, load_trainer_state
from .save import Saver

__all__ = [
    "CheckpointError",
    "Saver",
    "consolidate",
    "export_safetensors",
    "find_last",
    "load_checkpoint",
    "load_full_state_dict",
    "load_safetensors",
    "load_trainer_state",
    "main",
    "read_meta",
]
