"""Validation during fit: when it is due (val_check_interval, check_val_every_n_epoch), the sanity check before
training, and the check that an interval can be reached at all."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..data.loaders import loader_length
from ..evaluation.evaluate import evaluate
from ..seed import rng_state, set_rng_state

if TYPE_CHECKING:
    from ..data.fit_data import FitLoaders
    from ..trainer import Trainer


def check_val_check_interval(trainer: Trainer, train_loader: Any, val_loader: Any) -> None:
    """An interval that validation can never reach is a mistake, not a run without validation."""
    interval, batches = trainer.val_check_interval, trainer.num_training_batches
    if val_loader is None or trainer.num_val_batches == 0:
        return
    sized = loader_length(train_loader) is not None
    if isinstance(interval, int) and sized and interval > batches:
        raise ValueError(
            f"val_check_interval={interval} is more than the {batches} training batch{'es' * (batches != 1)} of "
            f"an epoch, so validation would never run; use at most {batches}, a fraction of the epoch (a "
            "float), or limit_val_batches=0 to train without validation"
        )
    if isinstance(interval, float) and interval < 1.0 and not sized:
        raise ValueError(
            f"val_check_interval={interval} is a fraction of the epoch, but the training loader has no "
            "length; give an int number of batches"
        )


def validation_due(trainer: Trainer, val_loader: Any, batch_idx: int, last_batch: bool) -> bool:
    """Whether validation runs after training batch `batch_idx` (`last_batch`: the ranks agreed it ends the epoch)."""
    t = trainer
    if val_loader is None or t.num_val_batches == 0:
        return False
    if (t.current_epoch + 1) % t.check_val_every_n_epoch != 0:
        return False
    interval = t.val_check_interval
    if isinstance(interval, float):
        every = max(1, int(t.num_training_batches * interval))
        return (batch_idx + 1) % every == 0 or (
            interval == 1.0 and (batch_idx + 1 == t.num_training_batches or last_batch)
        )
    return (batch_idx + 1) % interval == 0


def validate(trainer: Trainer, val_loader: Any) -> None:
    """One validation run inside fit; training goes on afterwards."""
    evaluate(trainer, val_loader, "validate", limit=trainer.num_val_batches)
    trainer.module.train()
    trainer.metrics.stage = "train"


def sanity_check(trainer: Trainer, loaders: FitLoaders) -> None:
    """A few validation batches before training (num_sanity_val_steps, as Lightning), so that a broken
    validation_step fails in seconds; nothing it logs is kept, and checkpoint callbacks ignore it. As in
    Lightning, the random state is put back afterwards: what the validation loader's hook and the batches drew
    from it does not change the training."""
    before = rng_state()
    try:
        _sanity_steps(trainer, loaders)
    finally:
        set_rng_state(before)


def _sanity_steps(trainer: Trainer, loaders: FitLoaders) -> None:
    t = trainer
    # the validation loader is built here (only) when there is a sanity check: Lightning's order
    # (trainer/data/fit_data.py)
    if t.num_sanity_val_steps == 0 or t.limit_val_batches == 0 or loaders.val is None:
        return
    steps = t.num_val_batches if t.num_sanity_val_steps == -1 else min(t.num_sanity_val_steps, t.num_val_batches)
    if steps == 0:
        return
    t.sanity_checking = True
    t._call("on_sanity_check_start")
    evaluate(t, loaders.val, "validate", limit=steps, log=False)
    t._call("on_sanity_check_end")
    t.sanity_checking = False
    t.metrics.forget_published()
    t.module.train()
    t.metrics.stage = "train"
