"""The sharding engine: communication counts, memory report, shard layout, wrap policies and units, and the
options that must not change the numbers (reshard_after_forward, activation checkpointing, mixed precision).

Bodies named `body_*` run on every rank of the session's gloo pool; the rest runs in the test process, where the
engine has no process group (world size 1).
"""

from __future__ import annotations

import gc
import itertools
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from strategies import FSDPStrategy, mark_as_unit
from strategies.sharding import (
    FULL_SHARD,
    REPLICATED,
    ZERO1,
    ZERO2,
    ShardingEngine,
    UnitOptions,
    gradients,
    observe,
)
from strategies.sharding.collectives import ONE_RANK_COLLECTIVES
from strategies.sharding.layout import FlatLayout
from strategies.wrap import resolve_wrap_policy
from tests.test_parity import (
    ACCUMULATE,
    DIM,
    HIDDEN,
    PER_RANK_BATCH,
    STEPS,
    VOCAB,
    Block,
    TiedLM,
    fit,
    make_optimizer,
    make_strategy,
    max_relative_difference,
    new_model,
    reference_weights,
    token_dataset,
)
from trainer import TrainModule

SPECS = {"ddp": REPLICATED, "zero1": ZERO1, "zero2": ZERO2, "fsdp": FULL_SHARD}
FP32_BYTES = 4


def block_policy(module: nn.Module, name: str) -> bool:
    return isinstance(module, Block)


def engine_for(model: nn.Module, strategy: str, **options) -> ShardingEngine:
    policy = block_policy if strategy == "fsdp" else None
    return ShardingEngine(model, SPECS[strategy], wrap_policy=policy, **options)


def lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def rank_batch(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = token_dataset().tensors
    start = (dist.get_rank() * 7 + micro * 3) % 30
    return x[start : start + PER_RANK_BATCH], y[start : start + PER_RANK_BATCH]


def engine_step(model: nn.Module, engine: ShardingEngine, opt: torch.optim.Optimizer, accumulate: int) -> None:
    """One optimizer step in plain torch: the engine works from its hooks."""
    for micro in range(accumulate):
        x, y = rank_batch(micro)
        loss = lm_loss(model, x, y) / accumulate
        if micro < accumulate - 1:
            with engine.no_sync():
                loss.backward()
        else:
            loss.backward()
    gradients.clip_grad_norm_(engine, 0.5)
    opt.step()
    opt.zero_grad()


# ------------------------------------------------------------------------------- communication (invariant 3)


def body_communication_per_step(accumulate: int) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    """Elements sent per collective kind during the second optimizer step (the first has no prefetch order
    yet), and each unit's padded size, for every strategy."""
    out = {}
    for name in SPECS:
        model = new_model()
        engine = engine_for(model, name)
        opt = engine.setup_optimizer(make_optimizer(model, "adamw"))
        engine_step(model, engine, opt, accumulate)
        engine.stats.reset()
        engine_step(model, engine, opt, accumulate)
        sizes = {
            u.name: (
                u.layout.padded_total,
                u.layout.trainable_shard_size * u.world_size,
                len(u.params) if any(u.trainable) else 0,
            )
            for u in engine.units
        }
        out[name] = dict(engine.stats.elements), sizes
    return out


@pytest.mark.parametrize("accumulate", [1, 2])
def test_communication_per_step_matches_theory(rank_pool, accumulate):
    """Per optimizer step and rank, with P the padded parameter elements and T those of the trainable ones (a
    frozen parameter has no gradient to reduce, nor updates to share): ddp all-reduces 2T; zero1 all-reduces
    2T and all-gathers the updated T; zero2 reduces its gradients every micro-batch and all-gathers T; fsdp
    all-gathers every wrapped unit twice (forward, then again for backward since it was resharded) except the
    root unit (it stays unsharded from the start of forward to the end of backward, as in FSDP2) and the last
    unit of the forward (its backward comes first, so it is kept), which are gathered once, and reduces
    its gradients every micro-batch. Under no_sync (accumulation) ddp and zero1 do not communicate. A sharded
    gradient reduction is a reduce-scatter of T (on gloo made of point-to-point messages). Every reduction
    carries one "used" flag per parameter (F in all; each rank's slice of a reduce-scatter has all of its unit's)."""
    N = 2
    for elements in rank_pool(N).run(body_communication_per_step, accumulate):
        assert set(elements) == set(SPECS)
        for name, (sent, sizes) in elements.items():
            P = sum(size for size, _, _ in sizes.values())
            T = sum(trainable for _, trainable, _ in sizes.values())
            F = sum(flags for _, _, flags in sizes.values())
            gathered_once = sizes[""][0] + sizes["blocks.1"][0] if name == "fsdp" else 0  # root and last unit
            expected = {
                "ddp": {"all_reduce": 2 * (T + F)},
                "zero1": {"all_reduce": 2 * (T + F), "all_gather": T},
                "zero2": {"reduce_scatter": accumulate * (T + N * F), "all_gather": T},
                "fsdp": {
                    "all_gather": accumulate * (2 * P - gathered_once),
                    "reduce_scatter": accumulate * (T + N * F),
                },
            }[name]
            assert sent == expected, (name, sizes)
        fsdp_units = elements["fsdp"][1]
        assert set(fsdp_units) == {"blocks.0", "blocks.1", ""}
        assert fsdp_units["blocks.0"][0] == 82 and fsdp_units[""][0] == 86  # 85 root elements padded to 2 ranks


def body_small_units_reduce_together() -> list[tuple[int, int, dict[str, torch.Tensor]]]:
    """fsdp, one step: (reduce-scatters made, units, weights after it), with small units' reductions started together
    (the default) and with every unit alone."""
    from strategies.sharding import engine as engine_module

    out = []
    for together in (engine_module.REDUCE_TOGETHER_BYTES, 1):
        previous, engine_module.REDUCE_TOGETHER_BYTES = engine_module.REDUCE_TOGETHER_BYTES, together
        try:
            model = new_model()
            engine = engine_for(model, "fsdp")
            opt = engine.setup_optimizer(make_optimizer(model, "adamw"))
            engine.stats.reset()
            engine_step(model, engine, opt, 1)
            with engine.unsharded():
                weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            out.append((engine.stats.calls["reduce_scatter"], len(engine.units), weights))
        finally:
            engine_module.REDUCE_TOGETHER_BYTES = previous
    return out


def test_small_units_reduce_scatter_as_one_collective_with_the_same_numbers(rank_pool):
    """A collective costs a latency whatever its size: the three small units' gradients (a few hundred bytes) are
    reduce-scattered by one collective, and every weight comes out bit for bit as with one collective per unit."""
    for (together, units, grouped), (alone, _, separate) in rank_pool(2).run(body_small_units_reduce_together):
        assert (units, together, alone) == (3, 1, 3)
        assert grouped.keys() == separate.keys()
        assert all(torch.equal(grouped[k], separate[k]) for k in grouped)


class NormedStack(nn.Module):
    """Three Linear units of 4,160 elements with a 64-element LayerNorm unit between each two."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 64)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class GatherOrder(observe.Watcher):
    def __init__(self) -> None:
        self.events: list[str] = []

    def started(self, call: observe.Call) -> None:
        if call.kind == "all_gather":
            self.events.append(f"gather {call.unit}")

    def unit_forward(self, unit: str, entering: bool) -> None:
        if entering:
            self.events.append(f"forward {unit}")


def body_prefetch_looks_past_small_units() -> list[str]:
    torch.manual_seed(0)
    model = NormedStack()
    engine = ShardingEngine(model, FULL_SHARD, wrap_policy=lambda m, name: name.startswith("layers."))
    opt = engine.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 64)
    for _ in range(2):  # the first pass learns the order; the second prefetches by it
        watcher = GatherOrder()
        with observe.watched_by(watcher):
            model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    return watcher.events


def test_fsdp_prefetch_looks_past_small_units(rank_pool):
    """A small unit (a normalization layer kept in full precision under a param dtype is one) would be all the
    look-ahead there is: the next large unit's gather starts with the unit before the small one, not after it."""
    for events in rank_pool(2).run(body_prefetch_looks_past_small_units):
        forward = events[: events.index("forward layers.4") + 1]
        assert forward.index("gather layers.2") < forward.index("forward layers.1"), forward
        assert forward.index("gather layers.4") < forward.index("forward layers.3"), forward


def body_fsdp_gathers_once_without_resharding() -> dict[str, int]:
    model = new_model()
    engine = engine_for(model, "fsdp", reshard_after_forward=False)
    opt = engine.setup_optimizer(make_optimizer(model, "sgd"))
    engine_step(model, engine, opt, 1)
    engine.stats.reset()
    engine_step(model, engine, opt, 1)
    flags = sum(len(u.params) for u in engine.units if any(u.trainable))
    trainable = sum(u.layout.trainable_shard_size * u.world_size for u in engine.units)
    return {**engine.stats.elements, "P": sum(u.layout.padded_total for u in engine.units), "T": trainable, "F": flags}


def test_fsdp_without_reshard_after_forward_gathers_each_unit_once(rank_pool):
    for sent in rank_pool(2).run(body_fsdp_gathers_once_without_resharding):
        assert sent["all_gather"] == sent["P"] and sent["reduce_scatter"] == sent["T"] + 2 * sent["F"]


# ------------------------------------------------------------------------------------- memory (invariant 2)


class Plain(nn.Module):
    """No frozen or tied parameters, so the table applies as written: P = 82 + 82 + 18 = 182."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.out = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def body_memory_reports() -> dict[str, dict]:
    reports = {}
    for name in SPECS:
        torch.manual_seed(0)
        model = Plain()
        engine = engine_for(model, name)
        opt = engine.setup_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
        in_flight = []
        if name == "fsdp":  # registered after the engine's hooks: runs once blocks.1 is gathered
            model.blocks[1].register_forward_pre_hook(
                lambda *_, e=engine, seen=in_flight: seen.append(engine_report(e)["unsharded_in_flight"])
            )
        for _ in range(2):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(dist.get_rank()))
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        reports[name] = {**engine_report(engine), "in_flight_in_forward": in_flight, "units": len(engine.units)}
    return reports


def engine_report(engine: ShardingEngine) -> dict[str, int]:
    from strategies.sharding.memory import memory_report

    return memory_report(engine)


def test_memory_report_matches_the_table(rank_pool):
    """docs/architecture.md, Adam in fp32: parameters / gradients / optimizer state bytes per rank are
    ddp 4P / 4P / 8P, zero1 4P / 4P / 8P/N, zero2 4P / 4P/N / 8P/N, fsdp 4P/N / 4P/N / 8P/N,
    each within the padding (fewer than N elements per unit)."""
    N, P = 2, 182
    reports = rank_pool(N).run(body_memory_reports)
    table = {
        "ddp": (4 * P, 4 * P, 8 * P),
        "zero1": (4 * P, 4 * P, 8 * P / N),
        "zero2": (4 * P, 4 * P / N, 8 * P / N),
        "fsdp": (4 * P / N, 4 * P / N, 8 * P / N),
    }
    for name, expected in table.items():
        for report in reports:
            slack = report[name]["units"] * N * FP32_BYTES  # padding: < N elements per unit, 2 tensors for Adam
            got = (report[name]["parameters"], report[name]["gradients"], report[name]["optimizer_state"])
            for kind, want, have in zip(("parameters", "gradients", "optimizer_state"), expected, got):
                assert abs(have - want) <= 2 * slack, (name, kind, have, want)
        # The ranks together hold Adam's two moments of every element: once each when sharded, N times in ddp.
        copies = N if name == "ddp" else 1
        assert sum(r[name]["optimizer_state"] for r in reports) == copies * 8 * P, name
    fsdp = reports[0]["fsdp"]
    assert fsdp["unsharded_in_flight"] == 0, "fsdp left a unit unsharded after the step"
    # While blocks.1 computes, only it and the root unit (out: 18 elements, padded to 18) are gathered.
    assert fsdp["in_flight_in_forward"] == [FP32_BYTES * (82 + 18)] * 2


# --------------------------------------------------------------------------------------------- shard layout


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
def test_layout_pieces_cover_every_element_exactly_once(world_size):
    shapes = [torch.Size(s) for s in [(3, 5), (7,), (1,), (2, 2, 3), (0,), (11,)]]
    layout = FlatLayout(shapes, world_size)
    total = sum(s.numel() for s in shapes)
    assert layout.total == total
    assert layout.padded_total % world_size == 0 and 0 <= layout.padding < world_size
    assert layout.padded_total == layout.shard_size * world_size
    seen = [torch.zeros(s.numel(), dtype=torch.long) for s in shapes]
    flat = torch.arange(layout.padded_total, dtype=torch.float64)
    for rank in range(world_size):
        lo, hi = layout.shard_range(rank)
        assert hi - lo == layout.shard_size
        shard = flat[lo:hi]
        previous_end = 0
        for piece in layout.pieces(rank):
            assert piece.numel > 0 and piece.shard_offset >= previous_end
            previous_end = piece.shard_offset + piece.numel
            assert previous_end <= layout.shard_size
            seen[piece.param_index][piece.start : piece.end] += 1
            # The piece's place in the shard holds exactly those elements of the flat buffer.
            expected = layout.offsets[piece.param_index] + torch.arange(piece.start, piece.end, dtype=torch.float64)
            assert torch.equal(shard[piece.shard_offset : piece.shard_offset + piece.numel], expected)
    assert all(torch.equal(s, torch.ones_like(s)) for s in seen), "an element is owned by no rank or by two"
    views = layout.views(flat)
    assert [v.shape for v in views] == shapes
    assert all(v.numel() == 0 or v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in views)


# ------------------------------------------------------------------------------------- wrap policies, units


def unit_names(model: nn.Module, policy) -> dict[str, list[str]]:
    engine = ShardingEngine(model, FULL_SHARD, wrap_policy=resolve_wrap_policy(policy))
    return {u.name: u.param_names for u in engine.units}


@pytest.fixture
def as_on_many_ranks(monkeypatch):
    """One rank keeps fsdp's parameters in place (no units); with one-rank collectives it forms units as many do."""
    monkeypatch.setenv(ONE_RANK_COLLECTIVES, "1")


def test_wrap_policies_choose_units(as_on_many_ranks):
    by_class = unit_names(new_model(), {Block})
    assert set(by_class) == {"blocks.0", "blocks.1", ""}
    assert by_class["blocks.1"] == ["blocks.1.l1.weight", "blocks.1.l1.bias", "blocks.1.l2.weight", "blocks.1.l2.bias"]
    assert sorted(by_class[""]) == ["emb.weight", "frozen.bias", "frozen.weight"]  # head.weight is emb.weight
    # int: a Block holds 82 parameters, the ModuleList of both 164.
    assert set(unit_names(new_model(), 80)) == {"blocks.0", "blocks.1", ""}
    assert set(unit_names(new_model(), 83)) == {"blocks", ""}
    assert set(unit_names(new_model(), lambda module, name: name == "blocks.1")) == {"blocks.1", ""}
    assert set(unit_names(new_model(), None)) == {""}
    with pytest.raises(TypeError, match="auto_wrap_policy must be"):
        FSDPStrategy(auto_wrap_policy="blocks")
    with pytest.raises(TypeError, match="activation_checkpointing must be"):  # its own name, not the wrap policy's
        FSDPStrategy(activation_checkpointing="blocks")


def test_fsdp_on_one_rank_keeps_its_parameters_in_place_unless_units_are_needed(monkeypatch):
    """One rank's shard is the whole unit: fsdp then runs as zero2 (no gathering, no placeholders, no module hooks),
    except where its units do work of their own: mixed precision, offloading, activation offloading, or one-rank
    collectives asked for to profile the many-rank path."""
    engine = ShardingEngine(new_model(), FULL_SHARD, wrap_policy=resolve_wrap_policy({Block}))
    assert engine.spec == ZERO2
    assert all(type(p) is nn.Parameter for p in engine.module.parameters())
    assert not engine.module.blocks[0]._forward_pre_hooks
    for options in (UnitOptions(param_dtype=torch.bfloat16), UnitOptions(offload_to_cpu=True)):
        kept = ShardingEngine(new_model(), FULL_SHARD, wrap_policy=resolve_wrap_policy({Block}), unit_options=options)
        assert kept.spec == FULL_SHARD and {u.name for u in kept.units} >= {"blocks.0", "blocks.1"}
    monkeypatch.setenv(ONE_RANK_COLLECTIVES, "1")
    assert ShardingEngine(new_model(), FULL_SHARD).spec == FULL_SHARD


class HandWrapped(TiedLM):
    def configure_model(self) -> None:
        mark_as_unit(self.blocks[0])
        mark_as_unit(self.frozen)


def test_mark_as_unit_in_configure_model(as_on_many_ranks):
    trainer = fit(new_model(HandWrapped), "fsdp", 1, PER_RANK_BATCH, steps=1)
    units = {u.name: u.param_names for u in trainer.strategy.engine.units}
    assert set(units) == {"blocks.0", "frozen", ""}
    assert units["frozen"] == ["frozen.weight", "frozen.bias"]


class Leaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = Leaf(), Leaf()
        self.b.lin.weight = self.a.lin.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


class NestedTied(TiedLM):
    """A weight shared by two wrapped Leafs whose nearest wrapped common ancestor is the Stage."""

    def __init__(self) -> None:
        super().__init__()
        del self.blocks, self.frozen
        self.stage = Stage()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stage(self.emb(x)))


