"""callbacks.EMA on real ranks: the moving average of each rank's own shard equals one process's average of its
weights under every strategy, is never gathered, is what validation, test and `validate()` after fit run with
(training goes on with the trained weights), and travels in checkpoints like the weights: resharded between
strategies and world sizes, written once under hybrid sharding, exported to safetensors with `--ema`.

The model is the parity tests' TiedLM (an embedding tied to the head, a frozen weight, two parameter groups,
units whose sizes do not divide by the world size), with a validation and a test step.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from callbacks import EMA, Callback, ModelCheckpoint
from strategies import FSDPStrategy
from tests.test_checkpoint import keeps_determinism_setting, rank_zero, stored_chunks
from tests.test_parity import (
    PER_RANK_BATCH,
    STRATEGIES,
    VOCAB,
    Block,
    TiedLM,
    make_strategy,
    max_relative_difference,
    token_dataset,
    world_size,
)
from trainer import Trainer
from trainer import checkpoint as ckpt_io

DECAY, STEPS, ACCUMULATE = 0.6, 4, 2
TRAINABLE = [
    "emb.weight",
    "blocks.0.l1.weight",
    "blocks.0.l1.bias",
    "blocks.0.l2.weight",
    "blocks.0.l2.bias",
    "blocks.1.l1.weight",
    "blocks.1.l1.bias",
    "blocks.1.l2.weight",
    "blocks.1.l2.bias",
    "frozen.bias",
]


class ValLM(TiedLM):
    def loss(self, batch) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def validation_step(self, batch, batch_idx):
        self.log("val/loss", self.loss(batch), sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test/loss", self.loss(batch), sync_dist=True)


class Recorder(Callback):
    """The weights after every optimizer step, in full (every rank), and the validation metric each time."""

    def __init__(self, ema: EMA | None = None) -> None:
        self.ema, self.weights, self.validations, self._seen = ema, [], [], 0

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > self._seen:
            self._seen = trainer.global_step
            self.weights.append(trainer.strategy.full_state_dict())

    def on_validation_end(self, trainer, module) -> None:
        if trainer.state.stage == "fit":
            average = full_average(trainer, self.ema) if self.ema is not None else None
            self.validations.append((float(trainer.callback_metrics["val/loss"]), average))


def val_loader(batch_size: int = 3) -> DataLoader:
    return DataLoader(token_dataset(10, seed=2), batch_size=batch_size)


def fit(
    strategy: str,
    devices: int,
    batch_size: int,
    optimizer: str = "sgd",
    steps: int = STEPS,
    callbacks: list | None = None,
    validate: bool = False,
    ckpt_path: str | None = None,
    **kwargs,
) -> tuple[Trainer, ValLM]:
    torch.manual_seed(0)
    module = ValLM(optimizer=optimizer)
    options = dict(
        max_steps=steps,
        max_epochs=1,
        accumulate_grad_batches=ACCUMULATE,
        logger=False,
        num_sanity_val_steps=0,
        enable_checkpointing=False,
        enable_progress_bar=False,
        val_check_interval=4,
    )
    trainer = Trainer(
        strategy=make_strategy(strategy), devices=devices, callbacks=callbacks or [], **{**options, **kwargs}
    )
    loader = DataLoader(token_dataset(), batch_size=batch_size, shuffle=False)
    trainer.fit(module, loader, val_loader() if validate else None, ckpt_path=ckpt_path)
    return trainer, module


def full_average(trainer: Trainer, ema: EMA) -> dict[str, torch.Tensor] | None:
    """The average in full on rank 0 (None elsewhere), put together from every rank's `sharded_state`."""
    mine = {
        name: (tuple(p.shape), [(start, data.clone()) for start, data in p.pieces])
        for name, p in ema.sharded_state(trainer).get("ema", {}).items()
    }
    out: dict[str, torch.Tensor] = {}
    for rank_pieces in trainer.strategy.all_gather_object(mine):
        for name, (shape, pieces) in rank_pieces.items():
            flat = out.setdefault(name, torch.full((math.prod(shape),), math.nan)).view(-1)
            for start, data in pieces:
                flat[start : start + data.numel()] = data
            out[name] = flat.view(shape)
    assert not any(t.isnan().any() for t in out.values())
    return out if trainer.is_global_zero else None


