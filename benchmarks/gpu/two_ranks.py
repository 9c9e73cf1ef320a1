"""The GPU check's two-rank part: every strategy on two ranks sharing one GPU, against plain torch.

nccl refuses two ranks on one GPU (before nccl 2.30), so the two ranks talk over gloo with their tensors on the
GPU: the engine's collectives take the many-rank path (reduce-scatter, all-gather, bucketed all-reduce), gloo's
all_reduce on CUDA tensors, its point-to-point messages through host copies (collectives.py). Each rank trains
on its half of every batch; the weights after the steps must equal plain torch's on the whole batch (fp32, TF32
off, 1e-5), as on the CPU ranks of the test suite.

Two more kinds of check use the same two ranks:
- tensor parallel: the Llama example split over both ranks by torch's own tensor parallel (DTensor, whose
  collectives then run over gloo on CUDA tensors), each strategy sharding the pieces over a data-parallel group
  of one; both ranks train on the whole batch.
- a world size that changes: fsdp on the two ranks saves a checkpoint halfway, and this part's own process (one
  rank, on the GPU's own backend) loads it and trains on, as a run that lost a rank resumes.
"""

from __future__ import annotations

import datetime
import os
import tempfile
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from examples.llama import LLAMA_PRESETS, Llama
from examples.llama import Block as LlamaBlock
from examples.llama import tensor_parallel as split_llama
from strategies import DDPStrategy, FSDPStrategy, ZeroStrategy, get_strategy

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
    """Start two ranks on this device; rank 0 reports the checks. Then resume their checkpoint here, on one."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "two-ranks")
        mp.spawn(_rank, args=(free_port(), settings.device, settings.tiny, path), nprocs=WORLD_SIZE, join=True)
        guarded(ELASTIC, _resume_on_one_rank, settings, path)


def _rank(rank: int, port: int, device: str, tiny: bool, path: str) -> None:
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
        for name in STRATEGIES:
            label = f"tensor parallel 2 on one {device.upper()} {name} fp32"
            if rank == 0:
                guarded(label, _tensor_parallel_parity, settings, name, rank, label)
            else:  # DTensor's collectives over gloo on CUDA tensors may fail alike on both ranks: go on, as rank 0
                try:
                    _tensor_parallel_parity(settings, name, rank, label)
                except Exception:
                    traceback.print_exc()
        _save_halfway(settings, rank, path)
    finally:
        dist.destroy_process_group()


def _per_rank(settings: Settings) -> int:
    """Sequences each rank trains on per step (the batches hold WORLD_SIZE times as many)."""
    return 2 if settings.tiny else 4


def _train_on_halves(settings: Settings, strategy: Any, rank: int, batches: list) -> tuple[Any, Any]:
    """The GPT set up by `strategy` on this device, SGD steps on this rank's half of every batch."""
    strategy.connect(settings.torch_device, WORLD_SIZE, rank)  # gloo alone would say CPU
    model = strategy.setup_module(new_gpt(small_config(settings)))
    opt = strategy.setup_optimizer(make_optimizer(model.parameters(), "sgd"))
    device, local = settings.torch_device, _per_rank(settings)
    for x, y in batches:
        mine = slice(rank * local, (rank + 1) * local)
        lm_loss(model(x[mine].to(device)), y[mine].to(device)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _parity(settings: Settings, name: str, rank: int, label: str) -> None:
    """SGD with momentum: Adam divides each gradient by its own running size, which turns the last-bit
    difference between a two-half and a one-batch mean of a near-zero gradient into ~2e-5 (seen on CPU)."""
    config = small_config(settings)
    batches = token_batches(config, STEPS, _per_rank(settings) * WORLD_SIZE)
    want, _ = plain_run(settings, config, batches)
    strategy = FSDPStrategy(**wrap_blocks()) if name == "fsdp" else get_strategy(name)
    model, _ = _train_on_halves(settings, strategy, rank, batches)
    device = settings.torch_device
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


# ----------------------------------------------------------------------------------------- tensor parallel

LLAMA = LLAMA_PRESETS["tiny"]
TP_BATCH, TP_SEQ = 4, 16


def _llama_batches(steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(0, LLAMA.vocab_size, (TP_BATCH, TP_SEQ + 1), generator=generator) for _ in range(steps)]


def _llama_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor) -> None:
    lm_loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    optimizer.step()
    optimizer.zero_grad()


