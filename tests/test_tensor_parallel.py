"""Tensor parallel composed with every strategy: a module applies torch's own tensor parallel in `configure_model`
(examples/llama.py's plan: column- and row-wise projections, sequence-parallel norms) on
`self.device_mesh["tensor_parallel"]`, and the strategy shards the local pieces over the data-parallel ranks.
K steps at dp 2 x tp 2 give one process's weights on the global batch, with accumulation and clipping."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from torch.utils.data import DataLoader, TensorDataset

from callbacks import EMA, Callback, ModelSummary
from examples.llama import LLAMA_PRESETS, Llama, tensor_parallel
from strategies import DDPStrategy, FSDPStrategy, MixedPrecision, ZeroStrategy
from tests.ranks import ROOT
from tests.test_parity import TOLERANCE, max_relative_difference
from trainer import Trainer, TrainModule

CONFIG = LLAMA_PRESETS["tiny"]
PER_RANK_BATCH, ACCUMULATE, STEPS, SEQ = 2, 2, 3, 16
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")


class TinyLlama(TrainModule):
    """The Llama example at its tiny size, split by tensor parallel in configure_model when the strategy asks."""

    def __init__(self, optimizer: str = "adamw", n_kv_heads: int = CONFIG.n_kv_heads) -> None:
        super().__init__()
        self.optimizer, self.model = optimizer, None
        self.config = dataclasses.replace(CONFIG, n_kv_heads=n_kv_heads)

    def configure_model(self) -> None:
        torch.manual_seed(0)  # the same weights on every rank and in the one-process reference
        self.model = Llama(self.config)
        if self.trainer.strategy.tensor_parallel_size > 1:
            tensor_parallel(self.model, self.device_mesh["tensor_parallel"])

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1)
        # eps 1e-6, not 1e-8: at 1e-8 Adam turns the rounding of this model's near-zero gradients (summed in
        # another order) into relative differences of 3e-4 under plain data parallel already (dp 4, ddp), beyond
        # the parity tolerance; at 1e-6 dp 4 gives 2.4e-5 and dp 2 x tp 2 2.5e-5
        return torch.optim.AdamW(self.parameters(), lr=0.01, eps=1e-6)


class LossParallelLlama(TinyLlama):
    """The logits stay split over the vocabulary; the loss and backward run in torch's loss_parallel(), as in
    Lightning's tensor-parallel example (training_step, and an overridden backward)."""

    def configure_model(self) -> None:
        torch.manual_seed(0)
        self.model = tensor_parallel(Llama(CONFIG), self.device_mesh["tensor_parallel"], loss_parallel=True)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        (tokens,) = batch
        logits = self.model(tokens[:, :-1])
        with loss_parallel():
            return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        with loss_parallel():
            super().backward(loss, *args, **kwargs)


class TorchClippedLlama(TinyLlama):
    """Clips with torch's own clip_grad_norm_ on the module's parameters, the habit from plain torch and FSDP2."""

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), 0.5)))

    def on_fit_start(self) -> None:
        self.norms = []


def tokens() -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    count = STEPS * ACCUMULATE * PER_RANK_BATCH * 4
    return TensorDataset(torch.randint(0, CONFIG.vocab_size, (count, SEQ + 1), generator=generator))


def make_strategy(name: str, tensor_parallel_size: int) -> nn.Module:
    if name == "ddp":
        return DDPStrategy(tensor_parallel_size=tensor_parallel_size)
    if name in ("zero1", "zero2"):
        return ZeroStrategy(stage=int(name[-1]), tensor_parallel_size=tensor_parallel_size)
    return FSDPStrategy(auto_wrap_policy={type(Llama(CONFIG).layers[0])}, tensor_parallel_size=tensor_parallel_size)


def fit(
    module: TrainModule,
    strategy,
    devices: int,
    batch_size: int,
    clip: float | None = 0.5,
    steps: int = STEPS,
    ckpt_path: str | None = None,
    accumulate: int = ACCUMULATE,
    shuffle: bool = False,
    precision: str = "32",
    callbacks: list | None = None,
) -> Trainer:
    trainer = Trainer(
        strategy=strategy,
        devices=devices,
        max_steps=steps,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        precision=precision,
        callbacks=callbacks,
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(tokens(), batch_size=batch_size, shuffle=shuffle), ckpt_path=ckpt_path)
    assert trainer.global_step == steps
    return trainer


