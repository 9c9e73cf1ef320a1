"""What watches a fit: the step timer (every fit), the divergence check (detect_divergence) and the profiler."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from strategies import observe

from .divergence import DivergenceCheck

if TYPE_CHECKING:
    from ..trainer import Trainer


@contextmanager
def during_fit(trainer: Trainer) -> Iterator[None]:
    """Install the watchers for the fit; the profiler reports at its end (only when fit succeeded on this rank:
    its report gathers from every rank), and a failure is told to the ranks waiting in a divergence check."""
    check = None
    if trainer.detect_divergence and trainer.strategy.distributed:
        check = DivergenceCheck.connect(trainer.timeout)
    profiler, success = trainer.profiler, False
    with observe.watched_by(trainer.timer, check):
        if profiler is not None:
            profiler.setup(trainer)
        try:
            yield
            success = True
        except Exception as error:
            if check is not None:
                check.failed(error)
            raise
        finally:
            if profiler is not None:
                profiler.teardown(trainer, success)
