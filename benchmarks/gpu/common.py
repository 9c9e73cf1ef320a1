"""What the GPU check's parts share: the device and a world-size-1 process group, a small GPT, plain torch
references to compare with, and the one way a part reports a result (a JSON line the driver collects)."""

from __future__ import annotations

import json
import os
import socket
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from examples.gpt import GPT, Block, GPTConfig
from strategies.sharding import engine as sharding_engine
from strategies.sharding.collectives import ONE_RANK_COLLECTIVES
from trainer import Trainer, TrainModule

RESULT_PREFIX = "@gpu-check "


@dataclass(frozen=True)
class Settings:
    device: str  # "cuda" or "cpu" (the same code, to try it without a GPU)
    tiny: bool  # small sizes, for a CPU run in seconds
    speed_batch: int = 8  # the speed part's batch of GPT-2 sequences
    out_dir: str | None = None  # where the profiler traces are written (gpu_check.py --out-dir), if anywhere

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")


# ---------------------------------------------------------------------------------------------- reporting


@contextmanager
def one_rank_collectives(on: bool) -> Iterator[None]:
    """SHARDTRAIN_ONE_RANK_COLLECTIVES set to "1" (the engine's collectives run even on one rank, as on many GPUs)
    or "0" inside the block, restored after (the engine reads it when units are built and at each call)."""
    previous = os.environ.get(ONE_RANK_COLLECTIVES)
    os.environ[ONE_RANK_COLLECTIVES] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(ONE_RANK_COLLECTIVES)
        else:
            os.environ[ONE_RANK_COLLECTIVES] = previous


@contextmanager
def backward_per_parameter(on: bool = True) -> Iterator[None]:
    """Engines built inside hear of each gradient from a hook on its parameter, as the root unit does, instead of
    once per fsdp unit: the "fsdp-hooked" variants of the benchmarks (the engine's backward before it ran per unit;
    docs/architecture.md, "A unit's backward")."""
    before = sharding_engine.POST_BACKWARD_PER_UNIT
    sharding_engine.POST_BACKWARD_PER_UNIT = not on
    try:
        yield
    finally:
        sharding_engine.POST_BACKWARD_PER_UNIT = before


def report(kind: str, **fields: Any) -> None:
    print(RESULT_PREFIX + json.dumps({"kind": kind, **fields}), flush=True)


def check(name: str, ok: bool, detail: str) -> bool:
    if os.environ.get(ONE_RANK_COLLECTIVES) == "0":
        name += " [one rank: no collectives]"
    report("check", name=name, ok=bool(ok), detail=detail)
    return bool(ok)


def guarded(name: str, fn: Any, *args: Any) -> None:
    """Run one check's body; an exception is that check's failure (the part goes on with the next)."""
    try:
        fn(*args)
    except Exception as error:  # every failure is reported, with its type
        message = f"{type(error).__name__}: {error}".replace("\n", " ")
        check(name, False, message[:400])
        traceback.print_exc()


# ------------------------------------------------------------------------------------------------ set-up


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(settings: Settings, deterministic: bool = True) -> None:
    """One rank over nccl on the GPU (gloo on CPU), fp32 matrix products in full fp32 (no TF32), so that the
    project and plain torch can be compared to 1e-5."""
    if settings.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda, but torch.cuda.is_available() is False")
        torch.cuda.set_device(0)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.set_float32_matmul_precision("highest")
        if deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    if not dist.is_initialized():
        backend = "nccl" if settings.device == "cuda" else "gloo"
        kwargs = {"device_id": settings.torch_device} if settings.device == "cuda" else {}
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1, **kwargs)


def finish() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------- model


def small_config(settings: Settings) -> GPTConfig:
    """Bias-free (a key bias gets a gradient that is exactly zero in theory and rounding noise in practice,
    which Adam amplifies into differences that say nothing about the engine)."""
    if settings.tiny:
        return GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, bias=False)
    return GPTConfig(vocab_size=512, block_size=128, n_layer=4, n_head=4, n_embd=256, bias=False)


def token_batches(config: GPTConfig, steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches of next-token pairs drawn from a fixed stream (on CPU: both runs get the same)."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, config.vocab_size, (steps, batch, config.block_size + 1), generator=g)
    # A learnable pattern in half the positions, so the loss falls and curves can be compared meaningfully.
    stream[:, :, 1::2] = (stream[:, :, 0:-1:2] * 7 + 3) % config.vocab_size
    return [(s[:, :-1].contiguous(), s[:, 1:].contiguous()) for s in stream]


def new_gpt(config: GPTConfig, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(config)


def make_optimizer(params: Any, kind: str) -> torch.optim.Optimizer:
    params = [p for p in params if p.requires_grad]
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, fused=kind == "adamw-fused")


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))


class LM(TrainModule):
    """The GPT under the Trainer; records each training step's loss."""

    def __init__(self, config: GPTConfig, optimizer: str = "sgd", seed: int = 0, on_meta: bool = False) -> None:
        super().__init__()
        self.config, self.optimizer_kind, self.seed = config, optimizer, seed
        self.model = None if on_meta else new_gpt(config, seed)
        self.losses: list[float] = []

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(self.config)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = lm_loss(self.model(x), y)
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters(), self.optimizer_kind)


def loader(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> DataLoader:
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    return DataLoader(TensorDataset(x, y), batch_size=batches[0][0].shape[0], shuffle=False)


def fit(settings: Settings, module: LM, strategy: Any, batches: list, precision: str = "32", **kwargs: Any) -> Trainer:
    trainer = Trainer(
        strategy=strategy,
        accelerator=settings.device,
        devices=1,
        max_steps=len(batches),
        max_epochs=1,
        precision=precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )
    trainer.fit(module, loader(batches))
    return trainer


def plain_run(
    settings: Settings, config: GPTConfig, batches: list, optimizer: str = "sgd", precision: str = "32"
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Plain torch on the same device: the weights after the batches, and each step's loss."""
    device = settings.torch_device
    model = new_gpt(config).to(device)
    if precision == "bf16-true":
        model = model.to(torch.bfloat16)
    opt = make_optimizer(model.parameters(), optimizer)
    autocast = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(precision)
    scaler = torch.amp.GradScaler(settings.device) if precision == "16-mixed" else None
    losses = []
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        with torch.autocast(settings.device, dtype=autocast, enabled=autocast is not None):
            loss = lm_loss(model(x), y)
        losses.append(loss.item())
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def without_prefix(state: dict[str, torch.Tensor], prefix: str = "model.") -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): v for k, v in state.items()}


def max_relative_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max over tensors of max |a - b| / max |b| (element-wise relative errors mean nothing near zero)."""
    if got.keys() != want.keys():
        raise AssertionError(f"different keys: {sorted(got.keys() ^ want.keys())[:6]}")
    worst = 0.0
    for key, expected in want.items():
        expected = expected.detach().double().cpu()
        scale = expected.abs().max().clamp_min(1e-12)
        worst = max(worst, ((got[key].detach().double().cpu() - expected).abs().max() / scale).item())
    return worst


def curve_difference(got: list[float], want: list[float]) -> float:
    """The largest relative difference between two loss curves, step by step."""
    if len(got) != len(want):
        raise AssertionError(f"{len(got)} losses against {len(want)}")
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def wrap_blocks() -> dict[str, Any]:
    return {"auto_wrap_policy": {Block}}


def nbytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def largest_unit_bytes(strategy: Any) -> int:
    """Full bytes of the largest unit's own parameters (a unit's module may contain other units)."""
    return max(sum(p.numel() * p.element_size() for p in unit.params) for unit in strategy.engine.units)
