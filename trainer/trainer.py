"""The Trainer: the training loop, reading top to bottom. Distribution is the strategy's business."""

from __future__ import annotations

import datetime
import inspect
import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from callbacks import (
    Callback,
    EarlyStopping,
    LearningRateMonitor,
    Logger,
    ModelCheckpoint,
    ThroughputMonitor,
)
from strategies import Strategy

from . import arguments, construction, planning
from .checkpoint import Saver, find_last
from .checkpoint.dirs import checkpoint_dirs, full_file_problem
from .data.fit_data import FitLoaders
from .data.global_batch import DataLayout
from .data.loader_state import LoaderPosition
from .data.loaders import stop_workers
from .datamodule import DataModule, datamodule_in
from .evaluation.evaluate import evaluate, predict, unless_undefined
from .evaluation.metrics import MetricCollector
from .evaluation.steps import StepMemory
from .launch.preemption import SignalWatch
from .loop.fit import StepRunner
from .loop.nonfinite import NonFiniteGuard
from .loop.optimizers import SchedulerConfig, configure_optimizers, manual_optimization
from .loop.precision import Precision, check_precision
from .module import TrainModule
from .observe.divergence import enabled_by_env as divergence_by_env
from .observe.instruments import during_fit
from .observe.timing import StepTimer
from .profilers import Profiler
from .stages import running, setup_stage, stage_loader
from .state import TrainerState
from .unsupported import refuse as refuse_unsupported

# What fast_dev_run turns off, as Lightning does: nothing is saved, logged or stopped early.
FAST_DEV_RUN_DROPS = (ModelCheckpoint, EarlyStopping, LearningRateMonitor, ThroughputMonitor)


