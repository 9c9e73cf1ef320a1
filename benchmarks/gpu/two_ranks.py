"""The GPU check's two-rank part: every strategy on two ranks sharing one GPU, against plain torch.

nccl refuses two ranks on one GPU (before nccl 2.30), so the two ranks talk over gloo with their tensors on the
GPU: the engine's collectives take the many-rank path (reduce-scatter, all-gather, bucketed all-reduce), gloo's
all_reduce on CUDA tensors, its point-to-point messages through host copies (collectives.py). Each rank trains
on its half of every batch; the weights after the steps must equal plain torch's on the whole batch (fp32, TF32
off, 1e-5), as on the CPU ranks of the test suite.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from strategies import FSDPStrategy, get_strategy

from .common import (
    Settings,
    check,
    free_port,
    guarded,
    lm_loss,
    make_optimizer,
    max_relative_difference,
    new_gpt,
    plain_run,
    small_config,
    token_batches,
    wrap_blocks,
)

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
WORLD_SIZE = 2
STEPS = 4
TOLERANCE = 1e-5


def part_two_ranks(settings: Settings) -> None:
    """Start two ranks on this device; rank 0 reports the checks."""
    mp.spawn(_rank, args=(free_port(), settings.device, settings.tiny), nprocs=WORLD_SIZE, join=True)


def _rank(rank: int, port: int, device: str, tiny: bool) -> None:
    settings = Settings(device, tiny)
    if device == "cuda":
        torch.cuda.set_device(0)  # both ranks: the same GPU
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=60),
    )  # a rank that fails ends the other's wait
    try:
        for name in STRATEGIES:
            label = f"two ranks on one {device.upper()} {name} fp32"
            if rank == 0:
                guarded(label, _parity, settings, name, rank, label)
            else:
                _parity(settings, name, rank, label)
    finally:
        dist.destroy_process_group()


def _parity(settings: Settings, name: str, rank: int, label: str) -> None:
    """SGD with momentum: Adam divides each gradient by its own running size, which turns the last-bit
    difference between a two-half and a one-batch mean of a near-zero gradient into ~2e-5 (seen on CPU)."""
    config = small_config(settings)
    local = 2 if settings.tiny else 4
    batches = token_batches(config, STEPS, local * WORLD_SIZE)
    want, _ = plain_run(settings, config, batches)
    strategy = FSDPStrategy(**wrap_blocks()) if name == "fsdp" else get_strategy(name)
    strategy.connect(settings.torch_device, WORLD_SIZE, rank)  # gloo alone would say CPU
    model = strategy.setup_module(new_gpt(config))
    opt = strategy.setup_optimizer(make_optimizer(model.parameters(), "sgd"))
    device = settings.torch_device
    for x, y in batches:
        mine = slice(rank * local, (rank + 1) * local)
        lm_loss(model(x[mine].to(device)), y[mine].to(device)).backward()
        opt.step()
        opt.zero_grad()
    placement = {p.device.type for p in model.parameters()}
    got = strategy.full_state_dict()
    if rank == 0:
        difference = max_relative_difference(got, want)
        check(
            label,
            difference <= TOLERANCE and placement == {device.type},
            f"max relative difference {difference:.1e} (limit {TOLERANCE:.0e}); parameters on {placement}",
        )
    strategy.teardown()