def reference_average(weights: list[dict], names: list[str], decay: float, steps: list[int]) -> dict:
    """The moving average, in one process, of the weights after the given optimizer steps (0-based)."""
    average = {n: weights[steps[0]][n].float().clone() for n in names}
    for step in steps[1:]:
        for n in names:
            average[n].lerp_(weights[step][n].float(), 1 - decay)
    return average


def val_loss(state: dict[str, torch.Tensor]) -> float:
    """The mean validation loss of the model with `state`, in one process."""
    module = ValLM()
    module.load_state_dict(state)
    x, y = token_dataset(10, seed=2).tensors
    with torch.no_grad():
        return module.loss((x, y)).item()


def with_average(weights: dict, average: dict) -> dict:
    """The trained state dict with the averaged parameters in place (the tied head follows the embedding)."""
    return {**weights, **average, "head.weight": average["emb.weight"]}


# -- the average equals one process's -------------------------------------------------------------------------
def body_every_strategy() -> dict | None:
    results = {}
    for optimizer in ("sgd", "adamw"):
        for name in STRATEGIES:
            ema = EMA(decay=DECAY)
            trainer, _ = fit(name, world_size(), PER_RANK_BATCH, optimizer, callbacks=[ema])
            assert trainer.global_step == STEPS and ema.updates == STEPS
            results[(name, optimizer)] = full_average(trainer, ema)
    return results if torch.distributed.get_rank() == 0 else None


def test_the_average_under_every_strategy_at_two_ranks_equals_one_process(rank_pool):
    results = rank_pool(2).run(body_every_strategy)[0]
    for optimizer in ("sgd", "adamw"):
        recorder = Recorder()
        fit("single", 1, 2 * PER_RANK_BATCH, optimizer, callbacks=[recorder])
        want = reference_average(recorder.weights, TRAINABLE, DECAY, list(range(STEPS)))
        last = {n: recorder.weights[-1][n] for n in TRAINABLE}
        assert max_relative_difference(want, last) > 1e-3  # the average is not just the last weights
        for name in STRATEGIES:
            got = results[(name, optimizer)]
            assert sorted(got) == sorted(TRAINABLE)  # first names only, frozen weights left out
            assert max_relative_difference(got, want) <= 1e-5, (name, optimizer)


def test_update_every_n_steps_starting_at_a_step():
    """Lightning's schedule: after optimizer steps (0-based) at or past the start that divide by n."""
    ema, recorder = EMA(decay=0.5, update_every_n_steps=2, update_starting_at_step=3), Recorder()
    trainer, _ = fit("single", 1, 2, steps=8, callbacks=[ema, recorder])
    assert ema.updates == 2  # after steps 4 and 6; the first one copies the weights
    want = reference_average(recorder.weights, TRAINABLE, 0.5, [4, 6])
    assert max_relative_difference(full_average(trainer, ema), want) <= 1e-6


def test_bf16_weights_are_averaged_in_float32_and_come_back_exactly_after_validation():
    ema, recorder = EMA(decay=0.5), Recorder()
    trainer, _ = fit("single", 1, 4, steps=2, callbacks=[ema, recorder], validate=True, precision="bf16-true")
    plain, _ = fit("single", 1, 4, steps=2, validate=True, precision="bf16-true")
    average = full_average(trainer, ema)
    assert len(recorder.validations) == 1  # swapped in and back once
    assert {t.dtype for t in average.values()} == {torch.float32}
    assert max_relative_difference(average, reference_average(recorder.weights, TRAINABLE, 0.5, [0, 1])) <= 1e-6
    trained = trainer.strategy.full_state_dict()
    assert trained["emb.weight"].dtype == torch.bfloat16
    assert all(torch.equal(trained[k], v) for k, v in plain.strategy.full_state_dict().items())