class Trainer:
    """Runs a `TrainModule`'s training, validation, test and prediction loops under a strategy.

    The arguments follow Lightning's `Trainer`. Every argument is checked in the constructor, before any other
    rank is started. Started plainly with `devices=N` (N > 1), the constructor starts the other N-1 ranks by
    running the same command again with the rank environment set; under `torchrun` or `srun` it joins the
    ranks these started. Code after `fit` runs on every rank; use `is_global_zero` to pick one.

    Args:
        strategy: how the model is spread over the ranks: `"auto"` (`"ddp"` with more than one rank or under a
            launcher, else `"single"`; with `max_memory_per_rank` the memory plan picks one at the first
            `fit`), a name `"single"`, `"ddp"`, `"zero1"`, `"zero2"`, `"fsdp"`, `"hsdp"` (see
            `strategies.get_strategy`), or a `strategies.Strategy` object that holds its own options.
        devices: ranks per node: a positive int, a list of CUDA device indices (one rank each, e.g. `[0, 2]`),
            or `"auto"` / `-1` (every visible GPU with `accelerator="cuda"`, one process on CPU).
        accelerator: `"auto"` (CUDA if available, else CPU), `"cpu"`, `"cuda"` or `"gpu"` (same as
            `"cuda"`).
        num_nodes: number of nodes. With more than one, start each node with `torchrun` or `srun`.
        precision: `"32"` (default), `"bf16-mixed"` or `"16-mixed"` (autocast; `"16-mixed"` also scales
            the loss), `"bf16-true"` or `"16-true"` (weights and batches in that dtype). Lightning's names
            `"32-true"`, `32`, `"16"`, `16` and `"bf16"` are accepted too.
        max_epochs: stop after this many epochs; `-1` for no limit. `None` (default) means 1000 when
            `max_steps` is `-1`, else no limit.
        max_steps: stop after this many optimizer steps; `-1` (default) for no limit.
        accumulate_grad_batches: batches whose gradients are summed before each optimizer step.
        global_batch_size: samples per optimizer step over all data-parallel ranks (as torchtitan's
            `training.global_batch_size`): the accumulation is derived from it, the training loader's batch size
            and the ranks, and derived again when a run resumes on another number of ranks, so the optimizer sees
            batches of the same size. `None` (default) uses `accumulate_grad_batches`.
        gradient_clip_val: clip the gradients at this value before each optimizer step; `None` to not clip.
        val_check_interval: how often validation runs within an epoch: a float in (0, 1] is a fraction of the
            training epoch, an int a number of training batches.
        limit_train_batches: training batches per epoch: a float in (0, 1] (a fraction of the loader) or an int
            count.
        limit_val_batches: validation batches per run, as `limit_train_batches`; `0` turns validation off.
        limit_test_batches: test batches, as `limit_train_batches`.
        log_every_n_steps: how often (in optimizer steps) values logged with `on_step=True` are written to the
            loggers.
        callbacks: `callbacks.Callback` objects. A `callbacks.ProgressBar`,
            `callbacks.ModelSummary` and `callbacks.ModelCheckpoint` are added unless given or turned
            off by the `enable_*` arguments.
        logger: `True` (a `callbacks.TensorBoardLogger` under `default_root_dir`), `False` or
            `None` (no logger), a `callbacks.Logger`, or a list of them (each gets every write).
        default_root_dir: folder of the default logger's runs and, without a logger, of the checkpoints.
        enable_progress_bar: add a `callbacks.ProgressBar` if `callbacks` has none.
        enable_checkpointing: add a `callbacks.ModelCheckpoint` if `callbacks` has none.
        deterministic: call `torch.use_deterministic_algorithms(True)`.
        timeout: timeout of the collectives (the process group's): seconds (a positive number) or a
            `datetime.timedelta`; `None` means 3 minutes.
        sync_batchnorm: convert the module's batch-norm layers to `torch.nn.SyncBatchNorm` (CUDA only).
        check_val_every_n_epoch: validate in every n-th epoch only.
        max_memory_per_rank: with `strategy="auto"` only: a memory budget per rank (bytes as an int, or a
            string such as `"80GiB"` or `"1.5 GB"`); the memory plan picks a strategy that fits it.
        compile: `torch.compile` the strategy's units. To choose which modules, use the strategy's own
            `compile=` argument instead.
        on_nonfinite: what a non-finite loss (or gradient norm, when clipping) does: `"error"` (raise
            `FloatingPointError` on every rank before the weights change), `"skip"` (skip the step, with a
            warning) or `"ignore"`.
        num_sanity_val_steps: validation batches run before training starts; `-1` for all of them.
        enable_model_summary: add a `callbacks.ModelSummary` if `callbacks` has none.
        fast_dev_run: `True` (1) or n: run n batches of training, validation and test once, with no logger,
            no checkpoints and no sanity check; `ModelCheckpoint`, `EarlyStopping`, `LearningRateMonitor`
            and `ThroughputMonitor` callbacks are dropped.
        use_distributed_sampler: rebuild the given `DataLoader` objects with a `DistributedSampler` (keeping
            their shuffle setting and batch size, which is per rank). `False` uses them as given.
        gradient_clip_algorithm: `"norm"` (clip the total gradient norm) or `"value"` (clip each element).
        profiler: `None`, `"simple"`, `"pytorch"` or a `trainer.profilers.Profiler`.
        detect_divergence: check before each collective that every rank makes the same one, and raise an error
            naming each rank's collective and line of code when they differ (also turned on by the environment
            variable `SHARDTRAIN_DETECT_DIVERGENCE=1`).
        max_time: stop training after this much time (summed over resumes): `"DD:HH:MM:SS"`, a
            `datetime.timedelta` or a dict of its arguments (e.g. `{"hours": 12}`).
        **unsupported: not accepted; a Lightning argument this Trainer does not take, or a misspelled one, is
            refused with a `TypeError` that names the closest thing.

    Raises:
        TypeError: for an unknown argument; a non-bool `compile`, `use_distributed_sampler`,
            `enable_model_summary` or `detect_divergence`; a `strategy`, `callbacks` entry, `logger` or
            `profiler` of the wrong type.
        ValueError: for an argument outside its valid values (the message names it); both `global_batch_size`
            and `accumulate_grad_batches`; `accelerator="cuda"` or
            CUDA `devices` beyond those available; `sync_batchnorm=True` without CUDA; `max_memory_per_rank`
            with a strategy other than `"auto"`; `enable_checkpointing=False` with a `ModelCheckpoint` in
            `callbacks`; `num_nodes > 1` without a launcher, or a launched world size that is not
            `devices * num_nodes`.

    Example:
        ```python
        trainer = Trainer(strategy="fsdp", devices=2, max_epochs=10, precision="bf16-mixed")
        trainer.fit(module, train_loader, val_loader)
        ```
    """

    def __init__(
        self,
        strategy: str | Strategy = "auto",
        devices: int | str | list[int] = "auto",
        accelerator: str = "auto",
        num_nodes: int = 1,
        precision: str | int = "32",
        max_epochs: int | None = None,
        max_steps: int = -1,
        accumulate_grad_batches: int = 1,
        global_batch_size: int | None = None,
        gradient_clip_val: float | None = None,
        val_check_interval: int | float = 1.0,
        limit_train_batches: int | float = 1.0,
        limit_val_batches: int | float = 1.0,
        limit_test_batches: int | float = 1.0,
        log_every_n_steps: int = 50,
        callbacks: list[Callback] | None = None,
        logger: bool | Logger | list[Logger] = True,
        default_root_dir: str | os.PathLike = "runs",
        enable_progress_bar: bool = True,
        enable_checkpointing: bool = True,
        deterministic: bool = False,
        timeout: Any = None,
        sync_batchnorm: bool = False,
        check_val_every_n_epoch: int = 1,
        max_memory_per_rank: int | str | None = None,
        compile: bool = False,
        on_nonfinite: str = "error",
        num_sanity_val_steps: int = 2,
        enable_model_summary: bool = True,
        fast_dev_run: bool | int = False,
        use_distributed_sampler: bool = True,
        gradient_clip_algorithm: str = "norm",
        profiler: str | Profiler | None = None,
        detect_divergence: bool = False,
        max_time: str | datetime.timedelta | dict[str, float] | None = None,
        **unsupported: Any,
    ) -> None:
        # Every argument is checked here, before any rank is started.
        refuse_unsupported(unsupported, list(inspect.signature(Trainer.__init__).parameters)[1:-1])
        self.accelerator = arguments.check_accelerator(accelerator)
        devices, self._device_ids = arguments.check_devices(devices, self.accelerator)
        arguments.check_positive_int("num_nodes", num_nodes)
        self.precision = Precision(check_precision(precision), self.accelerator)
        arguments.check_positive_int("max_epochs", max_epochs, allow_none=True, allow=(-1,))
        if not isinstance(max_steps, int) or max_steps < -1 or max_steps == 0:
            raise ValueError(f"max_steps={max_steps!r} is not valid; use -1 (no limit) or a positive int")
        arguments.check_positive_int("accumulate_grad_batches", accumulate_grad_batches)
        arguments.check_positive_int("global_batch_size", global_batch_size, allow_none=True)
        if global_batch_size is not None and accumulate_grad_batches != 1:
            raise ValueError(
                f"global_batch_size={global_batch_size} and accumulate_grad_batches="
                f"{accumulate_grad_batches}: the accumulation is derived from global_batch_size; give "
                "one of them"
            )
        arguments.check_clip(gradient_clip_val)
        self.gradient_clip_algorithm = arguments.check_choice(
            "gradient_clip_algorithm", gradient_clip_algorithm, arguments.CLIP_ALGORITHMS
        )
        self.num_sanity_val_steps = arguments.check_sanity_steps(num_sanity_val_steps)
        self.use_distributed_sampler = arguments.check_bool("use_distributed_sampler", use_distributed_sampler)
        enable_model_summary = arguments.check_bool("enable_model_summary", enable_model_summary)
        self.fast_dev_run = arguments.check_fast_dev_run(fast_dev_run)
        if self.fast_dev_run:  # n batches of each, once; nothing written (as Lightning)
            n = self.fast_dev_run
            limit_train_batches = limit_val_batches = limit_test_batches = max_steps = n
            max_epochs, val_check_interval, self.num_sanity_val_steps = 1, 1.0, 0
            logger, enable_checkpointing = False, False
            callbacks = [cb for cb in callbacks or [] if not isinstance(cb, FAST_DEV_RUN_DROPS)]
        arguments.check_fraction_or_count("val_check_interval", val_check_interval, allow_zero=False)
        for name, value in [
            ("limit_train_batches", limit_train_batches),
            ("limit_val_batches", limit_val_batches),
            ("limit_test_batches", limit_test_batches),
        ]:
            arguments.check_fraction_or_count(name, value)
        arguments.check_positive_int("log_every_n_steps", log_every_n_steps)
        arguments.check_positive_int("check_val_every_n_epoch", check_val_every_n_epoch)
        self.nonfinite = NonFiniteGuard(on_nonfinite)
        self.profiler = arguments.check_profiler(profiler)
        self.detect_divergence = arguments.check_bool("detect_divergence", detect_divergence) or divergence_by_env()
        self.max_time = arguments.check_max_time(max_time)
        self.timer = StepTimer()  # where each step's time goes (observe/timing.py); every fit
        if sync_batchnorm and self.accelerator != "cuda":
            raise ValueError("sync_batchnorm=True needs accelerator='cuda': torch's SyncBatchNorm runs on GPUs only")
        if not isinstance(compile, bool):
            raise TypeError(
                f"compile={compile!r} must be a bool; choose the modules with the strategy's own "
                "compile= (e.g. FSDPStrategy(compile={Block}))"
            )
        self.compile = compile
        self.max_memory_per_rank = planning.check_memory_budget(strategy, max_memory_per_rank)
        self.strategy = construction.resolve_strategy(strategy, devices * num_nodes)
        """The `Strategy` in use (with `strategy="auto"`, the one the first fit chose)."""
        self._auto_strategy = strategy == "auto"  # the plan may decide again once fit knows the module
        self.num_nodes = num_nodes
        self.max_epochs = max_epochs if max_epochs is not None else (1000 if max_steps == -1 else -1)
        self.max_steps, self.accumulate_grad_batches = max_steps, accumulate_grad_batches
        self.global_batch_size = global_batch_size
        self.data_layout: DataLayout | None = None  # how fit splits its epochs (data/global_batch.py)
        self.resumed_layout: dict | None = None  # the checkpoint's, when fit resumes
        self.gradient_clip_val, self.val_check_interval = gradient_clip_val, val_check_interval
        self.limit_train_batches, self.limit_val_batches = limit_train_batches, limit_val_batches
        self.limit_test_batches = limit_test_batches
        self.log_every_n_steps, self.check_val_every_n_epoch = log_every_n_steps, check_val_every_n_epoch
        self.default_root_dir = os.fspath(default_root_dir)
        self.sync_batchnorm, self.deterministic = sync_batchnorm, deterministic
        self.callbacks = construction.build_callbacks(
            callbacks, enable_progress_bar, enable_checkpointing, enable_model_summary
        )
        """The callbacks: those given, and those the Trainer added (progress bar, model summary, checkpointing)."""
        self.loggers = construction.build_loggers(logger, self.default_root_dir)
        """The loggers (`logger` is the first of them)."""
        self.timeout = arguments.check_timeout(timeout)
        self.local_rank = construction.start_ranks(self, devices, self._device_ids, num_nodes, self.timeout)
        """This process's rank on its node."""
        if deterministic:
            torch.use_deterministic_algorithms(True)
        self.state = TrainerState()
        self.metrics = MetricCollector(
            reduce=lambda tensor, op: self.strategy.all_reduce(tensor, op, data_parallel=True),
            gather=lambda obj: self.strategy.all_gather_object(obj),
            data_parallel_group=lambda: self.strategy.gradient_group,  # the ranks that see different data
        )
        self.step_memory = StepMemory()  # what a rank without an evaluation batch repeats (evaluation/steps.py)
        self.skipped_validation: str | None = None  # why fit does not validate, when a loader was given
        self.signal_watch = SignalWatch()  # SIGTERM during fit: preemption (launch/preemption.py)
        self.module: TrainModule | None = None
        """The `TrainModule` of the latest fit, validate, test or predict."""
        self.datamodule: DataModule | None = None
        """The `DataModule` of the latest stage, or None."""
        self.optimizers: list[torch.optim.Optimizer] = []
        """The optimizers `configure_optimizers` returned, set up by the strategy."""
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        self.param_group_names: list[list[list[str]]] = []  # by optimizer, by group
        self.should_stop = False
        """Set it to True to stop `fit`, as `EarlyStopping` does: after the current batch when set on every rank;
        at the end of an epoch, any rank's True stops every rank."""
        self.ckpt_path: str | None = None
        self.checkpointer = Saver()  # writes checkpoints; at most one save in flight
        self.num_training_batches = 0
        self.num_val_batches = 0
        self._fit_loaders: FitLoaders | None = None
        self.loader_position = LoaderPosition()  # the training loader's own state, for checkpoints
        self.restore_loader_state = True  # fit's argument
        self.sanity_checking = False
        self._fit_called = False

    # ---- public state -------------------------------------------------------------------------------
    global_rank = property(lambda self: self.strategy.global_rank)
    """This process's rank among all ranks (0 to `world_size - 1`)."""
    world_size = property(lambda self: self.strategy.world_size)
    """The number of ranks (processes) over all nodes."""
    is_global_zero = property(lambda self: self.strategy.is_global_zero)
    """Whether this process is rank 0 (the one that prints and writes single files)."""
    global_step = property(lambda self: self.state.global_step)
    """The number of optimizer steps taken so far (over resumes too)."""
    current_epoch = property(lambda self: self.state.epoch)
    """The epoch being trained, counted from 0."""
    callback_metrics = property(lambda self: self.metrics.callback_metrics)
    """The latest values logged with `TrainModule.log`, by name (what `ModelCheckpoint` and `EarlyStopping`
    monitor)."""
    progress_bar_metrics = property(lambda self: self.metrics.progress_bar_metrics)
    """The latest values logged with `prog_bar=True`, by name."""
    log_dir = property(lambda self: self.logger.log_dir if self.logger else self.default_root_dir)
    """The first logger's folder, or `default_root_dir` without a logger."""

    @property
    def logger(self) -> Logger | None:
        """The first of `loggers` (as Lightning); setting it replaces them all."""
        return self.loggers[0] if self.loggers else None

    @logger.setter
    def logger(self, logger: Logger | None) -> None:
        self.loggers = [] if logger is None else [logger]

    @property
    def checkpoint_callback(self) -> ModelCheckpoint | None:
        """The first `ModelCheckpoint` in `callbacks`, or None."""
        return next((cb for cb in self.callbacks if isinstance(cb, ModelCheckpoint)), None)

    # ---- fit ----------------------------------------------------------------------------------------
    def fit(
        self,
        module: TrainModule,
        train_dataloaders: Any = None,
        val_dataloaders: Any = None,
        ckpt_path: str | None = None,
        datamodule: DataModule | None = None,
        *,
        trust_pickled: bool = False,
        restore_loader_state: bool = True,
    ) -> None:
        """Train `module`, validating as `val_check_interval` says.

        The data comes from the given loaders, else the `datamodule`, else the module's own `train_dataloader`
        and `val_dataloader`. A Trainer fits once. A SIGTERM during fit ends it on every rank after a checkpoint.
        Call it on every rank.

        Args:
            module: the `TrainModule` to train.
            train_dataloaders: the training `DataLoader` (or iterable), or a `DataModule` (Lightning's positional
                form); `None` to take it from `datamodule` or the module.
            val_dataloaders: the validation `DataLoader`; `None` to take it from `datamodule` or the module (no
                validation when neither defines one).
            ckpt_path: resume from this checkpoint (a directory or full file this project wrote), or `"last"`
                (the newest checkpoint in the checkpoint folder; start from scratch when there is none).
            datamodule: a `DataModule` that provides the loaders.
            trust_pickled: with `ckpt_path`, unpickle whatever the checkpoint holds, not only tensors, plain
                data and the project's state types. Only for a checkpoint whose writer you trust: unpickling can
                run code. Without it, a checkpoint that holds other types is refused with a `CheckpointError`
                naming them (see Checkpoints in the docs).
            restore_loader_state: when `ckpt_path` holds the training loader's own state (a loader with
                `state_dict()`, such as torchdata's `StatefulDataLoader`, saved in the middle of an epoch), load it
                into the loader, so that it reads on where the checkpoint was. That state is per rank: resuming on
                another world size raises an error unless this is `False`, which reads the epoch's data again
                from its start and skips the batches already trained (see "Streaming data" in the docs).

        Raises:
            RuntimeError: if `fit` was already called on this Trainer.
            TypeError: if `module` is not a `TrainModule`.
            ValueError: if no training loader is given and the module's (or datamodule's) hook returns None; if
                `val_check_interval` is more batches than a training epoch has; if `ckpt_path` holds per-rank
                loader state of another world size and `restore_loader_state` is True.
            FloatingPointError: on a non-finite loss with `on_nonfinite="error"`.
        """
        (train_dataloaders, ckpt_path), datamodule = datamodule_in(train_dataloaders, ckpt_path, datamodule=datamodule)
        if self._fit_called:
            raise RuntimeError(
                "fit was already called on this Trainer: a Trainer fits once (its step, epoch and callbacks belong "
                "to that run). Create a new Trainer for another fit; to continue a run, pass ckpt_path to the new "
                "Trainer's fit"
            )
        self.restore_loader_state = arguments.check_bool("restore_loader_state", restore_loader_state)
        self._fit_called = True
        self._choose_strategy(module, train_dataloaders)
        setup_stage(self, module, "fit", datamodule)
        source = datamodule or module

        def train() -> Any:
            return stage_loader(self, train_dataloaders, source.train_dataloader, "train_dataloaders", required=True)

        def val() -> Any:
            return stage_loader(self, val_dataloaders, source.val_dataloader, "val_dataloaders", evaluation=True)

        # asked for when Lightning asks (data/fit_data.py)
        self._fit_loaders = FitLoaders(self, train, lambda: unless_undefined(self, module, val()))
        self.optimizers, self.lr_scheduler_configs, self.param_group_names = configure_optimizers(module, self.strategy)
        if not module.automatic_optimization:
            manual_optimization(self)
        if ckpt_path is not None:
            self._restore(ckpt_path, trust_pickled=trust_pickled)
        # SIGTERM stays noted until the stage has ended; the step timer, profiler and divergence check watch the fit
        with self.signal_watch, running(self, "fit"), during_fit(self):
            try:
                StepRunner(self, self._fit_loaders).fit()
            finally:
                self._fit_loaders.stop_workers()

    def validate(
        self,
        module: TrainModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        datamodule: DataModule | None = None,
        *,
        trust_pickled: bool = False,
    ) -> list[dict[str, float]]:
        """Run one validation epoch (`validation_step` on every batch) and return the metrics logged.

        Call it on every rank.

        Args:
            module: the `TrainModule`; `None` to use the one last given to this Trainer.
            dataloaders: the `DataLoader`, or a `DataModule`; `None` to take it from `datamodule` or the module's
                `val_dataloader`.
            ckpt_path: load the weights of this checkpoint (or `"last"`) first.
            datamodule: a `DataModule` that provides the loader.
            trust_pickled: with `ckpt_path`, unpickle whatever the checkpoint holds, not only tensors, plain
                data and the project's state types. Only for a checkpoint whose writer you trust: unpickling can
                run code. Without it, a checkpoint that holds other types is refused with a `CheckpointError`
                naming them (see Checkpoints in the docs).

        Returns:
            A list with one dict: each logged name and its epoch value.

        Raises:
            TypeError: if the module is not a `TrainModule`.
            ValueError: if no loader is given and the hook returns None.
        """
        return self._evaluate("validate", module, dataloaders, ckpt_path, datamodule, trust_pickled)

    def test(
        self,
        module: TrainModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        datamodule: DataModule | None = None,
        *,
        trust_pickled: bool = False,
    ) -> list[dict[str, float]]:
        """Run one test epoch (`test_step` on every batch) and return the metrics logged.

        Call it on every rank.

        Args:
            module: the `TrainModule`; `None` to use the one last given to this Trainer.
            dataloaders: the `DataLoader`, or a `DataModule`; `None` to take it from `datamodule` or the module's
                `test_dataloader`.
            ckpt_path: load the weights of this checkpoint (or `"last"`) first.
            datamodule: a `DataModule` that provides the loader.
            trust_pickled: with `ckpt_path`, unpickle whatever the checkpoint holds, not only tensors, plain
                data and the project's state types. Only for a checkpoint whose writer you trust: unpickling can
                run code. Without it, a checkpoint that holds other types is refused with a `CheckpointError`
                naming them (see Checkpoints in the docs).

        Returns:
            A list with one dict: each logged name and its epoch value.

        Raises:
            TypeError: if the module is not a `TrainModule`.
            ValueError: if no loader is given and the hook returns None.
        """
        return self._evaluate("test", module, dataloaders, ckpt_path, datamodule, trust_pickled)

    def predict(
        self,
        module: TrainModule | None = None,
        dataloaders: Any = None,
        ckpt_path: str | None = None,
        datamodule: DataModule | None = None,
        *,
        trust_pickled: bool = False,
    ) -> list[Any] | None:
        """Run `predict_step` on every batch and gather the predictions.

        Call it on every rank.

        Args:
            module: the `TrainModule`; `None` to use the one last given to this Trainer.
            dataloaders: the `DataLoader`, or a `DataModule`; `None` to take it from `datamodule` or the module's
                `predict_dataloader`.
            ckpt_path: load the weights of this checkpoint (or `"last"`) first.
            datamodule: a `DataModule` that provides the loader.
            trust_pickled: with `ckpt_path`, unpickle whatever the checkpoint holds, not only tensors, plain
                data and the project's state types. Only for a checkpoint whose writer you trust: unpickling can
                run code. Without it, a checkpoint that holds other types is refused with a `CheckpointError`
                naming them (see Checkpoints in the docs).

        Returns:
            On rank 0, each batch's prediction in dataset order; `None` on the other ranks.

        Raises:
            TypeError: if the module is not a `TrainModule`.
            ValueError: if no loader is given and the hook returns None.
        """
        return self._evaluate("predict", module, dataloaders, ckpt_path, datamodule, trust_pickled)

    def _evaluate(
        self, stage: str, module: Any, dataloaders: Any, ckpt_path: Any, datamodule: Any, trust_pickled: bool
    ) -> Any:
        (dataloaders, ckpt_path), datamodule = datamodule_in(dataloaders, ckpt_path, datamodule=datamodule)
        self._choose_strategy(module or self.module, None)
        module = setup_stage(self, module or self.module, stage, datamodule)
        loader_of = {"validate": "val_dataloader", "test": "test_dataloader", "predict": "predict_dataloader"}
        default = getattr(datamodule or module, loader_of[stage])
        loader = stage_loader(self, dataloaders, default, "dataloaders", required=True, evaluation=True)
        if ckpt_path is not None:
            self._restore(ckpt_path, weights_only=True, trust_pickled=trust_pickled)
        with running(self, stage):
            try:
                if stage == "predict":
                    return predict(self, loader)
                return [evaluate(self, loader, stage)]
            finally:
                stop_workers(loader)

    # ---- memory plan --------------------------------------------------------------------------------
    def plan(
        self,
        module: TrainModule,
        batch_size: int | None = None,
        seq_len: int | None = None,
        train_dataloaders: Any = None,
        hardware: Any = None,
        tensor_parallel_plan: Any = None,
    ) -> planning.MemoryPlan:
        """Estimate the memory per rank of `module` under ddp, zero1, zero2 and fsdp, and each one's step time.

        The estimate is for this Trainer's world size, precision and FSDPStrategy options, built on the meta
        device (the module is not changed). Prints the table on rank 0.

        Args:
            module: the `TrainModule` to plan for.
            batch_size: batch size per rank of the example batch.
            seq_len: sequence length of the example batch, for token models.
            train_dataloaders: a training `DataLoader` whose samples shape the batch when the module has no
                `example_input(batch_size, seq_len)`.
            hardware: the step-time forecast's profile: a name of `strategies.plan.HARDWARE`, a `Hardware`, or a
                JSON file `python -m strategies.plan ... --measure --save-hardware FILE` wrote (default: this
                machine's GPU kind, else "cpu").
            tensor_parallel_plan: under a strategy with `tensor_parallel_size` > 1, the plan the module's
                `configure_model` gives torch's `parallelize_module`, its paths under `module` (e.g.
                `{f"model.{path}": style for path, style in examples.llama.tensor_parallel_plan().items()}`), or a
                function of the module returning it: each rank is planned with its share of the split model.

        Returns:
            The plan: bytes per rank for each strategy, and `plan.forecasts[name]` (step_s,
            tokens_per_s_per_rank, mfu, exposed_comm_s).
        """
        memory = self.max_memory_per_rank or planning.local_device_memory(self)
        plan = planning.make_plan(
            self,
            module,
            batch_size,
            seq_len,
            train_dataloaders,
            memory,
            hardware=hardware,
            tensor_parallel_plan=tensor_parallel_plan,
        )
        if self.is_global_zero:
            print(plan.table(), flush=True)
        return plan

    def _choose_strategy(self, module: Any, train_dataloaders: Any) -> None:
        """strategy="auto": the first fit (or evaluation) lets the plan decide where it may (planning.py)."""
        if not self._auto_strategy or not isinstance(module, TrainModule):
            return
        self._auto_strategy = False
        chosen = planning.choose_strategy(self, module, train_dataloaders)
        if chosen is not None:
            chosen.connect(self.strategy.root_device, self.world_size, self.global_rank)
            self.strategy = chosen

    # ---- pieces ----------------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        """Call `loss.backward()` with the precision's loss scaling, between the `on_before_backward` and
        `on_after_backward` hooks (in which `.grad` is never None for a parameter that got a gradient).

        With manual optimization (`automatic_optimization = False`), call this (or `self.manual_backward`)
        instead of `loss.backward()`.

        Args:
            loss: the loss tensor.
        """
        with self.timer.phase("backward"):
            scaled = self.precision.scale_loss(loss)
            self._call("on_before_backward", scaled)
            with self.strategy.backward_context():  # (context parallel: recomputed blocks attend as in forward)
                self.module.backward(scaled)  # Lightning's hook (loss.backward() unless the module overrides it)
            self._call("on_after_backward")

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip the gradients of `optimizer`'s parameters (over all ranks' shards).

        Args:
            optimizer: an optimizer from `configure_optimizers`.
            gradient_clip_val: the clipping value; `None` for the Trainer's `gradient_clip_val` (no clipping when
                that is `None` too).
            gradient_clip_algorithm: `"norm"` or `"value"`; `None` for the Trainer's.

        Raises:
            ValueError: for a non-positive `gradient_clip_val` or an unknown `gradient_clip_algorithm`.
        """
        value = gradient_clip_val if gradient_clip_val is not None else self.gradient_clip_val
        algorithm = arguments.check_choice(
            "gradient_clip_algorithm",
            gradient_clip_algorithm or self.gradient_clip_algorithm,
            arguments.CLIP_ALGORITHMS,
        )
        if value is not None:
            arguments.check_clip(value)
            params = self.strategy.optimizer_parameters(optimizer)
            self.strategy.clip_gradients(value, params=params, algorithm=algorithm)

    def _call(self, hook: str, *args: Any, skip: Sequence[Callback] = (), **kwargs: Any) -> None:
        """Run a hook on every callback (except those in `skip`), then on the module if it defines one of that
        name."""
        self._call_callbacks([cb for cb in self.callbacks if cb not in skip], hook, *args, **kwargs)
        module_hook = getattr(self.module, hook, None)
        if module_hook is not None and hook.startswith("on_") and hook not in ("on_exception",):
            module_hook(*args, **kwargs)

    def _call_callbacks(self, callbacks: list[Callback], hook: str, *args: Any, **kwargs: Any) -> None:
        for cb in callbacks:
            getattr(cb, hook)(self, self.module, *args, **kwargs)

    # ---- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(self, path: str | os.PathLike, full: bool = False, async_save: bool = False) -> None:
        """Write a checkpoint of the module, optimizers, loop state and callbacks.

        By default a checkpoint directory (torch's DCP format; every rank writes its own pieces), which any
        strategy and world size can resume. Collective: call it on every rank.

        Args:
            path: the checkpoint directory, or with `full=True` the file.
            full: write one plain file that `torch.load` reads instead (rank 0 gathers and writes it).
            async_save: return once the state is copied, and write the files in the background while training
                goes on. One save is in flight at a time; the next save, the end of `fit` and a failure wait for
                it.

        Raises:
            ValueError: if both `full` and `async_save` are True; with `full=True`, if `path` is a directory or
                its folder cannot be made.
        """
        if full and async_save:
            raise ValueError(
                "save_checkpoint: async_save=True writes a checkpoint directory in the background, "
                "full=True one file synchronously; choose one of them"
            )
        if not full:
            self.checkpointer.save(self, path, async_save=async_save)
            return
        # Only rank 0 writes: it checks the path (and makes its folder) before any rank starts saving.
        problem = self.strategy.broadcast(full_file_problem(os.fspath(path)) if self.is_global_zero else None)
        if problem is not None:
            raise ValueError(f"save_checkpoint(full=True): {problem}")
        self.checkpointer.save_full(self, os.fspath(path))

    def _restore(self, ckpt_path: str, weights_only: bool = False, trust_pickled: bool = False) -> None:
        from .checkpoint.saver import restore

        if ckpt_path == "last":
            found = find_last(*self._checkpoint_dirs())
            if found is None:
                return  # nothing saved yet: start from scratch, as Lightning does
            ckpt_path = found
        self.ckpt_path = os.fspath(ckpt_path)
        restore(self, self.ckpt_path, weights_only, trust_pickled)

    def _checkpoint_dirs(self) -> list[str]:
        return checkpoint_dirs(self.checkpoint_callback, self.logger, self.default_root_dir)

    @property
    def estimated_stepping_batches(self) -> int:
        """The number of optimizer steps `fit` will take, from `max_epochs`, `max_steps`, the training batches
        per epoch and `accumulate_grad_batches` (for a scheduler's `total_steps`)."""
        if self._fit_loaders is not None:
            self._fit_loaders.train  # noqa: B018  (built now if not yet, as Lightning's property does)
        per_epoch = math.ceil(self.num_training_batches / self.accumulate_grad_batches)
        by_epochs = per_epoch * self.max_epochs if self.max_epochs > 0 else float("inf")
        return int(min(by_epochs, self.max_steps if self.max_steps > 0 else float("inf")))
