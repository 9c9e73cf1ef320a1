"""Hybrid sharding: state sharded within groups of G ranks and replicated across the groups (FSDP's HYBRID_SHARD,
ZeRO++'s hpZ), tested with 4 ranks as 2 groups of 2."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from strategies import FSDPStrategy, MixedPrecision, ZeroStrategy
from strategies.sharding import FULL_SHARD, ZERO2, ShardingEngine
from strategies.sharding.memory import memory_report
from tests.test_checkpoint import _assert_same_checkpoint_state, _reshard_phase
from tests.test_engine import Plain, block_policy
from tests.test_parity import (
    PER_RANK_BATCH,
    Block,
    fit,
    max_relative_difference,
    new_model,
    token_dataset,
    world_size,
)

WORLD, GROUP = 4, 2
SAMPLES = 48  # 3 steps of 2 micro-batches of 2 samples on each of 4 ranks


def hybrid(name: str):
    if name == "hsdp":
        return FSDPStrategy(auto_wrap_policy={Block}, hybrid_shard=GROUP)
    return ZeroStrategy(stage=int(name[4]), hybrid_shard=GROUP)  # "zero1-hybrid", "zero2-hybrid"


def body_hybrid_parity(optimizer: str) -> dict | None:
    out = {}
    for name in ("hsdp", "zero1-hybrid", "zero2-hybrid"):
        trainer = fit(
            new_model(optimizer=optimizer), hybrid(name), world_size(), PER_RANK_BATCH, dataset=token_dataset(SAMPLES)
        )
        engine = trainer.strategy.engine
        assert (engine.world_size, engine.groups.data_parallel_size) == (GROUP, WORLD)
        out[name] = trainer.strategy.full_state_dict()
    return out if dist.get_rank() == 0 else None


def test_hybrid_sharding_matches_one_process(rank_pool):
    """Tied, frozen and grouped parameters, accumulation and clipping (TiedLM, as the parity tests)."""
    for optimizer, tolerance in (("sgd", 1e-5), ("adamw", 1e-4)):
        want = fit(
            new_model(optimizer=optimizer), "single", 1, PER_RANK_BATCH * WORLD, dataset=token_dataset(SAMPLES)
        ).strategy.full_state_dict()
        results = rank_pool(WORLD).run(body_hybrid_parity, optimizer)[0]
        for name, got in results.items():
            assert max_relative_difference(got, want) <= tolerance, (name, optimizer)


def body_hybrid_memory_and_communication() -> dict:
    out = {}
    for name, spec in (("fsdp", FULL_SHARD), ("zero2", ZERO2)):
        torch.manual_seed(0)
        model = Plain()
        engine = ShardingEngine(
            model, spec, wrap_policy=block_policy if name == "fsdp" else None, shard_group_size=GROUP
        )
        opt = engine.setup_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
        for step in range(2):
            if step == 1:
                engine.stats.reset()
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(dist.get_rank()))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        units = {u.name: (u.layout.padded_total, len(u.params)) for u in engine.units}
        out[name] = memory_report(engine), dict(engine.stats.elements), units
    return out


def test_hybrid_memory_and_communication_follow_the_group_size(rank_pool):
    """Per rank: the model state of sharding over G = 2 ranks (docs/architecture.md's table with N = G), whatever the
    world size; per step: the collectives of fsdp / zero2 within the group (all-gathers of P, a reduce-scatter of
    P plus the used flags) and an all-reduce of each rank's reduced shard (and the flags) across the groups."""
    P, slack = 182, 3 * 2 * 4  # Plain: 182 parameters in 3 units; padding < G elements per unit
    for report in rank_pool(WORLD).run(body_hybrid_memory_and_communication):
        fsdp, _, _ = report["fsdp"]
        for kind, want in (
            ("parameters", 4 * P / GROUP),
            ("gradients", 4 * P / GROUP),
            ("optimizer_state", 8 * P / GROUP),
        ):
            assert abs(fsdp[kind] - want) <= slack, (kind, fsdp[kind], want)
        zero2, _, _ = report["zero2"]
        assert abs(zero2["parameters"] - 4 * P) <= slack and abs(zero2["gradients"] - 4 * P / GROUP) <= slack
        for name in ("fsdp", "zero2"):
            _, sent, units = report[name]
            padded = sum(size for size, _ in units.values())
            flags = sum(n for _, n in units.values())
            assert sent["reduce_scatter"] == padded + GROUP * flags, name
            assert sent["all_reduce"] == 2 * (padded // GROUP + flags), name  # the shard + flags, across groups
            gathered_once = units[""][0] + units["blocks.1"][0] if name == "fsdp" else 0
            assert sent["all_gather"] == (2 * padded - gathered_once if name == "fsdp" else padded), name


def test_checkpoints_move_between_hybrid_and_other_strategies(rank_pool, tmp_path):
    """fsdp@2 -> hsdp (2 groups of 2)@4 -> zero2 hybrid@4 -> ddp@1: each load gives exactly the saved weights,
    momentum buffers and trainer state, and the chain ends where one uninterrupted process ends."""
    root = str(tmp_path)
    source = None
    for strategy, devices, max_steps in [("fsdp", 2, 3), ("hsdp2", 4, 6), ("zero2-hybrid2", 4, 9), ("ddp", 1, 12)]:
        if devices == 1:
            _reshard_phase(root, strategy, devices, source, max_steps)
        else:
            rank_pool(devices).run(_reshard_phase, root, strategy, devices, source, max_steps)
        name = f"{strategy}{devices}"
        if source is not None:
            _assert_same_checkpoint_state(os.path.join(root, name + "-loaded"), source, atol=0)
        source = os.path.join(root, name + "-end")
    _reshard_phase(root, "single", 1, None, 12)
    _assert_same_checkpoint_state(source, os.path.join(root, "single1-end"), atol=1e-5)


# ------------------------------------------------------------------------------- ZeRO with mixed precision


def body_zero_mixed_precision() -> dict | None:
    out = {}
    for name in ("zero1", "zero2"):
        for precision in (None, torch.bfloat16):
            strategy = ZeroStrategy(stage=int(name[-1]), mixed_precision=MixedPrecision(param_dtype=precision))
            trainer = fit(new_model(optimizer="sgd"), strategy, world_size(), PER_RANK_BATCH)
            engine = trainer.strategy.engine
            assert all(p.dtype == (precision or torch.float32) for p in trainer.module.parameters())
            assert all(u.master.dtype == torch.float32 for u in engine.units)
            out[(name, precision)] = trainer.strategy.full_state_dict()
    return out if dist.get_rank() == 0 else None


def test_zero_with_mixed_precision_stays_close_to_fp32(rank_pool):
    """As in the ZeRO paper: bf16 parameters and gradients replicated (gradients sharded under zero2), fp32
    master weights and optimizer state sharded; checkpoints hold the fp32 masters."""
    results = rank_pool(2).run(body_zero_mixed_precision)[0]
    for name in ("zero1", "zero2"):
        fp32, bf16 = results[(name, None)], results[(name, torch.bfloat16)]
        assert all(v.dtype == torch.float32 for v in bf16.values() if v.is_floating_point())
        difference = max_relative_difference(bf16, fp32)
        assert 0 < difference <= 5e-3, (name, difference)  # > 0: bf16 really was used