# ------------------------------------------------------------------------------------ bodies run on every rank


def body_fit(optimizer: str, tensor_parallel_size: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every strategy with tensor parallel; each rank returns the full weights (put together from the pieces)."""
    out = {}
    for name in STRATEGIES:
        module = TinyLlama(optimizer)
        trainer = fit(module, make_strategy(name, tensor_parallel_size), 4, PER_RANK_BATCH)
        assert trainer.strategy.data_parallel_size == 4 // tensor_parallel_size
        out[name] = trainer.strategy.full_state_dict()
        out[f"{name} summary"] = ModelSummary().table(trainer, module)  # the whole model's counts
    return out


def body_save(name: str, tensor_parallel_size: int, path: str) -> dict[str, torch.Tensor]:
    """Two steps, then a checkpoint; the full weights then."""
    trainer = fit(TinyLlama(), make_strategy(name, tensor_parallel_size), 4, PER_RANK_BATCH, steps=2)
    trainer.save_checkpoint(path)
    trainer.save_checkpoint(path + ".pt", full=True)
    return trainer.strategy.full_state_dict()


def body_resume(name: str, tensor_parallel_size: int, path: str) -> dict[str, torch.Tensor]:
    """From the checkpoint to the third step under another layout; the full weights then."""
    devices = 2 * tensor_parallel_size  # two data-parallel ranks, as when it was written: the same batches
    trainer = fit(TinyLlama(), make_strategy(name, tensor_parallel_size), devices, PER_RANK_BATCH, ckpt_path=path)
    return trainer.strategy.full_state_dict()


class CountingLlama(TinyLlama):
    """Counts the validation samples with self.log(..., reduce_fx="sum", sync_dist=True) and a torchmetrics sum."""

    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.counted = torchmetrics.SumMetric()

    def validation_step(self, batch: list[torch.Tensor], index: int) -> None:
        samples = float(batch[0].shape[0])
        self.log("samples", samples, reduce_fx="sum", sync_dist=True)
        self.counted.update(samples)
        self.log("counted", self.counted)


def body_count() -> dict[str, float]:
    trainer = Trainer(strategy=DDPStrategy(tensor_parallel_size=2), devices=4, logger=False, enable_progress_bar=False)
    trainer.validate(CountingLlama(), DataLoader(tokens(), batch_size=PER_RANK_BATCH, shuffle=False))
    return {name: float(value) for name, value in trainer.callback_metrics.items()}


def body_loss_parallel() -> dict[str, torch.Tensor]:
    trainer = fit(LossParallelLlama("sgd"), DDPStrategy(tensor_parallel_size=2), 4, PER_RANK_BATCH)
    return trainer.strategy.full_state_dict()


def body_as_lightning_runs_it() -> dict[str, torch.Tensor]:
    """The settings of tests/scripts/lightning_tensor_parallel.py: SGD, no accumulation, no clipping, the loader
    shuffled (Lightning shuffles every split training loader; both split it with DistributedSampler's seed 0)."""
    strategy = make_strategy("fsdp", 2)
    trainer = fit(TinyLlama("sgd"), strategy, 4, PER_RANK_BATCH, clip=None, accumulate=1, shuffle=True)
    return trainer.strategy.full_state_dict()


def body_checkpointed_and_bf16() -> dict[str, dict[str, torch.Tensor]]:
    """Activation checkpointing of each block in fp32, and bf16-mixed (autocast), both at dp 2 x tp 2."""
    block = type(Llama(CONFIG).layers[0])
    checkpointed = FSDPStrategy(auto_wrap_policy={block}, activation_checkpointing={block}, tensor_parallel_size=2)
    out = {"checkpointed": fit(TinyLlama("sgd"), checkpointed, 4, PER_RANK_BATCH).strategy.full_state_dict()}
    bf16 = fit(TinyLlama("sgd"), make_strategy("fsdp", 2), 4, PER_RANK_BATCH, precision="bf16-mixed")
    out["bf16"] = bf16.strategy.full_state_dict()
    return out


def body_mixed_precision(tensor_parallel_size: int) -> dict[str, torch.Tensor]:
    """FSDPStrategy's own mixed precision (FSDP2's MixedPrecisionPolicy): bf16 parameters in compute, fp32
    reductions, on two data-parallel ranks."""
    block = type(Llama(CONFIG).layers[0])
    policy = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    strategy = FSDPStrategy(auto_wrap_policy={block}, mixed_precision=policy, tensor_parallel_size=tensor_parallel_size)
    return fit(TinyLlama("sgd"), strategy, 2 * tensor_parallel_size, PER_RANK_BATCH).strategy.full_state_dict()


def body_torch_clip(tensor_parallel_size: int) -> dict[str, tuple[dict[str, torch.Tensor], list[float]]]:
    out = {}
    for name in STRATEGIES:
        module = TorchClippedLlama("sgd")
        strategy = make_strategy(name, tensor_parallel_size)
        trainer = fit(module, strategy, 2 * tensor_parallel_size, PER_RANK_BATCH, clip=None)
        out[name] = (trainer.strategy.full_state_dict(), module.norms)
    return out


def body_eight_ranks() -> dict[str, dict[str, torch.Tensor]]:
    """Every strategy at dp 4 x tp 2 and at dp 2 x tp 4 (four key/value heads, so that tp 4 splits them) with
    SGD, fsdp at dp 4 x tp 2 with AdamW too, and hsdp 2 x 2 x tp 2 (fsdp sharding in pairs of data-parallel
    ranks, replicated across the pairs)."""
    block = type(Llama(CONFIG).layers[0])
    hsdp = FSDPStrategy(auto_wrap_policy={block}, hybrid_shard=2, tensor_parallel_size=2)
    out = {"hsdp 2 x 2 x tp 2": fit(TinyLlama("sgd"), hsdp, 8, PER_RANK_BATCH)}
    for name in STRATEGIES:
        out[f"{name} dp 4 x tp 2"] = fit(TinyLlama("sgd"), make_strategy(name, 2), 8, PER_RANK_BATCH)
        out[f"{name} dp 2 x tp 4"] = fit(TinyLlama("sgd", n_kv_heads=4), make_strategy(name, 4), 8, PER_RANK_BATCH)
    out["fsdp dp 4 x tp 2 adamw"] = fit(TinyLlama("adamw"), make_strategy("fsdp", 2), 8, PER_RANK_BATCH)
    return {name: trainer.strategy.full_state_dict() for name, trainer in out.items()}


def body_ema(path: str) -> None:
    """callbacks.EMA at dp 2 x tp 2: each rank averages its pieces; the checkpoint holds the whole average."""
    trainer = fit(TinyLlama("sgd"), make_strategy("fsdp", 2), 4, PER_RANK_BATCH, callbacks=[EMA(decay=0.5)])
    trainer.save_checkpoint(path)


def body_optimizer_state_dict_of_rank_zero() -> str:
    """The DDP habit: rank 0's optimizer.state_dict() loaded on every rank (a plain loop under ddp at tp 2)."""
    strategy = DDPStrategy(tensor_parallel_size=2)
    torch.manual_seed(0)
    model = strategy.setup_module(tensor_parallel(Llama(CONFIG), strategy.device_mesh["tensor_parallel"]))
    optimizer = strategy.setup_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01))
    (batch,) = tokens()[:PER_RANK_BATCH]
    F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
    optimizer.step()
    saved = strategy.broadcast(optimizer.state_dict())
    try:
        optimizer.load_state_dict(saved)
    except ValueError as error:
        return str(error)
    return "loaded"