def test_tied_parameter_lands_in_the_common_ancestor_unit(as_on_many_ranks):
    units = unit_names(new_model(NestedTied), {Stage, Leaf})
    assert units["stage"] == ["stage.a.lin.weight"]
    assert units["stage.a"] == ["stage.a.lin.bias"] and units["stage.b"] == ["stage.b.lin.bias"]
    # Without the Stage wrapped, the nearest common ancestor is the root.
    units = unit_names(new_model(NestedTied), {Leaf})
    assert "stage.a.lin.weight" in units[""] and units["stage.a"] == ["stage.a.lin.bias"]


# --------------------------------------------------------------- options that must not change the numbers


def count_block_forwards(run):
    calls = []
    original = Block.forward
    Block.forward = lambda self, x: (calls.append(1), original(self, x))[1]
    try:
        return run(), len(calls)
    finally:
        Block.forward = original


def body_fsdp_options() -> dict[str, tuple[dict[str, torch.Tensor], int]] | None:
    world = dist.get_world_size()
    runs = {
        "default": lambda: FSDPStrategy(auto_wrap_policy={Block}),
        "keep_after_forward": lambda: FSDPStrategy(auto_wrap_policy={Block}, reshard_after_forward=False),
        "activation_checkpointing": lambda: FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing={Block}),
    }
    out = {}
    for name, strategy in runs.items():
        trainer, forwards = count_block_forwards(lambda s=strategy: fit(new_model(), s(), world, PER_RANK_BATCH))
        out[name] = trainer.strategy.full_state_dict(), forwards
    nested_policy = {Stage, Leaf}
    trainer = fit(new_model(NestedTied), FSDPStrategy(auto_wrap_policy=nested_policy), world, PER_RANK_BATCH)
    out["nested_tied"] = trainer.strategy.full_state_dict(), 0
    return out if dist.get_rank() == 0 else None


