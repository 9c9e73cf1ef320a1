"""The GPU check's correctness parts: each compares the project with plain torch on the same device.

fp32 with TF32 off must agree to 1e-5 (weights, max |a - b| / max |b| per tensor); the reduced-precision modes
must give the same loss curve within 2%. Each function is one part (its own process, its own timeout).
"""

from __future__ import annotations

import gc
import os
import tempfile
from typing import Any

import torch

from strategies import FSDPStrategy, MixedPrecision, get_strategy
from trainer import Trainer

from .common import (
    LM,
    Settings,
    check,
    curve_difference,
    fit,
    guarded,
    largest_unit_bytes,
    lm_loss,
    make_optimizer,
    max_relative_difference,
    new_gpt,
    plain_run,
    small_config,
    token_batches,
    without_prefix,
    wrap_blocks,
)

FP32_TOLERANCE = 1e-5
CURVE_TOLERANCE = 0.02
STRATEGIES = ("single", "ddp", "zero1", "zero2", "fsdp")
STEPS = 4


def _strategy(name: str, **options: Any) -> Any:
    return FSDPStrategy(**wrap_blocks(), **options) if name == "fsdp" else get_strategy(name)


def _batch_size(settings: Settings) -> int:
    return 2 if settings.tiny else 8


def _fp32_parity(
    settings: Settings,
    label: str,
    strategy: Any,
    optimizer: str = "sgd",
    steps: int = STEPS,
    tolerance: float = FP32_TOLERANCE,
) -> Trainer:
    config = small_config(settings)
    batches = token_batches(config, steps, _batch_size(settings))
    want, _ = plain_run(settings, config, batches, optimizer)
    trainer = fit(settings, LM(config, optimizer), strategy, batches)
    got = without_prefix(trainer.strategy.full_state_dict())
    difference = max_relative_difference(got, want)
    check(label, difference <= tolerance, f"max relative difference {difference:.1e} (limit {tolerance:.0e})")
    return trainer


# ------------------------------------------------------------------------------------------------ parts


def part_strategies(settings: Settings) -> None:
    """Every strategy through the Trainer and through the plain loop, fp32, against plain torch."""
    for name in STRATEGIES:
        guarded(f"trainer {name} fp32", _trainer_strategy, settings, name)
    for name in STRATEGIES[1:]:
        guarded(f"plain loop {name} fp32", _plain_loop, settings, name)


def _trainer_strategy(settings: Settings, name: str) -> None:
    trainer = _fp32_parity(settings, f"trainer {name} fp32", _strategy(name))
    if name == "fsdp":
        devices = {p.device.type for p in trainer.module.parameters()}
        masters = {u.master.device.type for u in trainer.strategy.engine.units}
        state = {v.device.type for s in trainer.optimizers[0].state.values() for v in s.values() if v.dim() > 0}
        want = {settings.torch_device.type}
        check(
            "parameters on the device after fit",
            devices == masters == state == want,
            f"parameters {devices}, master shards {masters}, optimizer state {state}",
        )