def plain_step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    (batch,) = tokens()[:4]  # the same batch on every rank
    F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad()


def plain_loop(strategy, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Llama(CONFIG)
    if strategy.tensor_parallel_size > 1:
        tensor_parallel(model, strategy.device_mesh["tensor_parallel"])
    model = strategy.setup_module(model)
    return model, strategy.setup_optimizer(torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-6))


def body_plain_save(path: str) -> dict[str, torch.Tensor]:
    """A plain loop at ddp tp 2: a step, strategy.save, another step; the weights then."""
    strategy = DDPStrategy(tensor_parallel_size=2)
    model, optimizer = plain_loop(strategy, seed=0)
    plain_step(model, optimizer)
    strategy.save(path, {"model": model, "optimizer": optimizer, "step": 1})
    plain_step(model, optimizer)
    return strategy.full_state_dict()


def body_plain_load(path: str) -> dict[str, torch.Tensor]:
    """Plain fsdp on two ranks (no tensor parallel): strategy.load of that checkpoint, then the second step."""
    strategy = FSDPStrategy()
    model, optimizer = plain_loop(strategy, seed=1)  # other weights: all of them come from the checkpoint
    assert strategy.load(path, {"model": model, "optimizer": optimizer}) == {"step": 1}
    plain_step(model, optimizer)
    return strategy.full_state_dict()


