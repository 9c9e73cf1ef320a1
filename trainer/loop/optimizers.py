"""What `configure_optimizers` may return, in every form Lightning accepts, and stepping the schedulers.

Forms: an optimizer; a list or tuple of optimizers; `([optimizers], [schedulers])`; a dict `{"optimizer": ...,
"lr_scheduler": scheduler or {"scheduler", "interval", "frequency", "monitor", "strict", "name"}, "monitor": ...}`;
a list or tuple of such dicts. A scheduler config steps every `frequency` epochs or steps (its `interval`);
`ReduceLROnPlateau` steps with the value of its `monitor` metric.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.lr_scheduler import ReduceLROnPlateau

if TYPE_CHECKING:
    from ..trainer import Trainer

INTERVALS = ("epoch", "step")
SCHEDULER_KEYS = {"scheduler", "interval", "frequency", "monitor", "strict", "name", "reduce_on_plateau"}
FORMS = (
    "an optimizer, a list of optimizers, ([optimizers], [schedulers]), a dict {'optimizer': ..., "
    "'lr_scheduler': ...} or a list of such dicts"
)


@dataclass
class SchedulerConfig:
    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True
    name: str | None = None
    optimizer_index: int = 0

    @property
    def reduce_on_plateau(self) -> bool:
        return isinstance(self.scheduler, ReduceLROnPlateau)


def _is_optimizer(value: Any) -> bool:
    return isinstance(value, torch.optim.Optimizer)


def _scheduler_config(value: Any, optimizer_index: int, monitor: str | None) -> SchedulerConfig:
    given = dict(value) if isinstance(value, dict) else {"scheduler": value}
    unknown = set(given) - SCHEDULER_KEYS
    if "scheduler" not in given or unknown:
        raise ValueError(
            f"configure_optimizers: a lr_scheduler dict needs 'scheduler' and may have "
            f"{sorted(SCHEDULER_KEYS - {'scheduler'})}; got keys {sorted(given)}"
        )
    given.pop("reduce_on_plateau", None)
    config = SchedulerConfig(optimizer_index=optimizer_index, **{"monitor": monitor, **given})
    if config.interval not in INTERVALS:
        raise ValueError(f"lr_scheduler interval={config.interval!r}; choose one of {list(INTERVALS)}")
    if not isinstance(config.frequency, int) or config.frequency < 1:
        raise ValueError(f"lr_scheduler frequency={config.frequency!r}; use a positive int")
    if not callable(getattr(config.scheduler, "step", None)):
        raise TypeError(f"configure_optimizers: {config.scheduler!r} is not a learning-rate scheduler")
    if config.reduce_on_plateau and config.monitor is None:
        raise ValueError(
            "configure_optimizers: ReduceLROnPlateau needs a metric to follow: return "
            "{'optimizer': opt, 'lr_scheduler': {'scheduler': sched, 'monitor': 'val/loss'}}"
        )
    return config


def _from_dict(value: dict, index: int) -> tuple[torch.optim.Optimizer, list[SchedulerConfig]]:
    if not _is_optimizer(value.get("optimizer")):
        raise TypeError(f"configure_optimizers: a dict needs an 'optimizer'; got keys {sorted(value)}")
    unknown = set(value) - {"optimizer", "lr_scheduler", "monitor"}
    if unknown:
        raise ValueError(
            f"configure_optimizers: unknown keys {sorted(unknown)}; a dict may have 'optimizer', "
            "'lr_scheduler' and 'monitor'"
        )
    scheduler = value.get("lr_scheduler")
    configs = [_scheduler_config(scheduler, index, value.get("monitor"))] if scheduler is not None else []
    return value["optimizer"], configs


def normalize(result: Any) -> tuple[list[torch.optim.Optimizer], list[SchedulerConfig]]:
    """Optimizers and scheduler configs from any form `configure_optimizers` may return."""
    if _is_optimizer(result):
        return [result], []
    if isinstance(result, dict):
        optimizer, configs = _from_dict(result, 0)
        return [optimizer], configs
    if isinstance(result, (list, tuple)) and result:
        if all(_is_optimizer(item) for item in result):
            return list(result), []
        if all(isinstance(item, dict) for item in result):
            pairs = [_from_dict(item, i) for i, item in enumerate(result)]
            return [opt for opt, _ in pairs], [cfg for _, configs in pairs for cfg in configs]
        if len(result) == 2 and isinstance(result[0], (list, tuple)) and isinstance(result[1], (list, tuple)):
            optimizers, schedulers = list(result[0]), list(result[1])
            if optimizers and all(_is_optimizer(o) for o in optimizers):
                return optimizers, [_scheduler_config(s, _owner(s, optimizers), None) for s in schedulers]
        if len(result) == 2 and _is_optimizer(result[0]):  # (optimizer, scheduler), this project's older form
            return [result[0]], [_scheduler_config(result[1], 0, None)]
    raise TypeError(f"configure_optimizers must return {FORMS}; got {_describe(result)}")


def _owner(scheduler: Any, optimizers: list[torch.optim.Optimizer]) -> int:
    """Which optimizer a scheduler (or scheduler dict) drives."""
    scheduler = scheduler["scheduler"] if isinstance(scheduler, dict) else scheduler
    target = getattr(scheduler, "optimizer", None)
    return next((i for i, opt in enumerate(optimizers) if opt is target), 0)


def _describe(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return f"a {type(value).__name__} of {[type(v).__name__ for v in value]}"
    return type(value).__name__


def configure_optimizers(module: Any, strategy: Any) -> tuple[list, list[SchedulerConfig], list[list[list[str]]]]:
    """Call the module's configure_optimizers (after the strategy set the model up): the optimizers (each set up
    by the strategy), their scheduler configs, and the parameter names of each optimizer's groups."""
    optimizers, configs = normalize(_call_configure_optimizers(module))
    if len(optimizers) > 1 and getattr(module, "automatic_optimization", True):
        raise ValueError(
            f"configure_optimizers returned {len(optimizers)} optimizers; as in Lightning, several optimizers "
            "need manual optimization: set self.automatic_optimization = False and step them in training_step "
            "(self.optimizers(), self.manual_backward(loss), opt.step(), opt.zero_grad())"
        )
    names = [_param_group_names(module, opt) for opt in optimizers]  # before parameters become shards
    names = [[strategy.names_of_every_stage(group) for group in groups] for groups in names]  # (pipeline's)
    return [strategy.setup_optimizer(opt) for opt in optimizers], configs, names


