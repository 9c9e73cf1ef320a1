"""Invariant 5 in docs/architecture.md: after `setup_module` the model is an ordinary module that plain torch drives.

A loop with no Trainer (`model(x)`, `loss.backward()`, `optimizer.step()`, `optimizer.zero_grad()`), on the
process group the user made (the pool's, as under torchrun), must give the weights of one process trained with
plain torch on the global batch, including parameters that get no gradient: one never used, one used on alternate
steps, and a branch that only some ranks take. A parameter no rank used keeps `.grad is None` and is not stepped
(AdamW's weight decay does not move it), as in one process.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from strategies import FSDPStrategy, MixedPrecision, ZeroStrategy, get_strategy
from tests.test_parity import DIM, VOCAB, Block, TiedLM, max_relative_difference, token_dataset

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
STEPS, PER_RANK, ACCUMULATE, CLIP = 4, 2, 2, 0.3
CLIP_VALUE = 0.01  # clip_grad_value_'s bound: below most gradient elements here


class Sometimes(TiedLM):
    """TiedLM plus parameters that get no gradient on some steps or ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.never = nn.Linear(DIM, DIM)  # never called
        self.alternate = nn.Linear(DIM, DIM)  # called on even steps
        self.branch = nn.Linear(DIM, DIM)  # called where the rank asks for it

    def forward(self, x: torch.Tensor, step: int = 0, take_branch: bool = False) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        if step % 2 == 0:
            h = h + self.alternate(h)
        if take_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(self.frozen(h))


def takes_branch(rank: int, step: int) -> bool:
    return (rank + step) % 3 == 0  # rank 0 at steps 0 and 3, rank 1 at step 2, rank 2 at step 1; none at times


def rank_batch(rank: int, world_size: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = token_dataset(samples=STEPS * ACCUMULATE * PER_RANK * 3).tensors
    start = ((step * ACCUMULATE + micro) * world_size + rank) * PER_RANK
    return x[start : start + PER_RANK], y[start : start + PER_RANK]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int, branch: bool) -> torch.Tensor:
    return F.cross_entropy(model(x, step, branch).reshape(-1, VOCAB), y.reshape(-1))


def new_sometimes() -> Sometimes:
    torch.manual_seed(0)
    return Sometimes()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.5}, {"params": other, "weight_decay": 0.0}], lr=0.01)


def torch_clip(model: nn.Module, clip: str) -> float | None:
    """Clip with torch's own functions: "norm" (L2, the default path), "value", "inf-foreach" (the infinity norm
    through torch's foreach path). Returns the norm torch computed."""
    if clip == "value":
        torch.nn.utils.clip_grad_value_(model.parameters(), CLIP_VALUE)
        return None
    if clip == "inf-foreach":
        return float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP / 10, norm_type=math.inf, foreach=True))
    return float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))


def one_process(world_size: int, clip: str = "norm") -> tuple[dict[str, torch.Tensor], list[list[str]], list]:
    """Plain torch, no strategy: each step's loss is the mean over ranks of what each rank computes."""
    model = new_sometimes()
    optimizer = adamw(model)
    without_grad, norms = [], []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            losses = [
                loss_of(model, *rank_batch(r, world_size, step, micro), step, takes_branch(r, step))
                for r in range(world_size)
            ]
            (torch.stack(losses).mean() / ACCUMULATE).backward()
        norms.append(torch_clip(model, clip))
        without_grad.append(sorted(n for n, p in model.named_parameters() if p.requires_grad and p.grad is None))
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, without_grad, norms