def _plain_llama(device: torch.device, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Llama(LLAMA).to(device)
    optimizer = make_optimizer(model.parameters(), "sgd")
    for tokens in batches:
        _llama_step(model, optimizer, tokens.to(device))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _tensor_parallel_strategy(name: str) -> object:
    if name == "ddp":
        return DDPStrategy(tensor_parallel_size=WORLD_SIZE)
    if name in ("zero1", "zero2"):
        return ZeroStrategy(stage=int(name[-1]), tensor_parallel_size=WORLD_SIZE)
    return FSDPStrategy(auto_wrap_policy={LlamaBlock}, tensor_parallel_size=WORLD_SIZE)


def _tensor_parallel_parity(settings: Settings, name: str, rank: int, label: str) -> None:
    """The Llama example split over both ranks (column- and row-wise projections, sequence-parallel norms);
    every rank reads the whole batch. The weights after the steps equal plain torch's (SGD with momentum)."""
    device = settings.torch_device
    batches = _llama_batches(STEPS)
    want = _plain_llama(device, batches)
    strategy = _tensor_parallel_strategy(name)
    strategy.connect(device, WORLD_SIZE, rank)
    torch.manual_seed(0)
    model = split_llama(Llama(LLAMA), strategy.device_mesh["tensor_parallel"])
    model = strategy.setup_module(model)
    optimizer = strategy.setup_optimizer(make_optimizer(model.parameters(), "sgd"))
    for tokens in batches:
        _llama_step(model, optimizer, tokens.to(device))
    placement = {p.device.type for p in model.parameters()}
    held = sum(p.numel() for p in model.parameters()) / sum(v.numel() for v in want.values())
    got = strategy.full_state_dict()
    if rank == 0:
        difference = max_relative_difference(got, want)
        check(
            label,
            difference <= TOLERANCE and placement == {device.type} and held < 0.9,
            f"max relative difference {difference:.1e} (limit {TOLERANCE:.0e}); parameters on {placement}; "
            f"this rank holds {held:.0%} of the model's elements",
        )
    strategy.teardown()


# ----------------------------------------------------------------------------------- a world size that changes

ELASTIC = "a checkpoint of two ranks resumes on one (fsdp)"


def _save_halfway(settings: Settings, rank: int, path: str) -> None:
    """fsdp on both ranks, each on half of every batch: STEPS steps, then a checkpoint (every rank writes its
    shards; the part's process resumes it on one rank)."""
    batches = token_batches(small_config(settings), STEPS, _per_rank(settings) * WORLD_SIZE)
    strategy = FSDPStrategy(**wrap_blocks())
    model, optimizer = _train_on_halves(settings, strategy, rank, batches)
    strategy.save(path, {"model": model, "optimizer": optimizer, "step": STEPS})
    strategy.teardown()


def _resume_on_one_rank(settings: Settings, path: str) -> None:
    """Load the two ranks' checkpoint here (one rank) and train STEPS more steps on whole batches: the weights
    equal plain torch's after all 2 x STEPS steps (SGD with momentum: the momentum buffers come back too)."""
    config = small_config(settings)
    size = _per_rank(settings) * WORLD_SIZE
    batches = token_batches(config, STEPS, size) + token_batches(config, STEPS, size, seed=2)
    want, _ = plain_run(settings, config, batches)
    strategy = FSDPStrategy(**wrap_blocks())
    model = strategy.setup_module(new_gpt(config, seed=1))  # other weights: all of them come from the checkpoint
    optimizer = strategy.setup_optimizer(make_optimizer(model.parameters(), "sgd"))
    extra = strategy.load(path, {"model": model, "optimizer": optimizer})
    device = settings.torch_device
    for x, y in batches[STEPS:]:
        lm_loss(model(x.to(device)), y.to(device)).backward()
        optimizer.step()
        optimizer.zero_grad()
    difference = max_relative_difference(strategy.full_state_dict(), want)
    check(
        ELASTIC,
        difference <= TOLERANCE and extra == {"step": STEPS} and strategy.world_size == 1,
        f"max relative difference {difference:.1e} after {STEPS} steps on two ranks and {STEPS} on one "
        f"(limit {TOLERANCE:.0e}); saved step {extra.get('step')}",
    )
    strategy.teardown()