def body_module_state_dict() -> dict[str, Any]:
    """module.state_dict() and load_state_dict under ddp at tp 2, as torch users call them."""
    torch.manual_seed(0)
    full = Llama(CONFIG).state_dict()
    strategy = DDPStrategy(tensor_parallel_size=2)
    model, _ = plain_loop(strategy, seed=1)
    pieces = model.state_dict()
    kinds = {type(v).__name__ for v in pieces.values()}
    model.load_state_dict(full)  # a whole state dict, such as pretrained weights
    loaded = strategy.full_state_dict()
    model.load_state_dict(pieces)  # DTensors, as state_dict() gave them
    rank0_pieces = strategy.broadcast({k: v.to_local() if isinstance(v, DTensor) else v for k, v in pieces.items()})
    try:
        model.load_state_dict(rank0_pieces)  # the DDP habit: rank 0's tensors on every rank
        refused = None
    except (ValueError, RuntimeError) as error:
        refused = str(error)
    return {"kinds": kinds, "loaded": max_relative_difference(loaded, full), "refused": refused}


class StartingWeights(Callback):
    """The whole model's weights when fit starts (after set-up, before any step)."""

    def on_fit_start(self, trainer: Trainer, module: TrainModule) -> None:
        self.weights = trainer.strategy.full_state_dict()


class MemorylessLlama(TinyLlama):
    def configure_model(self) -> None:
        super().configure_model()
        local = [p.to_local() if isinstance(p, DTensor) else p for p in self.model.parameters()]
        self.held_no_memory = all(t.data_ptr() == 0 for t in local)  # meta tensors (that look like CPU ones)


def body_meta_init() -> tuple[bool, dict[str, torch.Tensor]]:
    """FSDPStrategy builds configure_model's model on the meta device, split by tensor parallel there too."""
    starting, module = StartingWeights(), MemorylessLlama("sgd")
    fit(module, make_strategy("fsdp", 2), 4, PER_RANK_BATCH, steps=1, callbacks=[starting])
    return module.held_no_memory, starting.weights


# ------------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_dp2_x_tp2_gives_one_process_weights_under_every_strategy(rank_pool, optimizer):
    want = fit(TinyLlama(optimizer), "single", 1, PER_RANK_BATCH * 2).strategy.full_state_dict()
    results = rank_pool(4).run(body_fit, optimizer, 2)
    total = sum(p.numel() for p in Llama(CONFIG).parameters())
    for name in STRATEGIES:
        assert f"{total / 1000:.1f} K total" in results[0][f"{name} summary"], results[0][f"{name} summary"]
        got = results[0][name]
        assert max_relative_difference(got, want) <= TOLERANCE[optimizer], name
        assert all(torch.equal(got[k], results[3][name][k]) for k in got), name  # the same on every rank


# ------------------------------------------------------------------------------------------------- bad input


class NotSplit(TinyLlama):
    """Asks for tensor parallel and never applies it."""

    def configure_model(self) -> None:
        torch.manual_seed(0)
        self.model = Llama(CONFIG)