# -- never gathered -------------------------------------------------------------------------------------------
def body_fsdp_communication() -> dict:
    out = {}
    for with_ema in (False, True):
        ema = EMA(decay=DECAY)
        trainer, module = fit("fsdp", 2, PER_RANK_BATCH, callbacks=[ema] if with_ema else [], validate=True)
        engine = trainer.strategy.engine
        out[with_ema] = (dict(engine.stats.elements), dict(engine.stats.calls))
        if with_ema:
            pieces = [data for p in ema.sharded_state(trainer)["ema"].values() for _, data in p.pieces]
            owned = [p.data for p in trainer.strategy.master_pieces() if p.trainable]
            out["average"] = sum(t.numel() for t in pieces)
            out["owned"] = sum(t.numel() for t in owned)
            out["storage"] = sum(t.untyped_storage().nbytes() for t in pieces)
            out["bytes"] = sum(t.numel() * t.element_size() for t in pieces)
            out["dtypes"] = {t.dtype for t in pieces}
    return out


def test_under_fsdp_the_average_is_this_ranks_shard_and_costs_no_communication(rank_pool):
    results = rank_pool(2).run(body_fsdp_communication)
    total = sum(p.numel() for p in ValLM().parameters() if p.requires_grad)
    assert sum(r["average"] for r in results) == total
    for r in results:
        assert r["average"] == r["owned"] < total  # its own pieces of the trainable parameters, no more
        assert r["storage"] == r["bytes"]  # in storage of their own size: nothing full-size behind them
        assert r["dtypes"] == {torch.float32}
        assert r[True] == r[False]  # the same collectives, elements and calls, with validation swapping it in


# -- validation runs with the average, training with the trained weights --------------------------------------
@keeps_determinism_setting
def body_validation(strategy: str) -> dict | None:
    ema = EMA(decay=DECAY)
    recorder = Recorder(ema)
    trainer, module = fit(strategy, 2, PER_RANK_BATCH, callbacks=[ema, recorder], validate=True)
    trained = trainer.strategy.full_state_dict()
    plain, _ = fit(strategy, 2, PER_RANK_BATCH, validate=True)
    after = trainer.validate(module, val_loader())[0]["val/loss"]
    tested = trainer.test(module, val_loader())[0]["test/loss"]
    again = trainer.strategy.full_state_dict()
    return rank_zero(
        trainer,
        {
            "trained": trained,
            "plain": plain.strategy.full_state_dict(),
            "again": again,
            "validations": recorder.validations,
            "after": after,
            "tested": tested,
            "average": full_average(trainer, ema),
        },
    )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_validation_and_test_run_with_the_average_and_training_with_the_trained_weights(rank_pool, strategy):
    result = rank_pool(2).run(body_validation, strategy)[0]
    # 4 steps of 2 micro-batches, validation every 4 batches: after steps 2 and 4, in the middle of the epoch
    assert len(result["validations"]) == 2
    for logged, average in result["validations"]:
        assert logged == pytest.approx(val_loss(with_average(result["trained"], average)), rel=1e-5)
    # the weights the run ends with are those of a run without EMA: validation gave them back each time
    for key, value in result["plain"].items():
        assert torch.equal(result["trained"][key], value), key
        assert torch.equal(result["again"][key], value), key  # validate() and test() after fit too
    final = val_loss(with_average(result["trained"], result["average"]))
    assert result["after"] == pytest.approx(final, rel=1e-5) and result["tested"] == pytest.approx(final, rel=1e-5)
    assert abs(val_loss(result["trained"]) - final) > 1e-4  # the trained weights would give another value


