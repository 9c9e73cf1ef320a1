"""A PyTorch trainer whose strategies (ddp, zero1, zero2, fsdp) share one sharding engine."""

from .module import TrainModule
from .seed import seed_everything
from .trainer import Trainer

__all__ = ["TrainModule", "Trainer", "seed_everything"]