def test_fsdp_options_give_the_same_weights(rank_pool):
    results = rank_pool(2).run(body_fsdp_options)[0]
    want = reference_weights(2, "sgd")
    micro_batches = STEPS * ACCUMULATE
    default, forwards = results["default"]
    assert forwards == 2 * micro_batches
    assert max_relative_difference(default, want) <= 1e-5
    kept, forwards = results["keep_after_forward"]
    assert forwards == 2 * micro_batches
    assert max_relative_difference(kept, default) <= 1e-6
    checkpointed, forwards = results["activation_checkpointing"]
    assert forwards == 2 * 2 * micro_batches, "activation checkpointing did not recompute the blocks"
    assert max_relative_difference(checkpointed, default) <= 1e-6
    # The weight shared inside the Stage is updated once per step, as on one process.
    module = new_model(NestedTied)
    reference = fit(module, "single", 1, 2 * PER_RANK_BATCH)
    nested = results["nested_tied"][0]
    assert max_relative_difference(nested, reference.strategy.full_state_dict()) <= 1e-5
    assert torch.equal(nested["stage.a.lin.weight"], nested["stage.b.lin.weight"])


# ------------------------------------------------------------------------------------------ mixed precision

BF16_TOLERANCE = 2e-2  # bf16 keeps 8 bits of mantissa; after 3 steps weights differ from fp32 by far less


