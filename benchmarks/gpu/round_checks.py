"""The GPU check's part for optimizers that step whole tensors and for context parallel, on two ranks sharing one
GPU (gloo with the tensors on the GPU, as two_ranks.py), each against plain torch on the same device:

- Adafactor, and Muon for the blocks' matrices with AdamW for the rest (stepped by hand), under fsdp: each rank
  trains on its half of every batch, the engine steps whole matrices that each rank owns;
- context parallel 2 ("ulysses"): both ranks train on the whole batch, each on its half of every sequence, attention
  exchanged by all-to-all around F.scaled_dot_product_attention; the GPT's positions from sequence_positions.

fp32, TF32 off; 1e-4 (Adafactor divides by a running RMS: a last-bit difference of two half-batch means moves it
more than SGD), 1e-2 for Muon (below).
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from strategies import FSDPStrategy

from .common import (
    Settings,
    check,
    free_port,
    guarded,
    lm_loss,
    max_relative_difference,
    new_gpt,
    small_config,
    token_batches,
    wrap_blocks,
)

WORLD_SIZE, STEPS, TOLERANCE = 2, 3, 1e-4
# Muon orthogonalises in bf16: gradients that differ in fp32's last bit (two half-batch means against one batch's)
# round to bf16 differently, 2.7e-3 after 3 steps on this GPT under ddp as under fsdp (on CPU); stepped on pieces,
# Muon refuses them outright
MUON_TOLERANCE = 1e-2
OPTIMIZERS = ("adafactor", "muon+adamw")


def part_round(settings: Settings) -> None:
    """Start two ranks on this device; rank 0 reports the checks."""
    mp.spawn(_rank, args=(free_port(), settings.device, settings.tiny), nprocs=WORLD_SIZE, join=True)


def _rank(rank: int, port: int, device: str, tiny: bool) -> None:
    settings = Settings(device, tiny)
    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks: the same GPU
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE, timeout=_TIMEOUT
    )
    try:
        for kind in OPTIMIZERS:
            label = f"{kind} under fsdp on two ranks of one {device.upper()} fp32"
            _on_both(rank, label, _optimizer_parity, settings, kind, rank, label)
        label = f"context parallel 2 (ulysses) on one {device.upper()} fsdp fp32"
        _on_both(rank, label, _context_parallel_parity, settings, rank, label)
    finally:
        dist.destroy_process_group()


_TIMEOUT = datetime.timedelta(seconds=60)  # a rank that fails ends the other's wait


def _on_both(rank: int, label: str, fn: Any, *args: Any) -> None:
    if rank == 0:
        guarded(label, fn, *args)
    else:
        fn(*args)


def _optimizers(model: torch.nn.Module, kind: str) -> list[torch.optim.Optimizer]:
    if kind == "adafactor":
        return [torch.optim.Adafactor(model.parameters(), lr=0.01)]
    matrices = [p for name, p in model.named_parameters() if p.ndim == 2 and name.startswith("h.")]
    chosen = {id(p) for p in matrices}
    rest = [p for p in model.parameters() if id(p) not in chosen]
    return [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]


def _train(model: torch.nn.Module, optimizers: list, batches: list, rows: slice, device: torch.device) -> None:
    for x, y in batches:
        lm_loss(model(x[rows].to(device)), y[rows].to(device)).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()


def _plain(settings: Settings, kind: str, batches: list) -> dict[str, torch.Tensor]:
    model = new_gpt(small_config(settings)).to(settings.torch_device)
    _train(model, _optimizers(model, kind), batches, slice(None), settings.torch_device)
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _optimizer_parity(settings: Settings, kind: str, rank: int, label: str) -> None:
    config, per_rank = small_config(settings), 2 if settings.tiny else 4
    batches = token_batches(config, STEPS, per_rank * WORLD_SIZE)
    want = _plain(settings, kind, batches)
    strategy = FSDPStrategy(**wrap_blocks())
    strategy.connect(settings.torch_device, WORLD_SIZE, rank)  # gloo alone would say CPU
    model = strategy.setup_module(new_gpt(config))
    optimizers = [strategy.setup_optimizer(o) for o in _optimizers(model, kind)]
    _train(model, optimizers, batches, slice(rank * per_rank, (rank + 1) * per_rank), settings.torch_device)
    got = strategy.full_state_dict()
    whole = id(optimizers[0]) in strategy.engine.whole_tensor_steps
    if rank == 0:
        difference, limit = max_relative_difference(got, want), TOLERANCE if kind == "adafactor" else MUON_TOLERANCE
        check(
            label,
            difference <= limit and whole,
            f"max relative difference {difference:.1e} (limit {limit:.0e}); whole-tensor steps: {whole}",
        )
    strategy.teardown()


def _context_parallel_parity(settings: Settings, rank: int, label: str) -> None:
    config = small_config(settings)
    batches = token_batches(config, STEPS, 2 if settings.tiny else 4)
    want = _plain(settings, "adafactor", batches)
    strategy = FSDPStrategy(**wrap_blocks(), context_parallel_size=2)
    strategy.connect(settings.torch_device, WORLD_SIZE, rank)
    model = strategy.setup_module(new_gpt(config))
    optimizer = strategy.setup_optimizer(_optimizers(model, "adafactor")[0])
    for x, y in batches:
        x, y = strategy.split_sequence((x.to(settings.torch_device), y.to(settings.torch_device)))
        with strategy.forward_context():
            loss = strategy.weigh_loss(lm_loss(model(x), y))
        with strategy.backward_context():
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    got = strategy.full_state_dict()
    if rank == 0:
        difference = max_relative_difference(got, want)
        check(label, difference <= TOLERANCE, f"max relative difference {difference:.1e} (limit {TOLERANCE:.0e})")
    strategy.teardown()