# -- checkpoints ------------------------------------------------------------------------------------------------
@keeps_determinism_setting
def body_save(root: str, strategy: str, steps: int, path: str | None) -> dict | None:
    ema = EMA(decay=DECAY)
    trainer, _ = fit(strategy, world_size(), PER_RANK_BATCH, steps=steps, callbacks=[ema], default_root_dir=root)
    if path is not None:
        trainer.save_checkpoint(path)
    return rank_zero(trainer, {"average": full_average(trainer, ema), "weights": trainer.strategy.full_state_dict()})


@keeps_determinism_setting
def body_resume(root: str, strategy: str, steps: int, path: str) -> dict | None:
    ema = EMA(decay=DECAY)
    trainer, _ = fit(
        strategy, world_size(), PER_RANK_BATCH, steps=steps, callbacks=[ema], default_root_dir=root, ckpt_path=path
    )
    return rank_zero(trainer, {"average": full_average(trainer, ema), "updates": ema.updates})


def test_the_average_is_saved_sharded_and_resumes_under_other_strategies_and_world_sizes(rank_pool, tmp_path):
    root, path = str(tmp_path), str(tmp_path / "fsdp2")
    saved = rank_pool(2).run(body_save, root, "fsdp", 2, path)[0]
    straight = rank_pool(2).run(body_save, root, "fsdp", 4, None)[0]

    # each rank wrote its own pieces of the average, every element once, beside the weights
    chunks = stored_chunks(path)
    for name in TRAINABLE:
        entries = chunks[f"ema.{name}"]
        assert sum(math.prod(sizes) for _, sizes, _ in entries) == saved["average"][name].numel()
    assert {file for name in TRAINABLE for *_, file in chunks[f"ema.{name}"]} == {"__0_0.distcp", "__1_0.distcp"}
    assert not [k for k in chunks if k in ("ema.head.weight", "ema.frozen.weight")]

    # fsdp@2 -> zero2@2, two more steps: the uninterrupted run's average
    resumed = rank_pool(2).run(body_resume, root, "zero2", 4, path)[0]
    assert resumed["updates"] == 4
    assert max_relative_difference(resumed["average"], straight["average"]) <= 1e-6

    # fsdp@2 -> ddp@1 (in this process): the same average, loaded and not stepped
    loaded = body_resume(root, "ddp", 2, path)
    assert max_relative_difference(loaded["average"], saved["average"]) == 0

    # a weights-only load for validation in one process: the average when EMA is given, else the trained weights
    for callbacks, weights in (([EMA()], with_average(saved["weights"], saved["average"])), ([], saved["weights"])):
        trainer = Trainer(
            strategy="single",
            callbacks=callbacks,
            logger=False,
            enable_progress_bar=False,
            enable_checkpointing=False,
            default_root_dir=root,
        )
        torch.manual_seed(1)  # other initial weights: all of them must come from the checkpoint
        metrics = trainer.validate(ValLM(), val_loader(), ckpt_path=path)[0]
        assert metrics["val/loss"] == pytest.approx(val_loss(weights), rel=1e-5)


def test_a_save_by_an_earlier_callback_in_the_same_hook_holds_that_steps_update(tmp_path):
    """ModelCheckpoint before EMA in `callbacks` saves in on_train_batch_end before EMA's own hook runs: the save
    brings the average up to date first, so a resume from it misses no update."""
    ema = EMA(decay=DECAY)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2)
    trainer, _ = fit(
        "single", 1, 4, steps=2, callbacks=[saver, ema], enable_checkpointing=True, default_root_dir=str(tmp_path)
    )
    average = full_average(trainer, ema)
    state = ckpt_io.load_full_state_dict(saver.best_model_path, ema=True)
    assert ema.updates == 2 and all(torch.equal(state[n], average[n]) for n in TRAINABLE)
    assert ckpt_io.load_trainer_state(saver.best_model_path)["callbacks"]["EMA"]["updates"] == 2
    with ema.applied(trainer):  # the average in the model for a while, the trained weights after
        applied = trainer.strategy.full_state_dict()
    assert all(torch.equal(applied[n], average[n]) for n in TRAINABLE)
    assert torch.equal(applied["head.weight"], average["emb.weight"])
    assert not torch.equal(trainer.strategy.full_state_dict()["emb.weight"], average["emb.weight"])