def body_bf16_against_fp32() -> dict[str, dict[str, torch.Tensor]] | None:
    world = dist.get_world_size()
    out = {}
    for name, precision in itertools.product(("ddp", "fsdp"), ("32", "bf16-mixed")):
        trainer = fit(new_model(), make_strategy(name), world, PER_RANK_BATCH, precision=precision)
        out[f"{name}/{precision}"] = trainer.strategy.full_state_dict()
    return out if dist.get_rank() == 0 else None


def test_bf16_mixed_stays_close_to_fp32(rank_pool):
    results = rank_pool(2).run(body_bf16_against_fp32)[0]
    for name in ("ddp", "fsdp"):
        fp32, bf16 = results[f"{name}/32"], results[f"{name}/bf16-mixed"]
        assert all(v.dtype == torch.float32 for v in bf16.values() if v.is_floating_point())  # fp32 masters
        difference = max_relative_difference(bf16, fp32)
        assert 0 < difference <= BF16_TOLERANCE, (name, difference)  # > 0: bf16 really was used


class OverflowOnce(TiedLM):
    """On one rank's first micro-batch the gradient of frozen.bias (a root-unit parameter, so it may be read in
    training_step under fsdp too) overflows fp32. The injecting rank is chosen so that, under zero2 and fsdp,
    the bias's gradient lands in the other rank's shard after the reduce-scatter: the ranks then see the
    overflow in different places and must still agree to skip the step."""

    def __init__(self, inject_rank: int = 1) -> None:
        super().__init__()
        self.inject_rank = inject_rank
        self.optimizer_steps = 0

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 0 and dist.get_rank() == self.inject_rank:
            loss = loss + 1e36 * self.frozen.bias.sum()
        return loss

    def on_before_optimizer_step(self, optimizer) -> None:
        self.optimizer_steps += 1


# frozen.bias is the first parameter of the zero2 bucket (reverse registration order: rank 0's shard) and the
# last of the fsdp root unit (rank 1's shard).
INJECT_RANK = {"ddp": 1, "zero2": 1, "fsdp": 0}


def body_fp16_skips_overflowing_steps() -> dict[str, tuple]:
    from trainer.loop.precision import LossScaler

    out = {}
    original = LossScaler.unscale_and_check
    for name, inject_rank in INJECT_RANK.items():
        local_overflow = []

        def check(self, gradients, any_rank, _seen=local_overflow):
            _seen.append(any(not torch.isfinite(g).all() for g in gradients))
            return original(self, gradients, any_rank)

        LossScaler.unscale_and_check = check
        try:
            module = new_model(OverflowOnce, inject_rank=inject_rank)
            trainer = fit(module, make_strategy(name), dist.get_world_size(), PER_RANK_BATCH, precision="16-mixed")
        finally:
            LossScaler.unscale_and_check = original
        local = {k: v.detach().clone() for k, v in module.state_dict().items()} if name == "ddp" else None
        out[name] = (
            trainer.global_step,
            module.optimizer_steps,
            trainer.precision.scaler.scale_value,
            trainer.strategy.full_state_dict(),
            local,
            local_overflow,
        )
    return out


def test_fp16_mixed_skips_an_overflowing_step_on_every_rank(rank_pool):
    ranks = rank_pool(2).run(body_fp16_skips_overflowing_steps)
    initial = new_model().state_dict()
    for name in INJECT_RANK:
        for rank in ranks:
            global_step, optimizer_steps, scale, full, _, _ = rank[name]
            assert global_step == STEPS
            assert optimizer_steps == STEPS - 1, f"{name}: the overflowing step was not skipped on every rank"
            assert scale == 2.0**15
            assert all(torch.isfinite(v).all() for v in full.values())
            assert max_relative_difference(full, initial) > 1e-3  # the later steps did train
        assert max_relative_difference(ranks[0][name][3], ranks[1][name][3]) == 0
        local_overflow = [rank[name][5] for rank in ranks]
        if name == "ddp":  # all-reduced gradients: every rank sees the overflow itself
            assert local_overflow == [[True, False, False]] * 2
        else:  # only the rank owning frozen.bias's shard sees it
            owner = 1 - INJECT_RANK[name]
            assert local_overflow[owner] == [True, False, False]
            assert local_overflow[1 - owner] == [False, False, False]
    # ddp keeps whole replicas: they must be identical on both ranks.
    assert max_relative_difference(ranks[0]["ddp"][4], ranks[1]["ddp"][4]) == 0


# ---------------------------------------------------------------------------------------------- BatchNorm