class OnItsOwnMesh(TinyLlama):
    """Applies tensor parallel on a mesh of its own making, not the strategy's."""

    def configure_model(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        torch.manual_seed(0)
        self.model = Llama(CONFIG)
        tensor_parallel(self.model, init_device_mesh("cpu", (2,)))


def body_error(module_class: type) -> str:
    try:
        fit(module_class(), DDPStrategy(tensor_parallel_size=2), 2, PER_RANK_BATCH)
    except ValueError as error:
        return str(error)
    return "no error"


def test_tensor_parallel_size_must_be_a_positive_int_or_auto():
    for value in (0, -2, 1.5, True, "all"):
        with pytest.raises(ValueError, match="tensor_parallel_size=.*positive int.*auto"):
            FSDPStrategy(tensor_parallel_size=value)


def test_tensor_parallel_size_must_divide_the_ranks():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 \(2\) does not divide the 1 ranks.*\[1\]"):
        Trainer(strategy=ZeroStrategy(stage=2, tensor_parallel_size=2), devices=1, logger=False)


def test_tensor_parallel_without_dtensor_parameters_names_configure_model(rank_pool):
    message = rank_pool(2).run(body_error, NotSplit)[0]
    assert "no parameter is a DTensor after configure_model" in message
    assert "parallelize_module" in message


def test_dtensor_parameters_on_another_mesh_are_refused(rank_pool):
    message = rank_pool(2).run(body_error, OnItsOwnMesh)[0]
    assert "not on the strategy's tensor-parallel mesh" in message
    assert "self.device_mesh['tensor_parallel']" in message


def test_a_checkpoint_under_dp2_x_tp2_resumes_exactly_under_other_layouts(rank_pool, tmp_path):
    from safetensors.torch import load_file

    from trainer.checkpoint import export_safetensors, load_full_state_dict

    path = str(tmp_path / "dp2_tp2")
    at_two = fit(TinyLlama(), "single", 1, PER_RANK_BATCH * 2, steps=2).strategy.full_state_dict()
    want = fit(TinyLlama(), "single", 1, PER_RANK_BATCH * 2).strategy.full_state_dict()
    saved = rank_pool(4).run(body_save, "fsdp", 2, path)[0]
    assert max_relative_difference(saved, at_two) <= TOLERANCE["adamw"]
    # the checkpoint holds the full tensors under the model's names: one process reads it whole
    whole = load_full_state_dict(path)
    assert max_relative_difference(whole, saved) == 0
    assert max_relative_difference(torch.load(path + ".pt")["model"], saved) == 0
    export_safetensors(path, tmp_path / "hf", prefix="model.")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert max_relative_difference({f"model.{k}": v for k, v in exported.items()}, saved) == 0
    # tp 2 -> plain fsdp on 2 ranks (tp 1), and -> zero1 with tp 2
    for name, tensor_parallel_size, ranks in (("fsdp", 1, 2), ("zero1", 2, 4)):
        got = rank_pool(ranks).run(body_resume, name, tensor_parallel_size, path)[0]
        assert max_relative_difference(got, want) <= TOLERANCE["adamw"], (name, tensor_parallel_size)


def test_a_one_process_checkpoint_resumes_under_tensor_parallel(rank_pool, tmp_path):
    path = str(tmp_path / "one")
    trainer = fit(TinyLlama(), "single", 1, PER_RANK_BATCH * 2, steps=2)
    trainer.save_checkpoint(path)
    want = fit(TinyLlama(), "single", 1, PER_RANK_BATCH * 2).strategy.full_state_dict()
    got = rank_pool(4).run(body_resume, "ddp", 2, path)[0]
    assert max_relative_difference(got, want) <= TOLERANCE["adamw"]


def test_logged_sums_and_torchmetrics_count_each_sample_once(rank_pool):
    pytest.importorskip("torchmetrics")
    samples = len(tokens())
    for rank, metrics in enumerate(rank_pool(4).run(body_count)):
        assert metrics == {"samples": samples, "counted": samples}, rank


def test_loss_parallel_in_training_step_and_backward_gives_one_process_weights(rank_pool):
    want = fit(TinyLlama("sgd"), "single", 1, PER_RANK_BATCH * 2).strategy.full_state_dict()
    got = rank_pool(4).run(body_loss_parallel)[0]
    assert max_relative_difference(got, want) <= TOLERANCE["sgd"]


def test_the_same_weights_as_lightnings_model_parallel_strategy(rank_pool, tmp_path):
    """Lightning's ModelParallelStrategy (parallelize_module and fully_shard in configure_model) against this
    project's FSDPStrategy(tensor_parallel_size=2) (the fully_shard calls gone), both at dp 2 x tp 2 on CPU."""
    pytest.importorskip("lightning")
    out = tmp_path / "lightning.pt"
    script = os.path.join(ROOT, "tests", "scripts", "lightning_tensor_parallel.py")
    environment = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, script, str(out)], cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lightning = torch.load(out)
    ours = rank_pool(4).run(body_as_lightning_runs_it)[0]
    assert max_relative_difference(ours, lightning) <= TOLERANCE["sgd"]