def _plain_loop(settings: Settings, name: str) -> None:
    config = small_config(settings)
    batches = token_batches(config, STEPS, _batch_size(settings))
    want, _ = plain_run(settings, config, batches)
    strategy = _strategy(name)
    model = strategy.setup_module(new_gpt(config))
    optimizer = strategy.setup_optimizer(make_optimizer(model.parameters(), "sgd"))
    device = settings.torch_device
    for x, y in batches:
        lm_loss(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    difference = max_relative_difference(strategy.full_state_dict(), want)
    check(
        f"plain loop {name} fp32",
        difference <= FP32_TOLERANCE,
        f"max relative difference {difference:.1e} (limit {FP32_TOLERANCE:.0e})",
    )


def part_precision(settings: Settings) -> None:
    """The Trainer's precision modes and FSDPStrategy's MixedPrecision: the loss curve of plain torch doing the
    same (autocast; autocast with a GradScaler; a bf16 model) within 2%."""
    for precision in ("bf16-mixed", "16-mixed", "bf16-true"):
        for name in ("ddp", "fsdp"):
            guarded(f"{precision} {name}", _precision_curve, settings, precision, name, {})
    mixed = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
    guarded(
        "fsdp MixedPrecision(bf16)",
        _precision_curve,
        settings,
        "bf16-mixed",
        "fsdp",
        mixed,
        "fsdp MixedPrecision(bf16)",
    )


def _precision_curve(settings: Settings, precision: str, name: str, options: dict, label: str | None = None) -> None:
    config = small_config(settings)
    steps = 8 if settings.tiny else 20
    batches = token_batches(config, steps, _batch_size(settings))
    _, want = plain_run(settings, config, batches, "adamw", precision)
    module = LM(config, "adamw")
    strategy = _strategy(name, **options) if options else _strategy(name)
    trainer_precision = "32" if options else precision
    fit(settings, module, strategy, batches, precision=trainer_precision)
    got = [loss.item() for loss in module.losses]
    difference = curve_difference(got, want)
    check(
        label or f"{precision} {name}",
        difference <= CURVE_TOLERANCE,
        f"loss curve within {difference:.2%} (limit 2%); last loss {got[-1]:.4f} vs torch {want[-1]:.4f}",
    )


def part_offload(settings: Settings) -> None:
    """cpu_offload=True: the same weights, state kept in (pinned) host memory, and less device memory."""
    guarded("cpu_offload fp32", _offload, settings)


def _offload(settings: Settings) -> None:
    trainer = _fp32_parity(settings, "cpu_offload fp32", _strategy("fsdp", cpu_offload=True))
    engine = trainer.strategy.engine
    config = small_config(settings)
    x, y = (t.to(settings.torch_device) for t in token_batches(config, 1, _batch_size(settings))[0])
    lm_loss(trainer.module.model(x), y).backward()  # gradients as the optimizer would read them
    masters = [u.master for u in engine.units]
    grads = [p.grad for u in engine.units for p in u.shard_params.values() if p.grad is not None]
    state = [v for s in trainer.optimizers[0].state.values() for v in s.values() if v.dim() > 0]
    on_host = bool(grads) and all(t.device.type == "cpu" for t in masters + grads + state)
    cuda = settings.device == "cuda"
    pinned = {
        kind: all(t.is_pinned() for t in tensors) if cuda else None
        for kind, tensors in (("parameters", masters), ("gradients", grads), ("optimizer state", state))
    }
    # Optimizer state never crosses to the GPU (the step runs on the host), so it needs no pinning.
    check(
        "cpu_offload state in pinned host memory",
        on_host and (not cuda or (pinned["parameters"] and pinned["gradients"])),
        f"on host: {on_host} ({len(grads)} gradient shards); pinned: {pinned}",
    )
    if cuda:
        _offload_memory(settings)


def _peak_of_step(settings: Settings, strategy: Any, batch: tuple) -> tuple[int, int]:
    """(max_memory_allocated during the second step above what was allocated before the model was built, the
    largest unit's parameter bytes) for `strategy`."""
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model = strategy.setup_module(new_gpt(small_config(settings)))
    optimizer = strategy.setup_optimizer(make_optimizer(model.parameters(), "adamw"))
    x, y = (t.to(settings.torch_device) for t in batch)
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        lm_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, largest_unit_bytes(strategy)


def _offload_memory(settings: Settings) -> None:
    config = small_config(settings)
    batch = token_batches(config, 1, _batch_size(settings))[0]
    # Activations (and gradients as they form): plain torch's peak over a forward and backward, less its weights.
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    model = new_gpt(config).cuda()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.reset_peak_memory_stats()
    lm_loss(model(batch[0].cuda()), batch[1].cuda()).backward()
    torch.cuda.synchronize()
    activations = max(0, torch.cuda.max_memory_allocated() - base - weights)
    del model
    resident, _ = _peak_of_step(settings, _strategy("fsdp"), batch)
    offloaded, largest = _peak_of_step(settings, _strategy("fsdp", cpu_offload=True), batch)
    # In flight: the unit computing and the one prefetched; for the unit reducing and the one before it, the
    # reduce-scatter's input and output (on one rank a shard is the whole unit).
    in_flight = 6
    bound = in_flight * largest + activations
    mib = 2**20
    check(
        "cpu_offload max_memory_allocated",
        offloaded <= bound and offloaded < resident,
        f"offloaded {offloaded / mib:.1f} MiB, not offloaded {resident / mib:.1f} MiB (above what was allocated "
        f"before); bound {bound / mib:.1f} MiB = {in_flight} x largest unit {largest / mib:.1f} + activations "
        f"{activations / mib:.1f}",
    )


def part_activations(settings: Settings) -> None:
    from examples.gpt import Block

    guarded(
        "activation_checkpointing fp32",
        _fp32_parity,
        settings,
        "activation_checkpointing fp32",
        _strategy("fsdp", activation_checkpointing={Block}),
    )
    guarded(
        "activation_offload fp32",
        _fp32_parity,
        settings,
        "activation_offload fp32",
        _strategy("fsdp", activation_offload=True),
    )


def part_compile(settings: Settings) -> None:
    """compile={Block}: inductor (triton kernels on the GPU) inside fsdp's units; against plain torch with each
    Block compiled alike (fused kernels round differently from eager ones, so eager is shown beside it)."""
    guarded("fsdp compile={Block}", _compile, settings)


def _compile(settings: Settings) -> None:
    from examples.gpt import Block

    config = small_config(settings)
    batches = token_batches(config, STEPS, _batch_size(settings))
    eager, _ = plain_run(settings, config, batches)
    compiled_blocks = _compiled_plain(settings, config, batches)
    trainer = fit(settings, LM(config), _strategy("fsdp", compile={Block}), batches)
    got = without_prefix(trainer.strategy.full_state_dict())
    to_compiled = max_relative_difference(got, compiled_blocks)
    to_eager = max_relative_difference(got, eager)
    limit = 1e-4
    check(
        "fsdp compile={Block}",
        to_compiled <= limit,
        f"max relative difference {to_compiled:.1e} to compiled plain torch (limit {limit:.0e}), "
        f"{to_eager:.1e} to eager",
    )


def _compiled_plain(settings: Settings, config: Any, batches: list) -> dict[str, torch.Tensor]:
    from examples.gpt import Block

    model = new_gpt(config).to(settings.torch_device)
    for module in model.modules():
        if isinstance(module, Block):
            module.forward = torch.compile(module.forward)
    opt = make_optimizer(model.parameters(), "sgd")
    for x, y in batches:
        lm_loss(model(x.to(settings.torch_device)), y.to(settings.torch_device)).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def part_fused_adamw(settings: Settings) -> None:
    """torch.optim.AdamW(fused=True) stepping each strategy's pieces on the device."""
    for name in STRATEGIES:
        label = f"AdamW(fused=True) {name}"
        guarded(label, _fp32_parity, settings, label, _strategy(name), "adamw-fused")


def part_checkpoint(settings: Settings) -> None:
    guarded("DCP save + load of a GPU run", _checkpoint, settings)
    guarded("load_safetensors into a meta-built model", _safetensors, settings)


def _checkpoint(settings: Settings) -> None:
    from trainer.checkpoint import load_full_state_dict

    config = small_config(settings)
    batches = token_batches(config, STEPS, _batch_size(settings))
    with tempfile.TemporaryDirectory() as folder:
        trainer = fit(settings, LM(config, "adamw"), _strategy("fsdp"), batches)
        want = trainer.strategy.full_state_dict()
        trainer.save_checkpoint(os.path.join(folder, "sync"))
        trainer.save_checkpoint(os.path.join(folder, "async"), async_save=True)
        trainer.checkpointer.wait()
        for kind in ("sync", "async"):
            path = os.path.join(folder, kind)
            on_disk = load_full_state_dict(path)
            resumed = Trainer(
                strategy=_strategy("fsdp"),
                accelerator=settings.device,
                devices=1,
                max_steps=STEPS + 2,
                max_epochs=2,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
            )
            module = LM(config, "adamw")
            resumed.fit(module, _loader_of(batches), ckpt_path=path)
            state = module.trainer.strategy.engine.optimizers[0].state
            devices = {v.device.type for s in state.values() for v in s.values() if v.dim() > 0}
            difference = max_relative_difference(on_disk, want)
            check(
                f"{kind} save of a GPU run",
                difference == 0.0 and resumed.global_step == STEPS + 2 and devices == {settings.torch_device.type},
                f"weights on disk differ by {difference:.1e}; resumed to step {resumed.global_step}; "
                f"optimizer state loaded onto {devices}",
            )


def _loader_of(batches: list) -> Any:
    from .common import loader

    return loader(batches)


def _safetensors(settings: Settings) -> None:
    from safetensors.torch import save_file

    from trainer.checkpoint import load_safetensors

    config = small_config(settings)
    source = new_gpt(config, seed=5)
    weights = {k: v.clone() for k, v in source.state_dict().items() if k != "lm_head.weight"}  # tied: wte's
    batches = token_batches(config, 1, _batch_size(settings))
    with tempfile.TemporaryDirectory() as folder:
        save_file(weights, os.path.join(folder, "model.safetensors"))
        module = LM(config, on_meta=True)
        seen = {}

        class Loads(LM):
            def on_fit_start(self) -> None:
                load_safetensors(self.trainer, folder, prefix="model.")
                seen.update(without_prefix(self.trainer.strategy.full_state_dict()))

        module = Loads(config, on_meta=True)
        fit(settings, module, _strategy("fsdp"), batches)
    difference = max_relative_difference({k: seen[k] for k in weights}, weights)
    check(
        "load_safetensors into a meta-built model",
        difference == 0.0,
        f"weights after loading differ by {difference:.1e} from the files",
    )


def part_auto(settings: Settings) -> None:
    guarded("strategy='auto' from free GPU memory", _auto, settings)


def _auto(settings: Settings) -> None:
    import contextlib
    import io

    config = small_config(settings)
    batches = token_batches(config, 1, _batch_size(settings))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = fit(settings, LM(config), "auto", batches)
    said = next((line for line in printed.getvalue().splitlines() if line.startswith("strategy='auto'")), "")
    from_free_memory = "free on the fullest GPU" in said if settings.device == "cuda" else True
    check(
        "strategy='auto' from free GPU memory",
        trainer.strategy.name == "single" and from_free_memory,
        f"chose {trainer.strategy.name!r}; said: {said or 'nothing'}",
    )
