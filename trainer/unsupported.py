"""Lightning Trainer arguments this Trainer does not take: a TypeError that says so and names the closest thing."""

from __future__ import annotations

import difflib
from typing import Any

CLOSEST = {
    "min_epochs": "max_epochs / max_steps, and EarlyStopping(patience=...) to stop later",
    "min_steps": "max_steps, and EarlyStopping(patience=...) to stop later",
    "limit_predict_batches": "a predict DataLoader over fewer samples",
    "overfit_batches": "limit_train_batches=n with a loader whose shuffle=False",
    "benchmark": "torch.backends.cudnn.benchmark = True before fit",
    "inference_mode": "validation, test and predict already run under torch.no_grad()",
    "detect_anomaly": "torch.autograd.set_detect_anomaly(True) before fit",
    "barebones": "logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False",
    "plugins": "precision=... and strategy=... (a Strategy object holds the options)",
    "reload_dataloaders_every_n_epochs": "a DataLoader whose dataset changes per epoch (set_epoch is called)",
    "model_registry": "trainer.checkpoint.export_safetensors for the weights",
    "gpus": "devices=N with accelerator='cuda'",
    "tpu_cores": "devices=N (TPUs are not supported)",
    "auto_lr_find": "a learning-rate sweep of your own (Lightning moved it to the Tuner)",
    "resume_from_checkpoint": "trainer.fit(module, ckpt_path=...)",
    "progress_bar_refresh_rate": "enable_progress_bar=True/False",
    "weights_summary": "enable_model_summary=True/False",
}


def refuse(unsupported: dict[str, Any], accepted: list[str]) -> None:
    """Raise a TypeError for the first argument the Trainer does not take."""
    if not unsupported:
        return
    name = next(iter(unsupported))
    if name in CLOSEST:
        raise TypeError(
            f"Trainer({name}=...) is a Lightning argument this Trainer does not support; the closest "
            f"thing here: {CLOSEST[name]}"
        )
    close = difflib.get_close_matches(name, accepted, n=1)
    hint = f"; did you mean {close[0]}?" if close else f"; the arguments are {sorted(accepted)}"
    raise TypeError(f"Trainer got an unknown argument {name!r}{hint}")
