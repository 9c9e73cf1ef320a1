"""The Trainer's loop: short from fit to training_step, and the model usable from callbacks and after fit."""

from __future__ import annotations

import inspect
import os

import torch

from callbacks import Callback
from strategies import FSDPStrategy
from tests.test_parity import PER_RANK_BATCH, Block, TiedLM, fit, new_model, token_dataset, world_size

PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OWN_PACKAGES = tuple(os.path.join(PROJECT, package) + os.sep for package in ("trainer", "strategies", "callbacks"))


class CountsFrames(TiedLM):
    def training_step(self, batch, batch_idx):
        stack = inspect.stack()
        fit_at = next(i for i, f in enumerate(stack) if f.function == "fit" and "trainer.py" in f.filename)
        self.frames_between = sum(f.filename.startswith(OWN_PACKAGES) for f in stack[1:fit_at])
        return super().training_step(batch, batch_idx)


def test_at_most_three_of_our_frames_between_fit_and_training_step():
    module = new_model(CountsFrames)
    fit(module, "single", 1, PER_RANK_BATCH, steps=1)
    assert module.frames_between <= 3


class CallsTheModel(Callback):
    """In a callback, during training: the module computes with its real weights (under fsdp too)."""

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if batch_idx != 1:  # after the first optimizer step
            return
        x = token_dataset().tensors[0][:2]
        with torch.no_grad():
            self.output = module(x)
        with trainer.strategy.unsharded(module):
            self.state = {k: v.detach().clone() for k, v in module.state_dict().items()}


def body_model_in_callback_and_after_fit() -> dict:
    callback = CallsTheModel()
    module = new_model()
    trainer = fit(module, FSDPStrategy(auto_wrap_policy={Block}), world_size(), PER_RANK_BATCH, callbacks=[callback])
    x = token_dataset().tensors[0][:2]
    after = module(x).detach()  # with grad enabled, outside any Trainer call
    return {
        "during": callback.output,
        "state": callback.state,
        "after": after,
        "final": trainer.strategy.full_state_dict(),
    }


def test_the_model_computes_with_real_weights_in_a_callback_and_after_fit(rank_pool):
    x = token_dataset().tensors[0][:2]
    for out in rank_pool(2).run(body_model_in_callback_and_after_fit):
        plain = new_model()
        plain.load_state_dict(out["state"])
        assert torch.allclose(out["during"], plain(x).detach(), atol=1e-6)
        plain.load_state_dict(out["final"])
        assert torch.allclose(out["after"], plain(x).detach(), atol=1e-6)
        assert out["after"].abs().sum() > 0
