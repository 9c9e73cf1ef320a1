"""A trainer's checkpoints: the names of the public checkpoint API. The format and every reader and writer live in
the checkpoint component, strategies/checkpoint/ (a plain loop's strategy.save/load use it too); here are the
Trainer's owners of state (states.py), its saving and restoring through the component (saver.py) and where its
checkpoints go (dirs.py). `python -m trainer.checkpoint --help` for the command line."""

from strategies.checkpoint.command import main
from strategies.checkpoint.errors import CheckpointError
from strategies.checkpoint.export import consolidate, export_safetensors, load_safetensors
from strategies.checkpoint.files import find_last
from strategies.checkpoint.format import read_meta
from strategies.checkpoint.whole import load_checkpoint, load_full_state_dict, load_trainer_state

from .saver import Saver

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