def _call_configure_optimizers(module: Any) -> Any:
    """The module's configure_optimizers(); torch's Muon refusing a parameter that is not a matrix says the way out."""
    try:
        return module.configure_optimizers()
    except ValueError as error:
        if "Muon only supports 2D parameters" not in str(error):
            raise
        raise ValueError(
            f"configure_optimizers: {error}. torch.optim.Muon steps matrices only: give it the 2-D weights of the "
            "hidden layers and another optimizer the rest (biases, norms, embeddings and the output head), e.g. "
            "torch.optim.AdamW, and step both by hand (self.automatic_optimization = False), as "
            "docs/optimizers.md shows"
        ) from error


def _param_group_names(module: Any, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    name_of = {id(p): name for name, p in module.named_parameters()}
    return [[name_of[id(p)] for p in group["params"] if id(p) in name_of] for group in optimizer.param_groups]


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step` must be given a closure that evaluates the loss (LBFGS)."""
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def check_closure_step(optimizer: torch.optim.Optimizer, accumulate_grad_batches: int, scaler: Any) -> None:
    """An optimizer that evaluates the loss in its step re-runs one batch's training_step: it cannot accumulate
    several batches, nor skip steps with a loss scaler (Lightning refuses both too)."""
    name = type(optimizer).__name__
    if accumulate_grad_batches != 1:
        raise ValueError(
            f"accumulate_grad_batches={accumulate_grad_batches}: {name} evaluates the loss of one batch itself, "
            "several times per step (optimizer.step(closure)); use accumulate_grad_batches=1 with it"
        )
    if scaler is not None:
        raise ValueError(
            f"precision='16-mixed' and {name} do not go together: the loss scaler may skip a step that {name} "
            "evaluates the loss in; use precision='bf16-mixed' or '32'"
        )


def step_schedulers(trainer: Trainer, interval: str, count: int) -> None:
    """Step the schedulers of `interval` ("step": `count` is the global step; "epoch": the epochs done) that are
    due; ReduceLROnPlateau with its monitored metric."""
    for config in trainer.lr_scheduler_configs:
        if config.interval != interval or count % config.frequency:
            continue
        if not config.reduce_on_plateau:
            with warnings.catch_warnings():
                if trainer.global_step > 0:  # the optimizer stepped, maybe before a resume this process never saw
                    warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
                config.scheduler.step()
            continue
        value = trainer.callback_metrics.get(config.monitor)
        if value is None:
            if config.strict:
                raise ValueError(
                    f"ReduceLROnPlateau follows {config.monitor!r}, which was not logged; logged: "
                    f"{sorted(trainer.callback_metrics)} (or set 'strict': False to skip)"
                )
            continue
        config.scheduler.step(float(value))


def manual_optimization(trainer: Trainer) -> None:
    """training_step steps the optimizers itself (self.automatic_optimization = False): each optimizer.step()
    runs the on_before_optimizer_step hooks first and counts one global step after, as Lightning does."""
    if trainer.precision.scaler is not None:
        raise ValueError(
            "manual optimization with precision='16-mixed' is not supported (its loss scaler must "
            "unscale and may skip steps); use 'bf16-mixed', or automatic optimization"
        )

    def before(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        trainer.timer.push("optimizer")
        trainer._call("on_before_optimizer_step", optimizer)

    def after(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        trainer.timer.pop("optimizer")
        trainer.state.global_step += 1

    for optimizer in trainer.optimizers:
        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)