def test_activation_checkpointing_and_bf16_mixed_under_tensor_parallel(rank_pool):
    want = fit(TinyLlama("sgd"), "single", 1, PER_RANK_BATCH * 2).strategy.full_state_dict()
    want_bf16 = fit(TinyLlama("sgd"), "single", 1, PER_RANK_BATCH * 2, precision="bf16-mixed")
    got = rank_pool(4).run(body_checkpointed_and_bf16)[0]
    assert max_relative_difference(got["checkpointed"], want) <= TOLERANCE["sgd"]
    # bf16 matmuls round differently when a layer is split: within bf16's precision of one process's bf16 run
    assert max_relative_difference(got["bf16"], want_bf16.strategy.full_state_dict()) <= 1e-3


def test_fsdp_mixed_precision_under_tensor_parallel_rounds_as_without(rank_pool):
    without = rank_pool(2).run(body_mixed_precision, 1)[0]
    split = rank_pool(4).run(body_mixed_precision, 2)[0]
    assert max_relative_difference(split, without) <= 1e-3


def test_torch_clip_grad_norm_on_the_module_takes_the_norm_over_every_piece(rank_pool):
    """torch.nn.utils.clip_grad_norm_(module.parameters()) under tensor parallel: the norm of the whole model (the
    split pieces' squares summed over the tensor-parallel ranks), the same on every rank, as one process."""
    reference = TorchClippedLlama("sgd")
    want = fit(reference, "single", 1, PER_RANK_BATCH * 2, clip=None).strategy.full_state_dict()
    results = rank_pool(4).run(body_torch_clip, 2)
    for name in STRATEGIES:
        weights, norms = results[0][name]
        assert norms == pytest.approx(reference.norms, rel=1e-5), name
        assert all(results[r][name][1] == norms for r in range(4)), name
        assert max_relative_difference(weights, want) <= TOLERANCE["sgd"], name


def test_eight_ranks_every_strategy_at_dp4_x_tp2_and_dp2_x_tp4_and_hsdp_x_tp2(rank_pool):
    results = rank_pool(8).run(body_eight_ranks)[0]
    dp4 = fit(TinyLlama("sgd"), "single", 1, PER_RANK_BATCH * 4).strategy.full_state_dict()
    dp2 = fit(TinyLlama("sgd", n_kv_heads=4), "single", 1, PER_RANK_BATCH * 2).strategy.full_state_dict()
    adamw = fit(TinyLlama("adamw"), "single", 1, PER_RANK_BATCH * 4).strategy.full_state_dict()
    assert len(results) == 2 * len(STRATEGIES) + 2
    for name, got in results.items():
        want = adamw if "adamw" in name else dp2 if "tp 4" in name else dp4
        tolerance = TOLERANCE["adamw" if "adamw" in name else "sgd"]
        assert max_relative_difference(got, want) <= tolerance, name


def test_ema_under_tensor_parallel_checkpoints_one_process_average(rank_pool, tmp_path):
    from trainer.checkpoint import load_full_state_dict

    one, split = str(tmp_path / "one"), str(tmp_path / "split")
    fit(TinyLlama("sgd"), "single", 1, PER_RANK_BATCH * 2, callbacks=[EMA(decay=0.5)]).save_checkpoint(one)
    rank_pool(4).run(body_ema, split)
    want, got = load_full_state_dict(one, ema=True), load_full_state_dict(split, ema=True)
    assert max_relative_difference(got, want) <= TOLERANCE["sgd"]
    assert max_relative_difference(load_full_state_dict(split), load_full_state_dict(one)) <= TOLERANCE["sgd"]


def test_rank_zeros_optimizer_state_dict_is_refused_on_the_other_tensor_parallel_rank(rank_pool):
    """Same shapes, other values: loading rank 0's pieces' moments on tensor-parallel rank 1 would be silent."""
    results = rank_pool(4).run(body_optimizer_state_dict_of_rank_zero)
    assert results[0] == results[2] == "loaded"  # tensor-parallel rank 0: its own pieces (ddp replicates them)
    for message in (results[1], results[3]):
        assert "tensor-parallel rank 1's pieces" in message and "rank 0's pieces" in message


def test_a_plain_loops_strategy_save_under_tensor_parallel_loads_without(rank_pool, tmp_path):
    path = str(tmp_path / "plain")
    want = rank_pool(4).run(body_plain_save, path)[0]
    got = rank_pool(2).run(body_plain_load, path)[0]
    assert max_relative_difference(got, want) <= TOLERANCE["adamw"]


