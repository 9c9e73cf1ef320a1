"""What every stage (fit, validate, test, predict) does around its loop: the data and the module set up, each
loader split across the ranks, and the callbacks' setup and teardown (with a failed stage's cleanup)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from strategies.base import take_back

from .data.loaders import distributed_loader
from .datamodule import DataModule, prepare_data
from .module import TrainModule
from .seed import reset_seed

if TYPE_CHECKING:
    from .trainer import Trainer


def setup_stage(trainer: Trainer, module: Any, stage: str, datamodule: DataModule | None = None) -> TrainModule:
    """The random generators seeded again (a data-parallel strategy's habit in Lightning), the data prepared and set
    up, then the module: its setup(stage), and once configure_model and the strategy's setup (as Lightning orders
    them)."""
    if not isinstance(module, TrainModule):
        raise TypeError(f"{stage}: module must be a trainer.TrainModule, got {type(module).__name__}")
    trainer.state.stage = stage
    if trainer.strategy.reseeds_each_stage:
        reset_seed()  # before the stage's hooks, as Lightning's ddp and fsdp strategies do (its reset_seed)
    module._trainer = trainer
    trainer.datamodule = datamodule
    prepare_data(trainer, [datamodule, module])
    if datamodule is not None:
        datamodule.trainer = trainer
        datamodule.setup(stage)
    module.setup(stage)
    if module is trainer.module:
        return module
    trainer.module = module
    take_back(module)  # fit before by another Trainer: its hooks and shards go before anything reads the module
    with trainer.strategy.model_init_context():  # (fsdp: on meta, recorded; the dtype conversion too)
        module.configure_model()
        trainer.precision.convert_module(module)
    if trainer.sync_batchnorm:
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if trainer.compile and trainer.strategy.compile is None:
        trainer.strategy.compile = True  # the strategy's units (see strategies/compile.py)
    trainer.strategy.setup_module(module)
    return module


def stage_loader(
    trainer: Trainer, given: Any, default: Any, argument: str, required: bool = False, evaluation: bool = False
) -> Any:
    """The loader given to the stage's `argument`, else the hook `default()`'s, split across the ranks (unless
    `use_distributed_sampler=False`)."""
    loader = given if given is not None else default()
    if loader is None and required:
        raise ValueError(f"{argument}: no DataLoader given and the module's (or datamodule's) hook returns None")
    if not trainer.use_distributed_sampler:
        return loader  # as given: the user splits the data across ranks
    seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
    strategy = trainer.strategy  # the ranks of one tensor-parallel group read the same batches
    return distributed_loader(
        loader, strategy.data_parallel_size, strategy.data_parallel_rank, seed, argument, evaluation
    )


@contextmanager
def running(trainer: Trainer, stage: str) -> Iterator[None]:
    """Callbacks' setup and teardown around a stage; on an exception, on_exception and a failed logger."""
    trainer._call("setup", stage=stage)
    try:
        yield
        trainer.checkpointer.wait()  # the save in flight, if any, is complete before the stage ends
    except BaseException as error:
        trainer.checkpointer.wait(raise_errors=False)
        trainer._call("on_exception", error)
        for logger in trainer.loggers:
            logger.finalize("failed")
        raise
    finally:
        trainer._call("teardown", stage=stage)
        trainer.module.teardown(stage)
        if trainer.datamodule is not None:
            trainer.datamodule.teardown(stage)
        for logger in trainer.loggers:
            logger.save()
