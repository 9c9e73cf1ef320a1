"""`CLI`: LightningCLI's command line on this Trainer, built on jsonargparse (as LightningCLI is).

    python main.py fit --config run.yaml --config big.yaml --trainer.max_epochs 10 --model.lr 3e-4
    python main.py fit --print_config > run.yaml
    python main.py fit --ckpt_path last           # resumes with the config saved in the checkpoint

Every rank parses the same command line (the Trainer re-runs the command for `devices=N`; torchrun and srun start
it on every rank), so the same config makes the same objects everywhere.
"""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable
from typing import Any

import torch
from jsonargparse import ActionConfigFile, ArgumentParser, Namespace, class_from_function

from callbacks import Callback, Logger, ModelCheckpoint

from ..checkpoint.dirs import checkpoint_dirs
from ..construction import build_loggers
from ..datamodule import DataModule
from ..module import TrainModule
from ..seed import seed_everything
from ..trainer import Trainer
from .checks import ConfigError, KeyIndex, check_sources, explain_parse_error
from .saved import CONFIG_FILENAME, SaveConfigCallback, instantiate, saved_config_of
from .sources import PRECEDENCE, Sources, split_command_line

# The Trainer methods, and their arguments that are objects rather than configuration (as LightningCLI skips them)
SUBCOMMANDS = {
    "fit": {"module", "train_dataloaders", "val_dataloaders", "datamodule"},
    "validate": {"module", "dataloaders", "datamodule"},
    "test": {"module", "dataloaders", "datamodule"},
    "predict": {"module", "dataloaders", "datamodule"},
}
SCHEDULERS = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