def test_module_state_dict_gives_dtensors_and_load_state_dict_takes_whole_tensors(rank_pool):
    results = rank_pool(4).run(body_module_state_dict)
    for rank, result in enumerate(results):
        assert result["kinds"] == {"DTensor"}, rank  # the plan makes every parameter a DTensor (norms: replicated)
        assert result["loaded"] == 0, rank
        assert "is split by tensor parallel" in result["refused"], rank


def test_built_on_meta_and_split_equals_built_eagerly(rank_pool):
    """Invariant 7 under tensor parallel: each rank's pieces replayed from the meta-device record, bit for bit."""
    torch.manual_seed(0)
    eager = {f"model.{k}": v for k, v in Llama(CONFIG).state_dict().items()}
    for rank, (held_no_memory, weights) in enumerate(rank_pool(4).run(body_meta_init)):
        assert held_no_memory, rank
        assert max_relative_difference(weights, eager) == 0, rank


def body_save_local_pieces(path: str) -> None:
    """The torch habit gone wrong: rank 0 saves its state dict's local tensors (one tensor-parallel rank's
    pieces) with torch.save."""
    strategy = DDPStrategy(tensor_parallel_size=2)
    torch.manual_seed(0)
    model = strategy.setup_module(tensor_parallel(Llama(CONFIG), strategy.device_mesh["tensor_parallel"]))
    local = {k: v.to_local() if hasattr(v, "to_local") else v for k, v in model.state_dict().items()}
    if strategy.global_rank == 0:
        torch.save({f"model.{k}": v for k, v in local.items()}, path)
    strategy.barrier()


def test_a_checkpoint_of_one_ranks_pieces_is_named_as_such(rank_pool, tmp_path):
    """Loading one tensor-parallel rank's local pieces where whole tensors belong is refused, and the error says
    that each is a 1/2 piece of the model's tensor and how to save whole ones."""
    path = str(tmp_path / "pieces.pt")
    rank_pool(2).run(body_save_local_pieces, path)
    trainer = Trainer(devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match=r"1/2 of it along dimension 0: one tensor-parallel rank's piece") as error:
        trainer.validate(TinyLlama(), DataLoader(TensorDataset(tokens().tensors[0][:2])), ckpt_path=path)
    assert "layers.0.attention.wq.weight" in str(error.value)


def body_save_four_heads(path: str) -> dict[str, torch.Tensor]:
    """dp 2 x tp 2 under fsdp, four key/value heads (so that tp 4 can split them too): two steps, a checkpoint."""
    trainer = fit(TinyLlama(n_kv_heads=4), make_strategy("fsdp", 2), 4, PER_RANK_BATCH, steps=2)
    trainer.save_checkpoint(path)
    return trainer.strategy.full_state_dict()


def body_resume_four_heads(tensor_parallel_size: int, per_rank_batch: int, path: str) -> dict[str, torch.Tensor]:
    """From that checkpoint to the third step under fsdp at `tensor_parallel_size` on this pool's ranks, with the
    same global batch (each micro-batch the same samples: the sampler deals them to the ranks in turn)."""
    strategy = make_strategy("fsdp", tensor_parallel_size)
    trainer = fit(TinyLlama(n_kv_heads=4), strategy, dist.get_world_size(), per_rank_batch, ckpt_path=path)
    return trainer.strategy.full_state_dict()


def test_a_dp2_x_tp2_checkpoint_resumes_under_tp4_and_under_plain_fsdp_on_four_ranks(rank_pool, tmp_path):
    """The same checkpoint, resumed at tp 4 (dp 2 x tp 4, eight ranks) and at tp 1 (fsdp on four ranks, half the
    batch per rank): one process's weights at the third step."""
    path = str(tmp_path / "dp2_tp2")
    want = fit(TinyLlama(n_kv_heads=4), "single", 1, PER_RANK_BATCH * 2).strategy.full_state_dict()
    rank_pool(4).run(body_save_four_heads, path)
    for tensor_parallel_size, ranks, per_rank_batch in ((4, 8, PER_RANK_BATCH), (1, 4, PER_RANK_BATCH // 2)):
        got = rank_pool(ranks).run(body_resume_four_heads, tensor_parallel_size, per_rank_batch, path)[0]
        assert max_relative_difference(got, want) <= TOLERANCE["adamw"], tensor_parallel_size