def test_export_with_ema_writes_the_average_and_loads_in_one_process(rank_pool, tmp_path, capsys):
    path, out = str(tmp_path / "ckpt"), tmp_path / "export"
    saved = rank_pool(2).run(body_save, str(tmp_path), "fsdp", 2, path)[0]
    expected = with_average(saved["weights"], saved["average"])

    state = ckpt_io.load_full_state_dict(path, ema=True)
    assert list(state) == list(saved["weights"])
    for key, value in expected.items():
        assert torch.equal(state[key], value), key  # the frozen weight and the buffers: the trained ones
    assert state["head.weight"].data_ptr() == state["emb.weight"].data_ptr()
    trained = ckpt_io.load_full_state_dict(path)
    assert all(torch.equal(trained[k], v) for k, v in saved["weights"].items())

    ckpt_io.main(["export", path, str(out), "--format", "safetensors", "--ema"])
    tensors = load_file(out / "model.safetensors")
    assert sorted(tensors) == sorted(k for k in expected if k != "head.weight")  # tied: once, as HF stores it
    for key, value in tensors.items():
        assert torch.equal(value, expected[key]), key

    plain = str(tmp_path / "plain")
    fit("single", 1, 4, steps=1, default_root_dir=str(tmp_path))[0].save_checkpoint(plain)
    with pytest.raises(ValueError, match="no EMA"):
        ckpt_io.load_full_state_dict(plain, ema=True)
    with pytest.raises(SystemExit) as exited:  # the command line says it in one line, exit code 2
        ckpt_io.main(["export", plain, str(tmp_path / "none"), "--ema"])
    assert exited.value.code == 2
    assert "export: error: checkpoint" in capsys.readouterr().err


def body_hybrid(path: str) -> dict | None:
    ema = EMA(decay=DECAY)
    strategy = FSDPStrategy(auto_wrap_policy={Block}, hybrid_shard=2)
    trainer = Trainer(
        strategy=strategy,
        devices=4,
        max_steps=2,
        callbacks=[ema],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=os.path.dirname(path),
    )
    trainer.fit(ValLM(), DataLoader(token_dataset(32), batch_size=2, shuffle=False))
    trainer.save_checkpoint(path)
    return rank_zero(trainer, full_average(trainer, ema))


def test_under_hybrid_sharding_the_first_copy_writes_the_average(rank_pool, tmp_path):
    path = str(tmp_path / "hsdp")
    average = rank_pool(4).run(body_hybrid, path)[0]
    chunks = stored_chunks(path)
    for name in TRAINABLE:
        assert sum(math.prod(sizes) for _, sizes, _ in chunks[f"ema.{name}"]) == average[name].numel()
    assert {file for name in TRAINABLE for *_, file in chunks[f"ema.{name}"]} == {"__0_0.distcp", "__1_0.distcp"}
    state = ckpt_io.load_full_state_dict(path, ema=True)
    assert all(torch.equal(state[n], average[n]) for n in TRAINABLE)


# -- arguments ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"decay": 1.5}, r"decay=1.5"),
        ({"decay": "0.9"}, r"decay='0.9'"),
        ({"update_every_n_steps": 0}, r"update_every_n_steps=0"),
        ({"update_starting_at_step": -1}, r"update_starting_at_step=-1"),
    ],
)
def test_bad_arguments_are_errors_naming_them(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        EMA(**kwargs)


def test_state_round_trips():
    ema = EMA()
    ema.load_state_dict({"updates": 0, "latest_update_step": 7})
    assert ema.state_dict() == {"updates": 0, "latest_update_step": 7}
