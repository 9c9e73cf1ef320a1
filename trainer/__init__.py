"""A PyTorch trainer whose strategies (ddp, zero1, zero2, fsdp, hsdp) share one sharding engine."""

from .datamodule import DataModule
from .module import TrainModule
from .seed import seed_everything
from .trainer import Trainer

__all__ = ["DataModule", "TrainModule", "Trainer", "seed_everything"]