class Normed(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.lin = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.bn(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def normed_dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(24, 3, generator=g) * torch.tensor([1.0, 3.0, 0.5]) + torch.tensor([2.0, -1.0, 0.0])
    x[1::2] += 5.0  # rank 1 of 2 sees very different statistics from rank 0
    return TensorDataset(x, torch.randn(24, 2, generator=g))


def body_batchnorm_statistics() -> dict[str, dict[str, torch.Tensor]]:
    out = {}
    for name in ("ddp", "fsdp"):
        torch.manual_seed(0)
        module = Normed()
        fit(module, name, dist.get_world_size(), PER_RANK_BATCH, dataset=normed_dataset())
        out[name] = {k: v.clone() for k, v in module.bn.named_buffers()}  # fsdp parameters are sharded
    return out


def test_batchnorm_running_statistics_are_rank_zeros_on_every_rank(rank_pool):
    """As with torch DDP's broadcast_buffers, rank 0's buffers are the truth: its running statistics come from
    its own batches, and every rank ends with them."""
    ranks = rank_pool(2).run(body_batchnorm_statistics)
    x = normed_dataset().tensors[0][0::2]  # rank 0's samples, in order
    mean, var = torch.zeros(3), torch.ones(3)
    for k in range(STEPS * ACCUMULATE):
        batch = x[k * PER_RANK_BATCH : (k + 1) * PER_RANK_BATCH]
        mean = 0.9 * mean + 0.1 * batch.mean(0)
        var = 0.9 * var + 0.1 * batch.var(0, unbiased=True)
    for name in ("ddp", "fsdp"):
        for rank, stats in enumerate(ranks):
            assert torch.allclose(stats[name]["running_mean"], mean, atol=1e-6), (name, rank)
            assert torch.allclose(stats[name]["running_var"], var, atol=1e-5), (name, rank)
            assert stats[name]["num_batches_tracked"].item() == STEPS * ACCUMULATE


# --------------------------------------------------------------- sharded parameters outside a unit's forward


def body_read_sharded_parameters() -> dict:
    from strategies.sharding.parameter import ShardedParameterError

    trainer = fit(new_model(), FSDPStrategy(auto_wrap_policy={Block}), dist.get_world_size(), PER_RANK_BATCH)
    module, strategy = trainer.module, trainer.strategy
    weight = module.blocks[0].l1.weight  # a wrapped unit's parameter, resharded after training
    errors = []
    for read in (lambda: weight.sum(), lambda: module.state_dict(), lambda: module.blocks[0].l1(torch.ones(DIM))):
        try:
            read()
        except ShardedParameterError as error:
            errors.append(str(error))
    with strategy.unsharded(module):
        seen = weight.detach().clone()
        with torch.no_grad():
            weight.add_(1.0)  # written on every rank alike: kept in the shards
    x = token_dataset().tensors[0][:2]
    with torch.no_grad():
        output = module(x)
    plain = new_model()
    plain.load_state_dict(strategy.full_state_dict())
    return {
        "shape": list(weight.shape),
        "errors": errors,
        "seen": seen,
        "output": output,
        "plain_output": plain(x).detach(),
        "after": plain.blocks[0].l1.weight.detach(),
    }


def test_a_sharded_parameter_is_never_read_as_zeros(rank_pool):
    """Between uses, reading a sharded parameter is an error that names it and says how to read it; inside
    strategy.unsharded() it is there in full, and writes made there stay; the model called after fit computes
    with the real weights."""
    for result in rank_pool(2).run(body_read_sharded_parameters):
        assert result["shape"] == [HIDDEN, DIM]
        # Reading it, the model's state_dict, and calling a layer inside a unit without the unit: all refused.
        assert len(result["errors"]) == 3, result["errors"]
        assert all("is sharded across 2 rank(s)" in e and "strategy.unsharded(" in e for e in result["errors"])
        assert "'blocks.0.l1.weight'" in result["errors"][0] and "'blocks.0.l1.weight'" in result["errors"][2]
        assert result["seen"].abs().sum() > 0
        assert torch.equal(result["after"], result["seen"] + 1.0)
        assert torch.allclose(result["output"], result["plain_output"], rtol=0, atol=1e-6)


# --------------------------------------------------------------- collectives chosen for gloo


def body_gloo_collectives_in_chunks() -> tuple[bool, bool, bool, bool]:
    from strategies.sharding import collectives

    rank, size = dist.get_rank(), dist.get_world_size()
    stats = collectives.CommStats()
    previous = collectives.GLOO_CHUNK_BYTES, collectives.GLOO_P2P_CHUNK_BYTES
    collectives.GLOO_CHUNK_BYTES = collectives.GLOO_P2P_CHUNK_BYTES = 40  # force several chunks
    try:
        shard = torch.arange(25, dtype=torch.float32) + 100 * rank
        full = torch.empty(25 * size)
        collectives.all_gather(full, shard, None, stats, async_op=True).wait()
        gathered = torch.equal(full, torch.cat([torch.arange(25.0) + 100 * r for r in range(size)]))
        grads = torch.arange(25.0 * size) * (rank + 1)
        out = torch.empty(25)
        collectives.reduce_scatter_sum(out, grads, None, stats, async_op=True).wait()
        total = sum(r + 1 for r in range(size))
        reduced = torch.equal(out, torch.arange(25.0 * rank, 25.0 * (rank + 1)) * total)
        in_place = torch.arange(25.0 * size) + 1000 * rank  # a rank's shard read from its own place in `full`
        collectives.all_gather(in_place, in_place[25 * rank : 25 * (rank + 1)], None, stats, async_op=False)
        expected = torch.cat([torch.arange(25.0 * r, 25.0 * (r + 1)) + 1000 * r for r in range(size)])
        gathered_in_place = torch.equal(in_place, expected)
        outs = torch.zeros(3, 25)  # several exchanges in flight at once still pair up in order
        works = [
            collectives.reduce_scatter_sum(
                outs[i], torch.full((25 * size,), float(i) * (rank + 1)), None, stats, async_op=True
            )
            for i in range(3)
        ]
        for work in works:
            work.wait()
        in_flight = all(torch.equal(outs[i], torch.full((25,), float(i) * total)) for i in range(3))
    finally:
        collectives.GLOO_CHUNK_BYTES, collectives.GLOO_P2P_CHUNK_BYTES = previous
    return gathered, reduced, gathered_in_place, in_flight


def body_kinds_issued_in_different_orders() -> tuple[bool, bool]:
    """Rank 0 starts an all-gather then a reduce-scatter, rank 1 the other way round, both in flight at once."""
    from strategies.sharding import collectives

    rank, size = dist.get_rank(), dist.get_world_size()
    stats = collectives.CommStats()
    previous, collectives.GLOO_P2P_CHUNK_BYTES = collectives.GLOO_P2P_CHUNK_BYTES, 40  # several messages each
    try:
        shard, full = torch.full((25,), float(rank)), torch.empty(25 * size)
        grads, out = torch.arange(25.0 * size) * (rank + 1), torch.empty(25)
        ops = [
            lambda: collectives.all_gather(full, shard, None, stats, async_op=True),
            lambda: collectives.reduce_scatter_sum(out, grads, None, stats, async_op=True),
        ]
        for work in [op() for op in (ops if rank % 2 == 0 else ops[::-1])]:
            work.wait()
    finally:
        collectives.GLOO_P2P_CHUNK_BYTES = previous
    gathered = torch.equal(full, torch.cat([torch.full((25,), float(r)) for r in range(size)]))
    total = sum(r + 1 for r in range(size))
    return gathered, torch.equal(out, torch.arange(25.0 * rank, 25.0 * (rank + 1)) * total)


def test_all_gathers_and_reduce_scatters_may_interleave_differently_on_each_rank(rank_pool):
    """When a unit's gradient reduction starts can differ between ranks (a parameter unused on one of them), so
    the two kinds of point-to-point exchanges must not be matched across kinds."""
    assert rank_pool(2).run(body_kinds_issued_in_different_orders) == [(True, True)] * 2


def test_gloo_all_gather_and_reduce_scatter_by_point_to_point_messages_are_exact(rank_pool):
    for world_size in (2, 3):
        assert rank_pool(world_size).run(body_gloo_collectives_in_chunks) == [(True, True, True, True)] * world_size


def body_gloo_exchanges_through_host_copies() -> tuple[bool, bool]:
    """What gloo does for tensors on a GPU (its point-to-point messages take host memory only), run here on CPU
    tensors: the exchange fills a host copy of the output, then the reduce-scatter adds this rank's own part,
    then the result is copied back into the output (in that order)."""
    from strategies.sharding import collectives

    rank, size = dist.get_rank(), dist.get_world_size()
    grads = torch.arange(6.0 * size) * (rank + 1)
    parts = [[grads[r * 6 : (r + 1) * 6]] for r in range(size)]
    out = torch.full((6,), -1.0)
    collectives._through_host(out, lambda host: collectives._gloo_reduce_scatter(host, parts, None, None)).wait()
    total = sum(r + 1 for r in range(size))
    reduced = torch.equal(out, torch.arange(6.0 * rank, 6.0 * (rank + 1)) * total)
    full = torch.full((4 * size,), -1.0)
    shard = torch.arange(4.0) + 10 * rank
    collectives._through_host(full, lambda host: collectives._gloo_all_gather(host, shard, None, None)).wait()
    gathered = torch.equal(full, torch.cat([torch.arange(4.0) + 10 * r for r in range(size)]))
    return reduced, gathered


def test_gloo_exchanges_for_gpu_tensors_go_through_host_copies_in_order(rank_pool):
    assert rank_pool(2).run(body_gloo_exchanges_through_host_copies) == [(True, True)] * 2


def body_units_freed_during_backward(frozen: bool) -> list[list[str]]:
    """Each Linear is a unit; when a unit's backward starts, which units are still gathered."""
    from strategies.sharding.unit import ParamState

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(5)))
    if frozen:  # a frozen parameter per unit: the end of its backward is found from its input's gradient
        for layer in model:
            layer.bias.requires_grad_(False)
    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear})
    model = strategy.setup_module(model)
    units = {u.module: u for u in strategy.engine.units if u.module is not None and u.module is not model}
    seen = []

    def record(module: nn.Module, _grad: tuple) -> None:
        seen.append([str(i) for i, layer in enumerate(model) if units[layer].state is not ParamState.SHARDED])

    for layer in model:
        layer.register_full_backward_pre_hook(record)
    x = torch.randn(4, 16, requires_grad=True)  # (so that the first unit's input wants a gradient too)
    model(x).sum().backward()
    return seen


