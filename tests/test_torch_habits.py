"""Invariant 6 (docs/architecture.md): the habits users bring from plain torch, DDP and Lightning give one
process's numbers or a clear error, under every strategy.

- torch's gradient utilities (`torch.nn.utils.clip_grad_norm_`, `clip_grad_value_`) on `model.parameters()`: the
  global norm over every rank's shards, every shard clipped; in the plain loop, in `on_before_optimizer_step` and
  in a manual-optimization step. Reading a sharded gradient any other way is an error naming the way that works.
- `optimizer.state_dict()` of a sharded optimizer belongs to one rank and layout, and says so.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from strategies import FSDPStrategy
from strategies.sharding.parameter import ShardedParameterError
from tests.test_lightning import QUIET, BoringModel, RandomDataset, make_strategy
from tests.test_parity import max_relative_difference
from tests.test_plain_torch import CLIP, STRATEGIES, make, one_process, plain_loop
from trainer import Trainer

CLIPS = ("norm", "value", "inf-foreach")


# ------------------------------------------------------------------ the plain loop


def body_torch_clipping() -> dict[tuple[str, str], tuple]:
    runs = [(name, "norm") for name in (*STRATEGIES, "hsdp1")]
    runs += [("fsdp", "value"), ("zero2", "inf-foreach"), ("zero1-bf16", "norm"), ("zero1-bf16", "strategy")]
    return {(name, clip): plain_loop(name, clip) for name, clip in runs}


def test_torchs_clip_grad_norm_and_clip_grad_value_give_one_processs_numbers(rank_pool):
    """zero2 and fsdp keep only gradient shards: torch's functions still see every parameter's gradient and
    combine the norms of all ranks' shards (once per call), in the gradients' dtype, and clip every shard."""
    want = {clip: one_process(2, clip) for clip in CLIPS}
    assert all(norm > CLIP for norm in want["norm"][2]), "the reference must clip at every step"
    for rank, results in enumerate(rank_pool(2).run(body_torch_clipping)):
        # bf16 replicas, an fp32 copy of this rank's slice for the optimizer: torch's clip reaches the copy
        by_torch, _, torch_norms = results.pop(("zero1-bf16", "norm"))
        by_strategy, _, norms = results.pop(("zero1-bf16", "strategy"))
        assert torch_norms == pytest.approx(norms, rel=1e-2)
        assert max_relative_difference(by_torch, by_strategy) <= 2e-2
        for (name, clip), (got, _, norms) in results.items():
            state, _, want_norms = want[clip]
            assert max_relative_difference(got, state) <= 1e-4, (name, clip, rank)
            if clip != "value":
                assert norms == pytest.approx(want_norms, rel=1e-5), (name, clip, rank)


def body_reading_a_sharded_gradient(name: str) -> dict[str, str]:
    strategy = make(name)
    torch.manual_seed(0)
    model = strategy.setup_module(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    model(torch.randn(3, 4)).sum().backward()
    grad = model[0].weight.grad
    out = {"type": type(grad).__name__, "data is grad": str(grad.data is grad)}
    for what, read in {"abs": lambda: grad.abs(), "sum": lambda: grad.sum(), "clone": lambda: grad.clone()}.items():
        try:
            read()
            out[what] = "read"
        except ShardedParameterError as error:
            out[what] = str(error)
    out["norm"] = float(grad.norm())  # collective: every rank asks
    out["full norm"] = float(strategy.full_gradients()["0.weight"].norm())
    return out


@pytest.mark.parametrize("name", ["zero2", "fsdp"])
def test_other_reads_of_a_sharded_gradient_name_what_works(rank_pool, name):
    for out in rank_pool(2).run(body_reading_a_sharded_gradient, name):
        assert out["type"] == "ShardedGradient" and out["data is grad"] == "True"  # `p.grad.data.norm()` too
        for what in ("abs", "sum", "clone"):
            assert "strategy.clip_gradients" in out[what] and "full_gradients" in out[what], out[what]
        assert out["norm"] == pytest.approx(out["full norm"], rel=1e-6)


# ------------------------------------------------------------------ in the Trainer's hooks


class ClipsInTheHook(BoringModel):
    """Lightning's documented place for a custom clip: on_before_optimizer_step, with torch's function."""

    def __init__(self) -> None:
        super().__init__()
        self.norms: list[float] = []

    def on_before_optimizer_step(self, optimizer):
        self.norms.append(float(torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)))


class ClipsManually(BoringModel):
    """A manual-optimization step clipping with torch's functions before `opt.step()`."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        optimizer = self.optimizers()
        self.manual_backward(self.step(batch))
        torch.nn.utils.clip_grad_norm_(self.parameters(), 0.05)
        torch.nn.utils.clip_grad_value_(self.parameters(), 0.004)
        optimizer.step()
        optimizer.zero_grad()


