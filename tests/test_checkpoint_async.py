"""Asynchronous saves on real ranks: training goes on while the files are written, at most one save is in
flight, and the next save, the end of `fit` and a failure wait for it, so nothing is lost or half-written."""

from __future__ import annotations

import os
import threading

import pytest

from callbacks import Callback, ModelCheckpoint
from strategies.checkpoint import format as ckpt_format
from tests.test_checkpoint import assert_states_close, fit, keeps_determinism_setting, rank_zero
from trainer import checkpoint as ckpt_io

GATE = threading.Event()  # holds every rank's background save until training has gone on


def _gated(real):
    def file_integrity(*args, **kwargs):  # runs on each rank once its files are written, before meta.json
        assert GATE.wait(timeout=60), "the gate was never opened"
        return real(*args, **kwargs)

    return file_integrity


class SaveWhileTraining(Callback):
    """At step 2: an async save (held at the gate) and the weights then; at step 3 (trained meanwhile) whether it
    is in place yet, then a second async save, which waits for the first; at `fail_at` an error."""

    def __init__(self, root: str, fail_at: int | None = None) -> None:
        self.root, self.fail_at, self.log = root, fail_at, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        step, first, second = trainer.global_step, os.path.join(self.root, "a"), os.path.join(self.root, "b")
        if step == 2:
            self.weights = trainer.strategy.full_state_dict()
            trainer.save_checkpoint(first, async_save=True)
            self.log.append(("returned", os.path.exists(first)))
        elif step == 3:
            self.log.append(("trained", os.path.exists(first)))
            threading.Timer(0.3, GATE.set).start()
            if self.fail_at == 3:
                raise ValueError("training failed")
            trainer.save_checkpoint(second, async_save=True)  # waits for the first
            self.log.append(("second returned", os.path.exists(first)))


@keeps_determinism_setting
def _gated_body(root: str, fail_at: int | None) -> dict | None:
    GATE.clear()
    real = ckpt_format.file_integrity
    ckpt_format.file_integrity = _gated(real)
    probe = SaveWhileTraining(root, fail_at)
    error = None
    try:
        trainer, _ = fit(os.path.join(root, "run"), "fsdp", 2, 5, callbacks=[probe])
    except ValueError as raised:
        error, trainer = str(raised), None
    finally:
        ckpt_format.file_integrity = real
        GATE.set()
    complete = {name: os.path.isfile(os.path.join(root, name, "meta.json")) for name in ("a", "b")}
    saved = ckpt_io.load_full_state_dict(os.path.join(root, "a")) if complete["a"] else None
    result = {"log": probe.log, "complete": complete, "error": error, "weights": probe.weights, "saved": saved}
    return result if trainer is None else rank_zero(trainer, result)


def test_training_goes_on_while_an_async_save_is_written_and_the_next_save_waits(rank_pool, tmp_path):
    result = rank_pool(2).run(_gated_body, str(tmp_path), None)[0]
    assert result["log"] == [("returned", False), ("trained", False), ("second returned", True)]
    assert result["complete"] == {"a": True, "b": True}  # the end of fit waited for the second
    assert_states_close(result["saved"], result["weights"], atol=0)  # the weights of step 2, not later ones
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_a_failure_waits_for_the_save_in_flight(rank_pool, tmp_path):
    results = rank_pool(2).run(_gated_body, str(tmp_path), 3)
    for result in results:
        assert result["error"] == "training failed"
        assert result["complete"] == {"a": True, "b": False}
        assert_states_close(result["saved"], result["weights"], atol=0)


@keeps_determinism_setting
def _model_checkpoint_body(root: str, async_save: bool) -> dict | None:
    dirpath = os.path.join(root, "async" if async_save else "sync")
    saver = ModelCheckpoint(dirpath, every_n_train_steps=2, save_top_k=2, save_last=True, async_save=async_save)
    trainer, _ = fit(os.path.join(root, "logs"), "fsdp", 2, 7, callbacks=[saver], enable_checkpointing=True)
    names = sorted(os.listdir(dirpath))
    return rank_zero(
        trainer,
        {"names": names, "checkpoints": {name: ckpt_io.load_checkpoint(os.path.join(dirpath, name)) for name in names}},
    )


def test_model_checkpoint_async_saves_what_sync_saves(rank_pool, tmp_path):
    sync = rank_pool(2).run(_model_checkpoint_body, str(tmp_path), False)[0]
    asynchronous = rank_pool(2).run(_model_checkpoint_body, str(tmp_path), True)[0]
    assert sync["names"] == asynchronous["names"] == ["epoch=0-step=4", "epoch=1-step=6", "last"]
    for name in sync["names"]:
        a, b = sync["checkpoints"][name], asynchronous["checkpoints"][name]
        assert_states_close(a["model"], b["model"], atol=0)
        assert_states_close(a["optim"]["state"], b["optim"]["state"], atol=0)
        assert a["trainer"]["state"] == b["trainer"]["state"]
    # `last` is the step-6 checkpoint, written once and linked: the same files
    last = asynchronous["checkpoints"]["last"]
    assert last["trainer"]["state"]["global_step"] == 6
    assert_states_close(last["model"], asynchronous["checkpoints"]["epoch=1-step=6"]["model"], atol=0)


def test_async_save_is_refused_with_full(tmp_path):
    trainer, _ = fit(str(tmp_path), "single", 1, 1)
    with pytest.raises(ValueError, match=r"async_save=True.*full=True"):
        trainer.save_checkpoint(tmp_path / "x.pt", full=True, async_save=True)
    assert os.listdir(tmp_path) == []
