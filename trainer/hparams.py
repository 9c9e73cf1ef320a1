"""Hyperparameters as Lightning records them: `save_hyperparameters()` with no arguments takes the arguments the
module's `__init__` was called with, from the caller's frame; `hparams.hidden_dim` reads them as attributes."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from types import FrameType
from typing import Any

from strategies.checkpoint.unpickling import admit


class HyperparametersMixin:
    """`save_hyperparameters` and `hparams`, shared by TrainModule and DataModule (as in Lightning)."""

    def save_hyperparameters(self, *args: Any, ignore: Any = None, **hparams: Any) -> None:
        """Record hyperparameters in `self.hparams` (logged, saved in checkpoints, used by
        `load_from_checkpoint`).

        Call it in `__init__`. With no arguments it records every argument `__init__` was called with (as
        Lightning).

        Args:
            *args: names of `__init__` arguments to record (`save_hyperparameters("lr", "hidden")`), or one dict
                or `argparse.Namespace` to record.
            ignore: a name or names of `__init__` arguments to leave out.
            **hparams: hyperparameters to record by keyword.
        """
        frame = inspect.currentframe().f_back
        try:
            self.hparams.update(collect(frame, self, args, ignore, hparams))
        finally:
            del frame


@admit  # checkpoints may hold it (hyperparameters recorded from another module's hparams, say)
class AttributeDict(dict):
    """A dict whose keys are also attributes: `hparams.lr == hparams["lr"]`."""

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"no hyperparameter {key!r}; recorded: {sorted(self)}") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __reduce__(self) -> tuple:
        # rebuilt from a plain dict: torch's weights_only loader fills only dicts item by item
        return AttributeDict, (dict(self),)


def init_arguments(frame: FrameType, owner: object) -> dict[str, Any]:
    """The arguments of the `__init__` running in `frame` (and of the `__init__`s of `owner`'s classes below it
    on the stack, which call it through super()), by name; **kwargs are spread, *args kept as a tuple."""
    collected: dict[str, Any] = {}
    while frame is not None and frame.f_code.co_name == "__init__" and frame.f_locals.get("self") is owner:
        info = inspect.getargvalues(frame)
        values = {name: info.locals[name] for name in info.args if name != "self"}
        if info.varargs and info.locals.get(info.varargs):
            values[info.varargs] = tuple(info.locals[info.varargs])
        if info.keywords:
            values.update(info.locals.get(info.keywords) or {})
        collected = {**values, **collected}  # the subclass's arguments win over its parents'
        frame = frame.f_back
    return collected


def collect(
    frame: FrameType, owner: object, args: tuple, ignore: Iterable[str] | str | None, given: dict[str, Any]
) -> dict[str, Any]:
    """What `save_hyperparameters(*args, ignore=..., **given)` records, called from `frame`."""
    ignore = {ignore} if isinstance(ignore, str) else set(ignore or ())
    found = init_arguments(frame, owner)
    if not args:
        chosen = found if not given else {}
    elif all(isinstance(a, str) for a in args):
        missing = [name for name in args if name not in found]
        if missing:
            raise ValueError(
                f"save_hyperparameters: {missing} are not arguments of {type(owner).__name__}.__init__; "
                f"its arguments are {sorted(found)}"
            )
        chosen = {name: found[name] for name in args}
    elif len(args) == 1 and isinstance(args[0], dict):
        chosen = dict(args[0])
    elif len(args) == 1 and hasattr(args[0], "__dict__"):  # an argparse.Namespace or similar
        chosen = dict(vars(args[0]))
    else:
        raise TypeError(
            "save_hyperparameters: give argument names, one dict or Namespace, keywords, or nothing "
            f"(then every __init__ argument); got {args!r}"
        )
    return {k: v for k, v in {**chosen, **given}.items() if k not in ignore}
