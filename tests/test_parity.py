"""Invariant 1 (docs/architecture.md): every strategy at every world size ends with the weights of one process
trained on the concatenated global batch, through the real Trainer.fit on real gloo ranks.

The model has what needs care: an embedding tied to the output head, a frozen parameter, two parameter groups
(decay and no-decay, with different learning rates), and unit sizes that do not divide by 2 or 3, so that
parameters straddle shard boundaries and shards are padded. Training uses gradient accumulation 2 and clipping.

Data order: a DataLoader with shuffle=False and per-rank batch b is rebuilt with a DistributedSampler, so rank r
gets samples r, r + N, r + 2N, ... and batch k of all ranks together is samples [kNb, (k+1)Nb): exactly batch k of
a loader with batch size Nb on one process. Each rank's loss is a mean over its b samples and the engine averages
gradients over ranks, which is the mean over the Nb samples of the global batch.

Difference measure: for each tensor, max |a - b| / max |b|; the largest over all tensors is compared with the
tolerance (element-wise relative errors are meaningless for entries near zero).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from strategies import FSDPStrategy
from trainer import Trainer, TrainModule

VOCAB, DIM, HIDDEN, SEQ = 11, 5, 7, 4
PER_RANK_BATCH, ACCUMULATE, STEPS, CLIP = 2, 2, 3, 0.5
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
TOLERANCE = {"sgd": 1e-5, "adamw": 1e-4}


class Block(nn.Module):
    """82 parameters: not a multiple of 2 or 3."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(DIM, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.l2(torch.tanh(self.l1(x)))


class TiedLM(TrainModule):
    """Embedding tied to the head, two blocks, a linear layer whose weight is frozen (its bias trains)."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        self.optimizer_name = optimizer
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.frozen(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self):
        return make_optimizer(self, self.optimizer_name)


def make_optimizer(module: nn.Module, name: str) -> torch.optim.Optimizer:
    """Two groups: matrices with weight decay at the default lr, vectors without decay at half the lr."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() >= 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    if name == "sgd":
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "lr": 0.05, "weight_decay": 0.0}]
        return torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "lr": 0.005, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=0.01, fused=name == "adamw-fused")


def token_dataset(samples: int = 36, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randint(0, VOCAB, (samples, SEQ), generator=g), torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    )


def new_model(cls: type[TrainModule] = TiedLM, seed: int = 0, **kwargs) -> TrainModule:
    torch.manual_seed(seed)
    return cls(**kwargs)


def make_strategy(name: str):
    """A strategy by name; "fsdp" wraps each Block as a unit (the root unit keeps the tied and frozen ones)."""
    return FSDPStrategy(auto_wrap_policy={Block}) if name == "fsdp" else name


def fit(
    module: TrainModule,
    strategy,
    devices: int,
    batch_size: int,
    steps: int = STEPS,
    dataset: TensorDataset | None = None,
    clip: float = CLIP,
    accumulate: int = ACCUMULATE,
    ckpt_path: str | None = None,
    **trainer_kwargs,
) -> Trainer:
    trainer = Trainer(
        strategy=strategy,
        devices=devices,
        max_steps=steps,
        max_epochs=1,
        accumulate_grad_batches=accumulate,
        gradient_clip_val=clip,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        **trainer_kwargs,
    )
    loader = DataLoader(dataset if dataset is not None else token_dataset(), batch_size=batch_size, shuffle=False)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer


def max_relative_difference(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    assert got.keys() == want.keys()
    worst = 0.0
    for key, expected in want.items():
        if not expected.is_floating_point():
            assert torch.equal(got[key], expected), key
            continue
        expected = expected.double()
        scale = expected.abs().max().clamp_min(1e-12)
        worst = max(worst, ((got[key].double() - expected).abs().max() / scale).item())
    return worst


def reference_weights(world_size: int, optimizer: str, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """One process, in this process, trained on the global batch (per-rank batch x world size)."""
    module = new_model(optimizer=optimizer)
    trainer = fit(module, "single", 1, PER_RANK_BATCH * world_size, steps)
    assert trainer.global_step == steps
    return trainer.strategy.full_state_dict()


# ------------------------------------------------------------------------------------ bodies run on every rank


def body_fit_every_strategy(optimizers: list[str]) -> dict[tuple[str, str], dict[str, torch.Tensor]] | None:
    """Each strategy with each optimizer, one after the other; rank 0 returns the gathered final weights."""
    results = {}
    for optimizer in optimizers:
        for name in STRATEGIES:
            trainer = fit(new_model(optimizer=optimizer), make_strategy(name), world_size(), PER_RANK_BATCH)
            assert trainer.global_step == STEPS
            results[(name, optimizer)] = trainer.strategy.full_state_dict()
    return results if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0 else None


def world_size() -> int:
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


# ------------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_strategy_matches_one_process_on_the_global_batch(rank_pool, world_size):
    """World size 1 runs in this process (no process group): every strategy must train exactly as one process."""
    optimizers = list(TOLERANCE)
    if world_size == 1:
        results = body_fit_every_strategy(optimizers)
    else:
        results = rank_pool(world_size).run(body_fit_every_strategy, optimizers)[0]
    initial = new_model().state_dict()
    for optimizer in optimizers:
        want = reference_weights(world_size, optimizer)
        # The run must have moved the trainable weights and left the frozen one alone, or parity proves nothing.
        assert torch.equal(want["frozen.weight"], initial["frozen.weight"])
        assert max_relative_difference(want, {k: v for k, v in initial.items()}) > 1e-2
        assert torch.equal(want["head.weight"], want["emb.weight"])
        for name in STRATEGIES:
            got = results[(name, optimizer)]
            difference = max_relative_difference(got, want)
            assert difference <= TOLERANCE[optimizer], (name, optimizer, world_size, difference)
            assert torch.equal(got["head.weight"], got["emb.weight"]), "tied weights came apart"


def test_one_rank_on_the_many_rank_path_matches_one_process(monkeypatch):
    """With one-rank collectives (SHARDTRAIN_ONE_RANK_COLLECTIVES=1, the "@many" variants of
    benchmarks/overhead.py) fsdp forms its units, frees and gathers them and reduces through its buffers as on many
    ranks, each gather and reduction a local copy: every strategy must still train exactly as one process."""
    from strategies.sharding.collectives import ONE_RANK_COLLECTIVES
    from strategies.sharding.parameter import ShardedParameter

    monkeypatch.setenv(ONE_RANK_COLLECTIVES, "1")
    results = body_fit_every_strategy(["sgd", "adamw"])
    for optimizer in ("sgd", "adamw"):
        want = reference_weights(1, optimizer)
        for name in STRATEGIES:
            difference = max_relative_difference(results[(name, optimizer)], want)
            assert difference <= TOLERANCE[optimizer], (name, optimizer, difference)
    trainer = fit(new_model(), make_strategy("fsdp"), 1, PER_RANK_BATCH, steps=1)
    block = trainer.strategy.engine.module.blocks[0]
    assert all(type(p) is ShardedParameter for p in block.parameters())  # its units were freed between uses


def test_fused_adamw_steps_each_ranks_pieces_as_one_process_steps_everything(rank_pool):
    """AdamW(fused=True), the fast step on a CPU, runs on each rank's own pieces under every strategy."""
    results = rank_pool(2).run(body_fit_every_strategy, ["adamw-fused"])[0]
    want = reference_weights(2, "adamw")
    for name in STRATEGIES:
        assert max_relative_difference(results[(name, "adamw-fused")], want) <= TOLERANCE["adamw"], name


def body_float64_with_clipping(clip: float) -> dict[str, dict[str, torch.Tensor]] | None:
    results = {}
    for name in STRATEGIES:
        trainer = fit(new_model(optimizer="sgd").double(), make_strategy(name), world_size(), PER_RANK_BATCH, clip=clip)
        results[name] = trainer.strategy.full_state_dict()
    return results if torch.distributed.get_rank() == 0 else None


def test_float64_training_with_clipping_matches_one_process_to_1e_10(rank_pool):
    """The global norm is computed in the gradients' own dtype (as torch's clip_grad_norm_), so a float64 model
    is clipped in float64 on every strategy."""
    clip = 0.05  # below every step's gradient norm: clipping acts on each step
    want = fit(new_model(optimizer="sgd").double(), "single", 1, 2 * PER_RANK_BATCH, clip=clip)
    want = want.strategy.full_state_dict()
    assert want["emb.weight"].dtype == torch.float64
    results = rank_pool(2).run(body_float64_with_clipping, clip)[0]
    for name in STRATEGIES:
        difference = max_relative_difference(results[name], want)
        assert difference <= 1e-10, (name, difference)