@pytest.mark.parametrize("frozen", [False, True], ids=["all trainable", "a frozen parameter per unit"])
def test_fsdp_frees_each_units_parameters_once_its_backward_is_done(rank_pool, frozen):
    """When unit k's backward starts, every unit after k+1 is sharded again (k+1 may still be finishing, k-1 is
    prefetched): gathered memory stays at a few units through backward, as in FSDP2."""
    for seen in rank_pool(2).run(body_units_freed_during_backward, frozen):
        assert len(seen) == 5, seen
        for k, gathered in zip(range(4, -1, -1), seen):
            assert all(int(i) <= k + 1 for i in gathered), (k, seen)


# --------------------------------------------------------------- lifetime


def body_dropped_engine_is_freed(strategy: str) -> list:
    model = new_model()
    engine = engine_for(model, strategy)
    opt = engine.setup_optimizer(torch.optim.Adam(model.parameters(), lr=1e-3))
    x, y = rank_batch(0)
    lm_loss(model, x, y).backward()
    opt.step()
    refs = [weakref.ref(model), weakref.ref(engine)]
    del model, engine, opt
    gc.collect()
    return [ref() for ref in refs]


def body_engine_lives_as_long_as_its_model(strategy: str) -> list[float]:
    """`model = Strategy().setup_module(model)` keeps no strategy: the model must keep the engine working."""
    torch.manual_seed(0)
    model = new_model()
    opt = engine_for(model, strategy).setup_optimizer(make_optimizer(model, "sgd"))  # the engine is not kept
    gc.collect()
    for micro in range(2):
        x, y = rank_batch(micro)
        lm_loss(model, x, y).backward()
        opt.step()
        opt.zero_grad()
    x, y = (t[:PER_RANK_BATCH] for t in token_dataset().tensors)  # one batch, the same on every rank
    with torch.no_grad():
        loss = lm_loss(model, x, y).detach().reshape(1)
    everyone = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, loss)  # the same batch on every rank: the same loss if the weights agree
    return [t.item() for t in everyone]


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_the_engine_lives_as_long_as_its_model(rank_pool, strategy):
    for losses in rank_pool(2).run(body_engine_lives_as_long_as_its_model, strategy):
        assert losses[0] == losses[1], losses


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_dropped_model_and_its_engine_are_freed(rank_pool, strategy):
    """The engine's gradient hooks live on the parameters (held from C++, out of the garbage collector's
    sight), so they must not keep the engine, and through it the model and its buffers, alive."""
    assert rank_pool(2).run(body_dropped_engine_is_freed, strategy) == [[None, None]] * 2


