"""What the Trainer builds from its arguments: the strategy, the callbacks it adds, the logger, and the ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from callbacks import Callback, Logger, ModelCheckpoint, ModelSummary, ProgressBar, TensorBoardLogger
from strategies import Strategy, get_strategy

from .launch import launcher, slurm

if TYPE_CHECKING:
    from .trainer import Trainer


def resolve_strategy(strategy: str | Strategy, world_size: int) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a name or a Strategy, got {type(strategy).__name__}")
    if strategy == "auto":
        return get_strategy("ddp" if world_size > 1 or launcher.detect_environment() else "single")
    return get_strategy(strategy)


def build_callbacks(callbacks: Any, progress_bar: bool, checkpointing: bool, model_summary: bool) -> list[Callback]:
    callbacks = list(callbacks or [])
    for cb in callbacks:
        if not isinstance(cb, Callback):
            raise TypeError(f"callbacks: {cb!r} is not a callbacks.Callback")
    if progress_bar and not any(isinstance(cb, ProgressBar) for cb in callbacks):
        callbacks.append(ProgressBar())
    if model_summary and not any(isinstance(cb, ModelSummary) for cb in callbacks):
        callbacks.append(ModelSummary())
    if checkpointing and not any(isinstance(cb, ModelCheckpoint) for cb in callbacks):
        callbacks.append(ModelCheckpoint())
    if not checkpointing and any(isinstance(cb, ModelCheckpoint) for cb in callbacks):
        raise ValueError("enable_checkpointing=False but a ModelCheckpoint is in callbacks; remove one of them")
    return callbacks


def build_loggers(logger: bool | Logger | list[Logger], root_dir: str) -> list[Logger]:
    """True: a TensorBoardLogger; False or None: none; a Logger, or a list of them (each gets every write)."""
    if logger is True:
        return [TensorBoardLogger(save_dir=root_dir)]
    if logger is False or logger is None:
        return []
    loggers = list(logger) if isinstance(logger, (list, tuple)) else [logger]
    for one in loggers:
        if not isinstance(one, Logger):
            raise TypeError(f"logger must be True, False, a callbacks.Logger or a list of them, got {one!r}")
    return loggers


def start_ranks(trainer: Trainer, devices: int, device_ids: list[int] | None, num_nodes: int, timeout: Any) -> int:
    """Join (or start) the ranks, connect the strategy to this rank's device; returns the local rank."""
    env = launcher.detect_environment()
    if env is None and dist.is_initialized():
        env = launcher.ClusterEnvironment(
            dist.get_rank(), dist.get_rank(), dist.get_world_size(), dist.get_world_size(), 0, "", 0
        )
    if env is None:
        env = launcher.from_slurm(devices, num_nodes)  # under srun; checks its task count against both
    if env is None and devices * num_nodes > 1:
        if num_nodes > 1:
            raise ValueError(f"num_nodes={num_nodes}: start each node with torchrun or srun (see README)")
        slurm.warn_if_srun_unused(devices)
        env = launcher.launch_local_ranks(devices)
    if env is not None and env.world_size != devices * num_nodes and devices != 1:
        raise ValueError(
            f"devices={devices} x num_nodes={num_nodes} does not match the {env.world_size} ranks "
            "of the launched environment"
        )
    if env is not None and env.world_size > 1:
        launcher.init_process_group(env, "nccl" if trainer.accelerator == "cuda" else "gloo", timeout)
    rank, world_size = (env.rank, env.world_size) if env else (0, 1)
    local_rank = env.local_rank if env else 0
    device = torch.device("cpu")
    if trainer.accelerator == "cuda":
        device = torch.device("cuda", device_ids[local_rank] if device_ids else local_rank)
        torch.cuda.set_device(device)
    trainer.strategy.connect(device, world_size, rank)
    for logger in trainer.loggers:
        logger.rank = rank
    versions = trainer.strategy.broadcast([logger.version for logger in trainer.loggers])  # one broadcast for all
    for logger, version in zip(trainer.loggers, versions):
        logger.version = version
    return local_rank