class CLI:
    """LightningCLI on this Trainer: `CLI(MyModel, MyDataModule)` in a script gives it the subcommands `fit`,
    `validate`, `test` and `predict`, `--config FILE` (several, merged in order), dotted flags (`--trainer.max_epochs
    10`, `--model.lr 3e-4`), `--print_config` and `--help`, with LightningCLI's YAML layout (`trainer:`, `model:`,
    `data:`, `optimizer:`, `lr_scheduler:`, `ckpt_path:`, `seed_everything:`, `class_path`/`init_args`).

    Precedence: defaults < config files in the order given < command line flags (wherever they stand). An unknown
    or misspelled key, in a file or a flag, is an error naming the key, its file and line (or the flag) and the
    closest valid keys; a value of the wrong type names the type expected. The resolved config is saved by rank 0
    as `config.yaml` in the log folder and in every checkpoint directory, and handed to every logger;
    `fit --ckpt_path last` (or a checkpoint directory) resumes with that saved config, under the command line's.

    Args:
        model_class: the `TrainModule` class (or a function returning one) to configure; `None` for any subclass of
            `TrainModule`, chosen by `model: class_path:`.
        datamodule_class: the `DataModule` class (or function); `None` for an optional `data:` of any subclass.
        save_config_callback: the callback class that saves the config; `None` to not save it.
        save_config_kwargs: keyword arguments of `save_config_callback` (e.g. `{"overwrite": True}`).
        trainer_class: the Trainer class (or a function returning one).
        trainer_defaults: Trainer arguments' defaults; `callbacks` given here are always added (not configurable).
        seed_everything_default: the default of `seed_everything`: an int seed, `True` (a random seed, written
            into the saved config) or `False` (do not seed).
        parser_kwargs: keyword arguments of jsonargparse's `ArgumentParser` (for a subcommand's: under its name);
            `exit_on_error=False` raises `ConfigError` instead of printing it and exiting with status 2.
        subclass_mode_model: `model:` takes any subclass of `model_class` (`class_path`/`init_args`).
        subclass_mode_data: `data:` takes any subclass of `datamodule_class`.
        args: the command line (a list of strings, or a dict of the config); `None` for `sys.argv[1:]`.
        run: run the subcommand; `False` parses a command line without subcommands and only builds the objects.
        auto_configure_optimizers: add `optimizer:` and `lr_scheduler:`; when given, they replace the model's
            `configure_optimizers`.

    Raises:
        ConfigError: (with `parser_kwargs={"exit_on_error": False}`) for a configuration it refuses.
    """

    def __init__(
        self,
        model_class: type[TrainModule] | Callable[..., TrainModule] | None = None,
        datamodule_class: type[DataModule] | Callable[..., DataModule] | None = None,
        save_config_callback: type[SaveConfigCallback] | None = SaveConfigCallback,
        save_config_kwargs: dict[str, Any] | None = None,
        trainer_class: type[Trainer] | Callable[..., Trainer] = Trainer,
        trainer_defaults: dict[str, Any] | None = None,
        seed_everything_default: bool | int = True,
        parser_kwargs: dict[str, Any] | None = None,
        subclass_mode_model: bool = False,
        subclass_mode_data: bool = False,
        args: list[str] | dict[str, Any] | None = None,
        run: bool = True,
        auto_configure_optimizers: bool = True,
    ) -> None:
        self.model_class, self.datamodule_class = (
            _as_class(model_class or TrainModule),
            _as_class(datamodule_class or DataModule),
        )
        self.subclass_mode_model = model_class is None or subclass_mode_model
        self.subclass_mode_data = datamodule_class is None or subclass_mode_data
        self.optional_data = datamodule_class is None
        self.save_config_callback = save_config_callback
        self.save_config_kwargs = dict(save_config_kwargs or {})
        self.trainer_class, self.trainer_defaults = _as_class(trainer_class), dict(trainer_defaults or {})
        self.seed_everything_default = seed_everything_default
        self.auto_configure_optimizers = auto_configure_optimizers
        self.parser_kwargs = dict(parser_kwargs or {})
        self.exit_on_error = self.parser_kwargs.pop("exit_on_error", True)
        self._parsers: dict[str | None, ArgumentParser] = {}
        self.parser = self._main_parser(run)
        self.command = list(sys.argv[1:] if args is None else args) if not isinstance(args, dict) else []
        self.resumed_from: str | None = None
        """The saved config file `fit --ckpt_path` resumed with, if any."""
        try:
            self.config = self._parse(args, run)
        except ConfigError as error:
            if not self.exit_on_error:
                raise
            self._parser(getattr(self, "subcommand", None)).print_usage(sys.stderr)
            sys.stderr.write(f"error: {error}\n")
            raise SystemExit(2) from None
        self._set_seed()
        self.before_instantiate_classes()
        self.instantiate_classes()
        self.after_instantiate_classes()
        if run:
            self._run_subcommand(self.subcommand)

    # ---- the parsers --------------------------------------------------------------------------------
    def _main_parser(self, run: bool) -> ArgumentParser:
        main_kwargs = {k: v for k, v in self.parser_kwargs.items() if k not in SUBCOMMANDS}
        if not run:
            self._parsers[None] = self._subcommand_parser(None, main_kwargs)
            return self._parsers[None]
        parser = ArgumentParser(exit_on_error=False, description=_description(), **main_kwargs)
        subcommands = parser.add_subcommands(required=True, dest="subcommand")
        for name in self.subcommands():
            summary = (getattr(self.trainer_class, name).__doc__ or name).strip().splitlines()[0]
            kwargs = {"description": summary, **self.parser_kwargs.get(name, {})}
            self._parsers[name] = self._subcommand_parser(name, kwargs)
            subcommands.add_subcommand(name, self._parsers[name], help=summary)
        return parser

    def _subcommand_parser(self, subcommand: str | None, kwargs: dict[str, Any]) -> ArgumentParser:
        kwargs.setdefault("epilog", f"Precedence: {PRECEDENCE}.")
        parser = ArgumentParser(exit_on_error=False, **kwargs)
        parser.add_argument(
            "-c",
            "--config",
            action=ActionConfigFile,
            help=f"a YAML config file; several are merged in order. Precedence: {PRECEDENCE}.",
        )
        parser.add_argument(
            "--seed_everything",
            type=bool | int,
            default=self.seed_everything_default,
            help="seed every random generator with this int; true: a random seed (saved in the "
            "config); false: do not seed",
        )
        parser.add_class_arguments(
            self.trainer_class, "trainer", fail_untyped=False, sub_configs=True, instantiate=False
        )
        defaults = {f"trainer.{k}": v for k, v in self.trainer_defaults.items() if k != "callbacks"}
        if defaults:
            parser.set_defaults(defaults)
        _add_class(parser, self.model_class, "model", self.subclass_mode_model, required=True)
        _add_class(parser, self.datamodule_class, "data", self.subclass_mode_data, required=not self.optional_data)
        self.add_arguments_to_parser(parser)
        if self.auto_configure_optimizers:
            options = dict(instantiate=False, fail_untyped=False, required=False)
            parser.add_subclass_arguments((torch.optim.Optimizer,), "optimizer", skip={"params"}, **options)
            parser.add_subclass_arguments(SCHEDULERS, "lr_scheduler", skip={"optimizer"}, **options)
        if subcommand is not None:
            self._method_arguments = getattr(self, "_method_arguments", {})
            self._method_arguments[subcommand] = parser.add_method_arguments(
                self.trainer_class, subcommand, skip=self.subcommands()[subcommand], fail_untyped=False
            )
        return parser

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        """The subcommands (Trainer methods) and their arguments that are objects, not configuration."""
        return {name: set(skip) for name, skip in SUBCOMMANDS.items()}

    def _parser(self, subcommand: str | None) -> ArgumentParser:
        return self._parsers.get(subcommand, self.parser)

    def add_arguments_to_parser(self, parser: ArgumentParser) -> None:
        """Override to add arguments (`parser.add_argument`) or links (`parser.link_arguments`) to each
        subcommand's parser."""

    # ---- parsing ------------------------------------------------------------------------------------
    def _parse(self, args: list[str] | dict[str, Any] | None, run: bool) -> Namespace:
        if isinstance(args, dict):
            self.subcommand = args.get("subcommand") if run else None
            return self.parser.parse_object(args)
        sources = split_command_line(self.command, list(self.subcommands()) if run else None)
        self.subcommand = sources.subcommand
        config = self._checked_parse(sources)
        ckpt_path = config.get(f"{self.subcommand}.ckpt_path") if self.subcommand == "fit" else None
        saved = saved_config_of(ckpt_path, self._checkpoint_dirs(config)) if ckpt_path else None
        if saved is not None:  # resume with the saved config; the command line's files and flags come after it
            self.resumed_from = saved
            sources.add_first(saved)
            config = self._checked_parse(sources)
        return config

    def _checked_parse(self, sources: Sources) -> Namespace:
        parser = self._parser(sources.subcommand)
        index = KeyIndex(parser)
        if not any(token in ("-h", "--help") for token in sources.rest):
            check_sources(index, sources)
        try:
            return self.parser.parse_args(sources.argv())
        except ConfigError:
            raise
        except Exception as error:  # jsonargparse's ArgumentError (or its type checks' errors)
            raise explain_parse_error(error, index, sources) from error

    def _checkpoint_dirs(self, config: Namespace) -> list[str]:
        """Where `fit` will look for `ckpt_path="last"`: from the configured logger and ModelCheckpoint, built
        here before any Trainer (which would start the other ranks)."""
        section = config.get(self.subcommand, config).get("trainer")
        values = {"callbacks": _plain(section.get("callbacks")), "logger": _plain(section.get("logger"))}
        small = ArgumentParser(exit_on_error=False)
        small.add_argument("--callbacks", type=list[Callback] | None)
        small.add_argument("--logger", type=bool | Logger | list[Logger] | None)
        built = instantiate(small, small.parse_object(values))
        given = list(built.callbacks or []) + list(_as_list(self.trainer_defaults.get("callbacks")))
        checkpoint = next((cb for cb in given if isinstance(cb, ModelCheckpoint)), None)
        root = os.fspath(section.get("default_root_dir") or "runs")
        loggers = build_loggers(True if built.logger is None else built.logger, root)
        return checkpoint_dirs(checkpoint, loggers[0] if loggers else None, root)

    def _set_seed(self) -> None:
        """Lightning's `seed_everything`: True picks a random seed, the same on every rank (the other ranks find it
        in the environment the Trainer started them with), and writes it into the config."""
        key = f"{self.subcommand}.seed_everything" if self.subcommand else "seed_everything"
        seed = self.config.get(key)
        if seed is False:
            return
        if seed is True:
            seed = int(os.environ.get("PL_GLOBAL_SEED") or random.randint(0, 2**32 - 1))
        self.config[key] = seed_everything(int(seed))

    # ---- building the objects -----------------------------------------------------------------------
    def before_instantiate_classes(self) -> None:
        """Override to run code before the objects are built."""

    def after_instantiate_classes(self) -> None:
        """Override to run code after the objects are built."""

    def instantiate_classes(self) -> None:
        """Build the model, the datamodule and the Trainer from the config (`config_init`)."""
        self.config_init = instantiate(self.parser, self.config)
        section = self._section(self.config_init)
        self.model, self.datamodule = section.get("model"), section.get("data")
        self._add_configure_optimizers(section)
        self.trainer = self.instantiate_trainer()

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Build the Trainer from the config's `trainer:` (and `kwargs`), with `trainer_defaults`' callbacks and
        the callback that saves the config."""
        config = {**dict(self._section(self.config_init).get("trainer") or {}), **kwargs}
        callbacks = _as_list(config.get("callbacks")) + _as_list(self.trainer_defaults.get("callbacks"))
        if self.save_config_callback is not None and not config.get("fast_dev_run"):
            sub = self._section(self.config)
            callbacks.append(
                self.save_config_callback(
                    self._parser(self.subcommand), sub, command=self.command, **self.save_config_kwargs
                )
            )
        config["callbacks"] = callbacks
        return self.trainer_class(**config)

    def _section(self, config: Namespace) -> Namespace:
        return config.get(self.subcommand, config) if self.subcommand else config

    # ---- optimizers from the config -----------------------------------------------------------------
    @staticmethod
    def configure_optimizers(module: TrainModule, optimizer: torch.optim.Optimizer, lr_scheduler: Any = None) -> Any:
        """Override to change what `optimizer:` and `lr_scheduler:` give `configure_optimizers`.

        Args:
            module: the model.
            optimizer: the optimizer `optimizer:` configures.
            lr_scheduler: the scheduler `lr_scheduler:` configures, or None.
        """
        if lr_scheduler is None:
            return optimizer
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            monitor = getattr(lr_scheduler, "monitor", "val/loss")
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": lr_scheduler, "monitor": monitor}}
        return optimizer, lr_scheduler

    def _add_configure_optimizers(self, section: Namespace) -> None:
        """`optimizer:` (and `lr_scheduler:`) given: they replace the model's configure_optimizers, built when the
        Trainer calls it (after the strategy set the parameters up)."""
        optimizer = section.get("optimizer") if self.auto_configure_optimizers else None
        if optimizer is None or self.model is None:
            return
        scheduler, cli = section.get("lr_scheduler"), self

        def configure_optimizers(module: TrainModule) -> Any:
            built = _instantiate(optimizer, module.parameters())
            return cli.configure_optimizers(module, built, _instantiate(scheduler, built) if scheduler else None)

        self.model.configure_optimizers = configure_optimizers.__get__(self.model)

    # ---- running ------------------------------------------------------------------------------------
    def _run_subcommand(self, subcommand: str) -> None:
        before, after = getattr(self, f"before_{subcommand}", None), getattr(self, f"after_{subcommand}", None)
        if callable(before):
            before()
        method = getattr(self, subcommand, None) or getattr(self.trainer, subcommand)  # a CLI subclass may define it
        section = self._section(self.config_init)
        kwargs = {key: section.get(key) for key in self._method_arguments[subcommand]}
        if self.datamodule is not None:
            kwargs["datamodule"] = self.datamodule
        method(self.model, **kwargs)
        if callable(after):
            after()


def _add_class(parser: ArgumentParser, cls: Any, key: str, subclass_mode: bool, required: bool) -> None:
    if subclass_mode:
        parser.add_subclass_arguments(cls, key, fail_untyped=False, required=required)
    else:
        parser.add_class_arguments(cls, key, fail_untyped=False, sub_configs=True)


def _as_class(given: Any) -> type:
    """A class, or a function that returns an instance (jsonargparse reads its signature as the class's)."""
    return given if isinstance(given, type) else class_from_function(given)


def _instantiate(config: Namespace, first: Any) -> Any:
    """An optimizer (or scheduler) from its `class_path`/`init_args`, given its parameters (or optimizer)."""
    module_name, _, name = config.class_path.rpartition(".")
    cls = getattr(__import__(module_name, fromlist=[name]), name)
    return cls(first, **dict(config.get("init_args") or {}))


def _plain(value: Any) -> Any:
    """Parsed values (jsonargparse Namespaces, lists of them) as plain dicts and lists."""
    if isinstance(value, Namespace):
        return value.as_dict()
    return [_plain(item) for item in value] if isinstance(value, list) else value


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def _description() -> str:
    return (
        f"Train, validate, test or predict with a configured run. Precedence: {PRECEDENCE}. The resolved "
        f"config is saved as {CONFIG_FILENAME} beside the logs and in every checkpoint."
    )