def body_remove_hooks() -> int:
    model = new_model()
    engine = engine_for(model, "ddp")
    engine.remove_hooks()
    x, y = rank_batch(0)
    lm_loss(model, x, y).backward()
    return engine.units[0].ready_count


def test_remove_hooks_detaches_the_engine(rank_pool):
    assert rank_pool(2).run(body_remove_hooks) == [0, 0]  # no gradient hook ran


# --------------------------------------------------------------- gradients between steps


class Branches(nn.Module):
    """`left` always computes; `right` only where the step asks for it (per rank, per step)."""

    def __init__(self) -> None:
        super().__init__()
        self.left = nn.Linear(3, 3)
        self.right = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, use_right: bool) -> torch.Tensor:
        x = self.left(x)
        return self.right(x) if use_right else x


def body_gradients_between_steps(strategy: str) -> dict:
    """Step 1: `right` is used on rank 1 only. Step 2: on no rank. Plain SGD, so a parameter moves by its gradient."""
    torch.manual_seed(0)
    model = Branches()
    engine = ShardingEngine(model, SPECS[strategy])
    opt = engine.setup_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    rank = dist.get_rank()
    out = {}
    for step, use_right in enumerate([rank == 1, False]):
        x = torch.full((2, 3), float(rank + 1))
        model(x, use_right).square().sum().backward()
        if strategy in ("ddp", "zero1"):
            grad = model.right.weight.grad
            out[f"right_grad{step}"] = None if grad is None else grad.clone()
        before = full_weights(engine)
        opt.step()
        opt.zero_grad()
        after = full_weights(engine)
        out[f"moved{step}"] = {n: not torch.equal(before[n], after[n]) for n in after}
        out[f"grads_after_zero_grad{step}"] = [p.grad for p in model.parameters()]
        out[f"weights{step}"] = after
    return out


def full_weights(engine: ShardingEngine) -> dict[str, torch.Tensor]:
    """Every parameter in full (gathered under fsdp, where the module's own parameters are placeholders)."""
    return {n: v.clone() for names, views in engine.iter_full_parameters() for n, v in zip(names, views)}


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_gradients_of_a_step_never_leak_into_the_next(rank_pool, strategy):
    """A parameter used on one rank only gets the same averaged gradient on every rank; one used on no rank in a
    step gets no update from the previous step's gradient; zero_grad leaves no `.grad` (as torch's default)."""
    rank0, rank1 = rank_pool(2).run(body_gradients_between_steps, strategy)
    for step in (0, 1):
        same = [torch.equal(rank0[f"weights{step}"][n], rank1[f"weights{step}"][n]) for n in rank0[f"weights{step}"]]
        assert all(same), step  # the ranks stay identical
        assert rank0[f"grads_after_zero_grad{step}"] == [None] * 4
    if strategy in ("ddp", "zero1"):
        assert torch.equal(rank0["right_grad0"], rank1["right_grad0"]) and rank0["right_grad0"].abs().sum() > 0
        assert rank0["right_grad1"] is None and rank1["right_grad1"] is None  # used on no rank: no gradient
    assert rank0["moved0"]["right.weight"] and not rank0["moved1"]["right.weight"]  # step 2: no stale gradient
    assert rank0["moved1"]["left.weight"]
