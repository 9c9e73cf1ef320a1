"""FSDP's options on real gloo ranks: meta-device initialisation, MixedPrecision, cpu_offload, activation_offload,
and the engine's refusal of unit options where parameters are not sharded.

Bodies named `body_*` run on every rank of the session's pool (tests/ranks.py); the rest runs in the test process.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import strategies.sharding.engine as engine_module
import strategies.sharding.gradients as unit_module
from callbacks import Callback
from strategies import FSDPStrategy, MixedPrecision
from strategies.sharding import FULL_SHARD, REPLICATED, ZERO1, ZERO2, ShardingEngine, UnitOptions
from strategies.sharding.meta_init import InitRecord
from tests.test_parity import (
    DIM,
    HIDDEN,
    PER_RANK_BATCH,
    VOCAB,
    Block,
    TiedLM,
    fit,
    make_optimizer,
    max_relative_difference,
    new_model,
    reference_weights,
)
from trainer import TrainModule
from trainer.checkpoint import load_full_state_dict

SEED = 0
FP32_BYTES = 4
BF16_TOLERANCE = 3e-2  # bf16 compute and reduction, fp32 masters: after 3 SGD steps far closer than this
OFFLOAD_TOLERANCE = 1e-6  # offloading moves tensors, it must not change the numbers


# ------------------------------------------------------------------------------------------ meta-device init


class Gate(nn.Module):
    """A custom layer that initialises itself in reset_parameters, as torch's own layers do."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.empty(dim))
        self.shift = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.scale, 0.5, 1.5)
        nn.init.normal_(self.shift, std=0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


class MetaBlock(nn.Module):
    """LayerNorm, Linear, Gate, Linear: 10 + 42 + 14 + 40 = 106 parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.gate = Gate(HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.gate(torch.tanh(self.up(self.norm(x)))))


class MetaNet(TrainModule):
    """Every layer is built in configure_model (on the meta device under fsdp). Records what the strategy holds
    right after setup, at on_fit_start."""

    def configure_model(self) -> None:
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([MetaBlock(), MetaBlock()])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self):
        return make_optimizer(self, "sgd")

    def on_fit_start(self) -> None:
        strategy = self.trainer.strategy
        self.initial = strategy.full_state_dict()
        self.report = strategy.memory_report()
        # Outside forward and backward every parameter is a placeholder whose storage holds no bytes.
        self.placeholders = [
            (name, type(p).__name__, p.untyped_storage().nbytes()) for name, p in self.named_parameters()
        ]


class MetaTiedLM(TiedLM):
    """TiedLM (tests/test_parity.py) with its layers built in configure_model, in the same order."""

    def __init__(self, optimizer: str = "sgd") -> None:
        TrainModule.__init__(self)
        self.optimizer_name = optimizer

    def configure_model(self) -> None:
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.weight.requires_grad_(False)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def on_fit_start(self) -> None:
        self.initial = self.trainer.strategy.full_state_dict()
        self.tied_after_setup = self.head.weight is self.emb.weight


class Bare(nn.Module):
    """A custom layer without reset_parameters: its constructor is all there is to initialise it."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))


class WithBare(MetaNet):
    def configure_model(self) -> None:
        super().configure_model()
        self.bare = Bare()


class WithBareOnMeta(MetaNet):
    """Bare built on the meta device by hand, outside configure_model: nothing recorded how to make it."""

    def __init__(self) -> None:
        super().__init__()
        with torch.device("meta"):
            self.bare = Bare()


def eager(cls: type[TrainModule]) -> TrainModule:
    """The model built eagerly (configure_model outside any init context) right after seeding."""
    torch.manual_seed(SEED)
    module = cls()
    module.configure_model()
    return module


class MaterializeProbe:
    """Wraps the engine's materialization: each time values are replayed, the bytes they hold; each time a
    parameter's full value is stored, what this rank holds besides: unsharded unit buffers, master shards, and the
    parameters of the unit being materialized."""

    def __init__(self) -> None:
        self.records: list[dict[str, int]] = []
        self.replayed: list[int] = []
        self.original = engine_module.materialize
        self.original_replay = InitRecord.materialize

    def __enter__(self) -> MaterializeProbe:
        probe = self

        def replaying(record, tensors):
            values = probe.original_replay(record, tensors)
            storages = {v.untyped_storage()._cdata: v.untyped_storage().nbytes() for v in values}
            probe.replayed.append(sum(storages.values()))
            return values

        def probing(root, meta_params, device, write_back, group=None, record=None, units=None):
            engine = write_back.__self__

            def recording(param, value):
                unit, _ = engine._unit_of_param[id(param)]
                self.records.append(
                    {
                        "unit_bytes": sum(p.numel() * p.element_size() for p in unit.params),
                        "unsharded_unit_bytes": sum(u.full_flat.untyped_storage().nbytes() for u in engine.units),
                        "master_bytes": sum(u.master.numel() * u.master.element_size() for u in engine.units),
                    }
                )
                write_back(param, value)

            return self.original(root, meta_params, device, recording, group, record, units)

        engine_module.materialize = probing
        InitRecord.materialize = replaying
        return self

    def __exit__(self, *exc) -> None:
        engine_module.materialize = self.original
        InitRecord.materialize = self.original_replay


def body_meta_init() -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(SEED + rank)  # each rank seeds differently: rank 0's initialisation is the truth
    module = MetaNet()
    with MaterializeProbe() as probe:
        trainer = fit(module, FSDPStrategy(auto_wrap_policy={MetaBlock}), world, PER_RANK_BATCH)
    torch.manual_seed(SEED + rank)
    mixed = MetaNet()  # under mixed precision the placeholders are bf16; the initialisation must stay fp32
    fit(
        mixed,
        FSDPStrategy(auto_wrap_policy={MetaBlock}, mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)),
        world,
        PER_RANK_BATCH,
        steps=1,
    )
    torch.manual_seed(SEED)
    bare = WithBare()
    fit(bare, FSDPStrategy(auto_wrap_policy={MetaBlock}), world, PER_RANK_BATCH, steps=1)
    try:
        torch.manual_seed(SEED)
        fit(WithBareOnMeta(), FSDPStrategy(auto_wrap_policy={MetaBlock}), world, PER_RANK_BATCH)
        missing = "no error"
    except ValueError as error:
        missing = str(error)
    return {
        "initial": module.initial,
        "initial_mixed": mixed.initial,
        "initial_bare": bare.initial,
        "report": module.report,
        "placeholders": module.placeholders,
        "during": probe.records,
        "replayed": probe.replayed,
        "final": trainer.strategy.full_state_dict(),
        "units": sorted(u.name for u in trainer.strategy.engine.units),
        "missing_reset": missing,
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_meta_init_equals_eager_init_and_materializes_shard_by_shard(rank_pool, world_size):
    ranks = rank_pool(world_size).run(body_meta_init)
    want = eager(MetaNet).state_dict()
    want_bare = eager(WithBare).state_dict()
    block = sum(p.numel() for p in MetaBlock().parameters())
    total = sum(p.numel() for p in want.values())
    units = {"blocks.0": block, "blocks.1": block, "": total - 2 * block}
    assert (block, total) == (106, 343)
    shard_bytes = FP32_BYTES * sum(math.ceil(n / world_size) for n in units.values())
    biggest_unit = FP32_BYTES * max(units.values())
    for rank, got in enumerate(ranks):
        assert got["units"] == sorted(units)
        # Exactly the eager model's weights, on every rank, although rank r was seeded with SEED + r.
        assert got["initial"].keys() == want.keys()
        for key, value in want.items():
            assert torch.equal(got["initial"][key], value), (rank, key)
            assert torch.equal(got["initial_mixed"][key], value), (rank, "mixed precision", key)
        # A layer without reset_parameters gets what its constructor made (torch.randn), as eagerly.
        for key, value in want_bare.items():
            assert torch.equal(got["initial_bare"][key], value), (rank, "bare", key)
        # After setup each rank holds its padded 1/N of the parameters (and gradients), nothing unsharded.
        report = got["report"]
        assert report["parameters"] == shard_bytes, (rank, report)
        assert report["gradients"] == shard_bytes, (rank, report)
        assert report["unsharded_in_flight"] == 0
        for name, kind, nbytes in got["placeholders"]:
            assert kind == "ShardedParameter" and nbytes == 0, (rank, name, kind, nbytes)
        # During materialization: values are replayed a parameter at a time, no unit is gathered, and the master
        # shards are already this rank's 1/N; never the whole model.
        during = got["during"]
        assert len(during) == len(want)  # one record per parameter (no tied ones here)
        for record in during:
            assert record["unsharded_unit_bytes"] == 0, record
            assert record["master_bytes"] == shard_bytes, record
        assert sorted(got["replayed"]) == sorted(FP32_BYTES * v.numel() for v in want.values())  # one at a time
        assert biggest_unit + shard_bytes < FP32_BYTES * total
        # Made on the meta device by hand, outside configure_model, without reset_parameters: nothing can
        # initialise it, and the error says which layer and what to do.
        message = got["missing_reset"]
        assert "'bare'" in message and "Bare" in message and "configure_model" in message, message
    # The materialized model trains like the eager one on one process.
    torch.manual_seed(SEED)
    reference = fit(MetaNet(), "single", 1, PER_RANK_BATCH * world_size).strategy.full_state_dict()
    assert max_relative_difference(reference, want) > 1e-2  # it did train
    assert max_relative_difference(ranks[0]["final"], reference) <= 1e-5


def body_meta_tied() -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    out = {}
    for name, policy in {"blocks": {Block}, "blocks_and_emb": {Block, nn.Embedding}}.items():
        torch.manual_seed(SEED + rank)
        module = MetaTiedLM()
        trainer = fit(module, FSDPStrategy(auto_wrap_policy=policy), world, PER_RANK_BATCH)
        final = trainer.strategy.full_state_dict()
        out[name] = {
            "initial": module.initial,
            "final": final,
            "tied_after_setup": module.tied_after_setup,
            "tied_after_fit": module.head.weight is module.emb.weight,
            "same_tensor": module.initial["head.weight"] is module.initial["emb.weight"]
            and final["head.weight"] is final["emb.weight"],
        }
    return out


def test_tied_weights_stay_tied_through_meta_init(rank_pool):
    ranks = rank_pool(2).run(body_meta_tied)
    want = new_model(TiedLM, seed=SEED).state_dict()
    assert torch.equal(want["head.weight"], want["emb.weight"])
    trained = reference_weights(2, "sgd")
    for rank, runs in enumerate(ranks):
        for name, got in runs.items():
            assert got["tied_after_setup"] and got["tied_after_fit"], (rank, name)
            assert got["same_tensor"], (rank, name)
            # The embedding's initialisation (its first holder), not the head's, as in the eager model.
            for key, value in want.items():
                assert torch.equal(got["initial"][key], value), (rank, name, key)
            assert max_relative_difference(got["final"], trained) <= 1e-5, (rank, name)


# ------------------------------------------------------------------------------------------ mixed precision


class Recorder:
    """Patches Block.forward and the unit's reduce-scatter to record the dtypes really used."""

    def __init__(self) -> None:
        self.forward: list[tuple[torch.dtype, torch.dtype, bool]] = []
        self.reduce: list[torch.dtype] = []

    def __enter__(self) -> Recorder:
        self.block_forward, self.reduce_scatter = Block.forward, unit_module.reduce_scatter_parts

        def forward(block, x):
            weight = block.l1.weight
            self.forward.append((weight.dtype, x.dtype, bool(weight.abs().sum() > 0)))
            return self.block_forward(block, x)

        def reduce_scatter(shard, parts, *args, **kwargs):
            self.reduce.append(parts[0][0].dtype)
            return self.reduce_scatter(shard, parts, *args, **kwargs)

        Block.forward, unit_module.reduce_scatter_parts = forward, reduce_scatter
        return self

    def __exit__(self, *exc) -> None:
        Block.forward, unit_module.reduce_scatter_parts = self.block_forward, self.reduce_scatter


MIXED = {
    "fp32": None,
    "bf16": MixedPrecision(param_dtype=torch.bfloat16),
    "bf16_fp32_reduce": MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
}


def body_mixed_precision(directory: str) -> dict:
    out = {}
    for name, policy in MIXED.items():
        with Recorder() as recorder:
            strategy = FSDPStrategy(auto_wrap_policy={Block}, mixed_precision=policy)
            trainer = fit(new_model(), strategy, dist.get_world_size(), PER_RANK_BATCH)
        path = os.path.join(directory, name)
        trainer.save_checkpoint(path)
        dist.barrier()
        optimizer = trainer.optimizers[0]
        out[name] = {
            "forward": recorder.forward,
            "reduce": set(recorder.reduce),
            "full": trainer.strategy.full_state_dict(),
            "checkpoint": load_full_state_dict(path),
            "masters": {u.master.dtype for u in trainer.strategy.engine.units},
            "optimizer_state": {v.dtype for s in optimizer.state.values() for v in s.values() if v.dim() > 0},
            "optimizer_params": {p.dtype for g in optimizer.param_groups for p in g["params"]},
        }
    return out


def test_mixed_precision_computes_in_bf16_and_keeps_fp32_masters(rank_pool, tmp_path):
    ranks = rank_pool(2).run(body_mixed_precision, str(tmp_path))
    assert max_relative_difference(ranks[0]["fp32"]["full"], reference_weights(2, "sgd")) <= 1e-5
    for rank, runs in enumerate(ranks):
        fp32 = runs["fp32"]["full"]
        for name, run in runs.items():
            compute = torch.float32 if name == "fp32" else torch.bfloat16
            reduce = torch.bfloat16 if name == "bf16" else torch.float32
            # Inside each block's forward its weight is gathered (non-zero) in the compute dtype, and so are the
            # activations coming from the root unit's embedding.
            assert len(run["forward"]) == 2 * 3 * 2  # two blocks, three steps of two micro-batches
            assert set(run["forward"]) == {(compute, compute, True)}, (rank, name, set(run["forward"]))
            assert run["reduce"] == {reduce}, (rank, name)
            # Master shards, optimizer state, gathered weights and checkpoints are fp32.
            assert run["masters"] == run["optimizer_params"] == run["optimizer_state"] == {torch.float32}, name
            for source in ("full", "checkpoint"):
                assert {v.dtype for v in run[source].values()} == {torch.float32}, (rank, name, source)
            assert max_relative_difference(run["checkpoint"], run["full"]) == 0, (rank, name)
            if name != "fp32":
                difference = max_relative_difference(run["full"], fp32)
                assert 0 < difference <= BF16_TOLERANCE, (rank, name, difference)  # > 0: bf16 really was used
    assert max_relative_difference(ranks[0]["bf16"]["full"], ranks[1]["bf16"]["full"]) == 0


def test_mixed_precision_rejects_bad_dtypes():
    for bad in (torch.int8, torch.bool, "bf16", torch.complex64):
        with pytest.raises(TypeError, match="param_dtype"):
            MixedPrecision(param_dtype=bad)
        with pytest.raises(TypeError, match="reduce_dtype"):
            MixedPrecision(reduce_dtype=bad)
    with pytest.raises(TypeError, match="mixed_precision"):
        FSDPStrategy(mixed_precision=torch.bfloat16)
    for option in ("cpu_offload", "activation_offload"):
        with pytest.raises(TypeError, match=option):
            FSDPStrategy(**{option: "yes"})


# ------------------------------------------------------------------------------------------------- offload


class SaveOnCpuCounter:
    """Counts the activations packed by torch.autograd.graph.save_on_cpu (what activation_offload uses)."""

    def __init__(self) -> None:
        self.packed = 0
        self.original = torch.autograd.graph.save_on_cpu

    def __enter__(self) -> SaveOnCpuCounter:
        counter, original = self, self.original

        class Counting(original):
            def __init__(self, *args, **kwargs) -> None:
                super().__init__(*args, **kwargs)
                pack = self.pack_hook

                def counted(tensor):
                    counter.packed += 1
                    return pack(tensor)

                self.pack_hook = counted

        torch.autograd.graph.save_on_cpu = Counting
        return self

    def __exit__(self, *exc) -> None:
        torch.autograd.graph.save_on_cpu = self.original


class GradientDevices(Callback):
    """The devices of the sharded gradients as the optimizer is about to step (they are freed by zero_grad)."""

    def __init__(self) -> None:
        self.devices: set[str] = set()

    def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
        self.devices |= {u.grads.shard.device.type for u in trainer.strategy.engine.units}


def body_offload() -> dict:
    out = {}
    for name, options in {
        "plain": {},
        "cpu_offload": {"cpu_offload": True},
        "activation_offload": {"activation_offload": True},
    }.items():
        gradients = GradientDevices()
        with SaveOnCpuCounter() as counter:
            strategy = FSDPStrategy(auto_wrap_policy={Block}, **options)
            trainer = fit(
                new_model(optimizer="adamw"), strategy, dist.get_world_size(), PER_RANK_BATCH, callbacks=[gradients]
            )
        units = trainer.strategy.engine.units
        optimizer = trainer.optimizers[0]
        out[name] = {
            "full": trainer.strategy.full_state_dict(),
            "packed": counter.packed,
            "devices": {u.master.device.type for u in units}
            | gradients.devices
            | {v.device.type for s in optimizer.state.values() for v in s.values() if v.dim() > 0},
            "shard_devices": {u.shard_device.type for u in units},
            "offload_option": trainer.strategy.engine.unit_options.offload_to_cpu,
        }
    return out


def test_cpu_and_activation_offload_give_the_same_weights(rank_pool):
    ranks = rank_pool(2).run(body_offload)
    trained = reference_weights(2, "adamw")
    for rank, runs in enumerate(ranks):
        plain = runs["plain"]
        assert max_relative_difference(plain["full"], trained) <= 1e-4, rank
        for name in ("cpu_offload", "activation_offload"):
            assert max_relative_difference(runs[name]["full"], plain["full"]) <= OFFLOAD_TOLERANCE, (rank, name)
        # Master shards, sharded gradients and optimizer state live in CPU memory (on this CPU-only machine that
        # holds anyway, so also check that the option reached the engine).
        assert [runs[n]["offload_option"] for n in runs] == [False, True, False]
        assert runs["cpu_offload"]["devices"] == runs["cpu_offload"]["shard_devices"] == {"cpu"}
        # Saved activations went through save_on_cpu only when asked for.
        assert plain["packed"] == runs["cpu_offload"]["packed"] == 0
        assert runs["activation_offload"]["packed"] > 0


# --------------------------------------------------------------------------------- options need fsdp's spec


def test_engine_refuses_unit_options_where_they_cannot_work():
    """Mixed precision needs a sharded optimizer state (it keeps the fp32 masters); replicated gradients are
    reduced in the param dtype; CPU offloading needs sharded parameters."""
    bf16, reduce32 = UnitOptions(param_dtype=torch.bfloat16), UnitOptions(reduce_dtype=torch.float32)
    offload = UnitOptions(offload_to_cpu=True)
    refused = {REPLICATED: [bf16, reduce32, offload], ZERO1: [reduce32, offload], ZERO2: [offload]}
    for spec, options in refused.items():
        for option in options:
            with pytest.raises(ValueError, match=r"needs|reduced in param_dtype"):
                ShardingEngine(new_model(), spec, unit_options=option)
    accepted = {ZERO1: [bf16], ZERO2: [bf16, reduce32], FULL_SHARD: [bf16, reduce32, offload]}
    for spec, options in accepted.items():
        for option in options:
            assert ShardingEngine(new_model(), spec, unit_options=option).unit_options == option


# --------------------------------------------------------------- mixed precision keeps norm layers in fp32


class RecordNormDtypes(Callback):
    """At fit start, hooks every LayerNorm (after the engine's own hooks) to record what it computes with."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, str, str]] = set()
        self.block_outputs: set[str] = set()

    def on_fit_start(self, trainer, module) -> None:
        def record(norm, args, output):
            self.seen.add((str(args[0].dtype), str(norm.weight.dtype), str(output.dtype)))

        for m in module.modules():
            if isinstance(m, nn.LayerNorm):
                m.register_forward_hook(record)
        module.blocks[0].register_forward_hook(lambda m, a, out: self.block_outputs.add(str(out.dtype)))


def body_mixed_precision_norms() -> tuple[list, list, dict, dict]:
    world = dist.get_world_size()
    recorder = RecordNormDtypes()
    policy = MixedPrecision(param_dtype=torch.bfloat16)
    torch.manual_seed(0)
    bf16 = fit(
        MetaNet(),
        FSDPStrategy(auto_wrap_policy={MetaBlock}, mixed_precision=policy),
        world,
        PER_RANK_BATCH,
        callbacks=[recorder],
    )
    torch.manual_seed(0)
    fp32 = fit(MetaNet(), FSDPStrategy(auto_wrap_policy={MetaBlock}), world, PER_RANK_BATCH)
    return (
        sorted(recorder.seen),
        sorted(recorder.block_outputs),
        bf16.strategy.full_state_dict(),
        fp32.strategy.full_state_dict(),
    )


def test_mixed_precision_runs_norm_layers_in_fp32(rank_pool):
    for seen, block_outputs, bf16, fp32 in rank_pool(2).run(body_mixed_precision_norms):
        # Norms compute with fp32 inputs and weights; their outputs (seen after the engine's hook) are cast back
        # to the bf16 their inputs had, for the next layer.
        assert seen == [("torch.float32", "torch.float32", "torch.bfloat16")]
        assert block_outputs == ["torch.bfloat16"]
        assert 0 < max_relative_difference(bf16, fp32) <= 3e-2