def fit_both(name: str, devices: int, batch_size: int) -> dict:
    torch.manual_seed(0)
    hook = ClipsInTheHook()
    trainer = Trainer(strategy=make_strategy(name), devices=devices, max_steps=4, limit_val_batches=0, **QUIET)
    trainer.fit(hook, DataLoader(RandomDataset(32, 64), batch_size=batch_size))
    out = {"hook": trainer.strategy.full_state_dict(), "hook norms": hook.norms}
    torch.manual_seed(0)
    trainer = Trainer(strategy=make_strategy(name), devices=devices, max_steps=4, limit_val_batches=0, **QUIET)
    trainer.fit(ClipsManually(), DataLoader(RandomDataset(32, 64), batch_size=batch_size))
    out["manual"] = trainer.strategy.full_state_dict()
    return out


def body_clip_in_trainer() -> dict:
    return {name: fit_both(name, dist.get_world_size(), 2) for name in ("zero2", "fsdp")}


def test_torchs_clipping_in_on_before_optimizer_step_and_in_a_manual_step(rank_pool):
    want = fit_both("single", 1, 4)
    assert all(norm > 0.05 for norm in want["hook norms"])
    for name, got in rank_pool(2).run(body_clip_in_trainer)[0].items():
        assert got["hook norms"] == pytest.approx(want["hook norms"], rel=1e-5), name
        assert max_relative_difference(got["hook"], want["hook"]) <= 1e-5, name
        assert max_relative_difference(got["manual"], want["manual"]) <= 1e-5, name


# ------------------------------------------------------------------ optimizer.state_dict(), the DDP habit


def body_optimizer_state_dict_habit(name: str, tmp_path: str) -> dict[str, str]:
    """Save rank 0's optimizer.state_dict() and load it on every rank, as DDP users do; then each rank its own."""
    strategy = make(name)
    torch.manual_seed(0)
    model = strategy.setup_module(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1)))
    optimizer = strategy.setup_optimizer(torch.optim.Adam(model.parameters(), lr=0.1))
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    rank, out = dist.get_rank(), {}
    if rank == 0:
        torch.save(optimizer.state_dict(), f"{tmp_path}/rank0.pt")
    torch.save(optimizer.state_dict(), f"{tmp_path}/own{rank}.pt")
    dist.barrier()
    for what, path in {"rank 0's": f"{tmp_path}/rank0.pt", "own": f"{tmp_path}/own{rank}.pt"}.items():
        try:
            optimizer.load_state_dict(torch.load(path, weights_only=False))
            out[what] = "loaded"
        except ValueError as error:
            out[what] = str(error)
    return out


@pytest.mark.parametrize("name", ["zero1", "fsdp"])
def test_a_sharded_optimizers_state_dict_is_refused_on_another_rank(rank_pool, tmp_path, name):
    rank0, rank1 = rank_pool(2).run(body_optimizer_state_dict_habit, name, str(tmp_path))
    assert rank0 == {"rank 0's": "loaded", "own": "loaded"}
    assert rank1["own"] == "loaded"
    assert "holds rank 0's shard of 2 ranks" in rank1["rank 0's"] and "strategy.save(path" in rank1["rank 0's"]


# ------------------------------------------------------------------ a second Trainer on the same module


class TwoLayers(BoringModel):
    """Lightning's BoringModel with a second layer, so that fsdp's per-layer units hold something each."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 2))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def two_phases(name: str | None, devices: int) -> tuple[TwoLayers, list[float]]:
    """Fit, then fit the same module again with a new Trainer (a second phase, as Lightning users do), the
    second in bf16-true (the new Trainer converts the module before its strategy sets it up)."""
    torch.manual_seed(0)
    module, weights = TwoLayers(), []
    for precision in ("32", "bf16-true"):
        strategy = (FSDPStrategy(auto_wrap_policy={nn.Linear}) if name == "fsdp" else name) or "auto"
        trainer = Trainer(strategy=strategy, devices=devices, max_steps=4, precision=precision, **QUIET)
        trainer.fit(module, DataLoader(RandomDataset(32, 64), batch_size=8 // devices))
        weights.append(trainer.strategy.full_state_dict())
    return module, weights


def body_second_trainer(name: str) -> dict:
    _, weights = two_phases(name, dist.get_world_size())
    return {"weights": weights}


@pytest.mark.parametrize("name", STRATEGIES)
def test_a_second_trainer_fits_the_same_module_as_one_process_does(rank_pool, name):
    """Under every strategy the second fit starts from the first one's weights, as in one process: the new
    strategy takes the module back from the engine that had it (fsdp: its shards gathered) before setting up."""
    _, want = two_phases(None, 1)
    for result in rank_pool(2).run(body_second_trainer, name):
        for got, expected, tolerance in zip(result["weights"], want, (1e-5, 2e-2)):  # fp32, then bf16 (~2 ulps)
            assert max_relative_difference(got, expected) < tolerance