def make(name: str):
    if name == "zero1-bf16":  # the ZeRO paper's configuration: bf16 replicas, fp32 master and optimizer state
        return ZeroStrategy(stage=1, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    if name == "hsdp1":  # hybrid: each rank a shard group of its own, the two replicated
        return FSDPStrategy(auto_wrap_policy={Block}, hybrid_shard=1)
    return FSDPStrategy(auto_wrap_policy={Block}) if name == "fsdp" else get_strategy(name)


def plain_loop(name: str, clip: str = "strategy") -> tuple[dict[str, torch.Tensor], list[list[str]], list]:
    """The README's plain loop, on this process's group (or alone), with accumulation and clipping (by
    `strategy.clip_gradients`, or by torch's functions: see torch_clip)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    strategy = make(name)
    model = strategy.setup_module(new_sometimes())
    optimizer = strategy.setup_optimizer(adamw(model))
    without_grad, norms = [], []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            x, y = rank_batch(rank, world_size, step, micro)
            with strategy.no_backward_sync(enabled=micro < ACCUMULATE - 1):
                (loss_of(model, x, y, step, takes_branch(rank, step)) / ACCUMULATE).backward()
        norms.append(float(strategy.clip_gradients(CLIP)) if clip == "strategy" else torch_clip(model, clip))
        if not strategy.spec.shard_gradients:  # the module's own .grad is what ddp and zero1 step from
            without_grad.append(sorted(n for n, p in model.named_parameters() if p.requires_grad and p.grad is None))
        optimizer.step()
        optimizer.zero_grad()
        assert all(p.grad is None for p in model.parameters())
    return strategy.full_state_dict(), without_grad, norms


def body_plain_loops() -> dict[str, tuple]:
    return {name: plain_loop(name) for name in STRATEGIES}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_plain_torch_loop_matches_one_process(rank_pool, world_size):
    want, want_without_grad, _ = one_process(world_size)
    assert ["never.bias", "never.weight"] == want_without_grad[0][:2]  # the reference really has gradless steps
    assert "alternate.weight" in want_without_grad[1] and "branch.weight" not in want_without_grad[0]
    initial = new_sometimes().state_dict()
    assert torch.equal(want["never.weight"], initial["never.weight"]), "weight decay moved an unused parameter"
    if world_size == 1:
        ranks = [body_plain_loops()]
    else:
        ranks = rank_pool(world_size).run(body_plain_loops)
    for rank, results in enumerate(ranks):
        for name, (got, without_grad, _) in results.items():
            difference = max_relative_difference(got, want)
            assert difference <= 1e-4, (name, world_size, rank, difference)
            assert torch.equal(got["never.weight"], initial["never.weight"]), (name, "the unused parameter moved")
            if without_grad:
                assert without_grad == want_without_grad, (name, rank)


# ------------------------------------------------------------------------------ the model outside the loop


def body_model_outside_the_loop(policy: str) -> dict[str, torch.Tensor]:
    """After training, call the model in every way a user would; all must match a plain copy of its weights."""
    strategy = FSDPStrategy(auto_wrap_policy={Block} if policy == "blocks" else None)
    model = strategy.setup_module(new_sometimes())
    optimizer = strategy.setup_optimizer(adamw(model))
    x, y = rank_batch(dist.get_rank(), dist.get_world_size(), 0, 0)
    loss_of(model, x, y, 0, True).backward()
    optimizer.step()
    optimizer.zero_grad()
    out = {}
    with torch.no_grad():
        out["no_grad"] = model(x, 0, True)
        out["no_grad_again"] = model(x, 1, False)  # a different path: other units
        out["submodule"] = model.blocks[1](model.emb(x))  # a wrapped unit and a root-level layer on their own
    out["with_grad"] = model(x, 0, True).detach()
    out["state"] = strategy.full_state_dict()
    return out


@pytest.mark.parametrize("policy", ["whole", "blocks"])
def test_an_fsdp_model_computes_with_its_real_weights_wherever_it_is_called(rank_pool, policy):
    for rank, out in enumerate(rank_pool(2).run(body_model_outside_the_loop, policy)):
        plain = new_sometimes()
        plain.load_state_dict(out["state"])
        x, _ = rank_batch(rank, 2, 0, 0)
        with torch.no_grad():
            assert torch.allclose(out["no_grad"], plain(x, 0, True), atol=1e-6)
            assert torch.allclose(out["no_grad_again"], plain(x, 1, False), atol=1e-6)
            assert torch.allclose(out["submodule"], plain.blocks[1](plain.emb(x)), atol=1e-6)
            assert torch.allclose(out["with_grad"], plain(x, 0, True), atol=1e-6)
            assert out["no_grad"].abs().sum() > 0


# ------------------------------------------------------------------------------ checkpoints of the plain loop

GLOBAL_BATCH, SAVE_AT = 6, 2


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = token_dataset(samples=STEPS * GLOBAL_BATCH).tensors
    return x[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH], y[step * GLOBAL_BATCH : (step + 1) * GLOBAL_BATCH]


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object, steps: range) -> None:
    """Each rank takes its equal share of the global batch (so any world size computes the same steps)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    share = GLOBAL_BATCH // world_size
    for step in steps:
        x, y = global_batch(step)
        x, y = x[rank * share : (rank + 1) * share], y[rank * share : (rank + 1) * share]
        F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()


def new_plain_loop(name: str) -> tuple:
    strategy = make(name)
    torch.manual_seed(0)
    model = strategy.setup_module(TiedLM())
    optimizer = strategy.setup_optimizer(adamw(model))
    return strategy, model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def body_save_and_go_on(name: str, path: str) -> dict[str, torch.Tensor]:
    strategy, model, optimizer, scheduler = new_plain_loop(name)
    train_steps(model, optimizer, scheduler, range(SAVE_AT))
    strategy.save(path, {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": SAVE_AT})
    train_steps(model, optimizer, scheduler, range(SAVE_AT, STEPS))
    return strategy.full_state_dict()


def body_resume(name: str, path: str) -> tuple[dict[str, torch.Tensor], dict, float]:
    strategy, model, optimizer, scheduler = new_plain_loop(name)
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "step": 0}
    extra = strategy.load(path, state)
    train_steps(model, optimizer, scheduler, range(state["step"], STEPS))
    return strategy.full_state_dict(), extra, optimizer.param_groups[0]["lr"]


def test_the_plain_loop_saves_and_resumes_under_any_strategy_and_world_size(rank_pool, tmp_path):
    """strategy.save / strategy.load (Lightning Fabric's names): written under fsdp on 2 ranks, resumed under ddp on
    2 ranks and under zero2 in one process, each ends with the weights of the uninterrupted run."""
    torch.manual_seed(0)
    model = TiedLM()
    optimizer = adamw(model)
    train_steps(model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5), range(STEPS))
    want = model.state_dict()
    path = str(tmp_path / "ckpt")
    uninterrupted = rank_pool(2).run(body_save_and_go_on, "fsdp", path)[0]
    assert max_relative_difference(uninterrupted, want) <= 1e-5
    resumed = {
        "ddp, 2 ranks": rank_pool(2).run(body_resume, "ddp", path)[1],
        "zero2, 1 rank": body_resume("zero2", path),
    }
    for where, (got, extra, lr) in resumed.items():
        assert max_relative_difference(got, want) <= 1e-5, where
        assert extra == {"scheduler": {**extra["scheduler"]}, "step": SAVE_AT} and lr == 0.01 * 0.5**STEPS, where
    from trainer.checkpoint import load_full_state_dict

    assert set(load_full_state_dict(path)) == set(TiedLM().state_dict())
