"""The memory plan: model-state bytes from the engine's own layout (checked against the ZeRO paper, the table in
docs/architecture.md and the engine's memory report after real set-up), activations counted from a forward and
backward on fake tensors, the command line and its JSON, and Trainer(strategy="auto") deciding by the plan."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from strategies.plan import (
    FORECAST_KEYS,
    STRATEGY_ORDER,
    MemoryPlan,
    StrategyMemory,
    model_state_bytes,
    parse_bytes,
    plan_memory,
)
from strategies.plan.__main__ import main as plan_main
from strategies.sharding import FULL_SHARD, REPLICATED, ZERO1, ZERO2, ShardingEngine, UnitOptions
from tests.test_parity import VOCAB, Block, TiedLM, token_dataset
from trainer import Trainer, TrainModule, planning

QUIET = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}
GB = 1e9
KINDS = (
    "parameters",
    "gradients",
    "optimizer",
    "units_in_flight",
    "activations",
    "temporaries",
    "optimizer_step",
    "total",
)


# ---------------------------------------------------------------------------------------------- model state


class LinearStack(nn.Module):
    """`layers` square Linear layers without bias: exactly layers * width**2 parameters."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(nn.Linear(width, width, bias=False) for _ in range(layers)))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)

    def example_input(self, batch_size: int, seq_len: int | None) -> torch.Tensor:
        return torch.randn(batch_size, self.width)


def test_zero_paper_figure_1():
    """Rajbhandari et al. 2019, Figure 1: 7.5B parameters, mixed-precision Adam (K = 12), 64 ranks."""
    with torch.device("meta"):
        model = LinearStack(300, 5000)  # 7.5e9 parameters
    plan = plan_memory(model, world_size=64, param_dtype=torch.float16, optimizer="adam", wrap_policy={nn.Linear})
    paper = {"ddp": 120, "zero1": 31.4, "zero2": 16.6, "fsdp": 1.9}
    for name, want in paper.items():
        got = plan.strategies[name].model_state / GB
        assert abs(got - want) / want < 0.02, (name, got, want)


def test_fp32_model_state_follows_the_design_table():
    """docs/architecture.md, Adam in fp32: 16P, 8P + 8P/N, 4P + 12P/N, 16P/N (P divisible by N: no padding)."""
    model, n = LinearStack(3, 8), 4
    p = 3 * 8 * 8
    want = {"ddp": 16 * p, "zero1": 8 * p + 8 * p // n, "zero2": 4 * p + 12 * p // n, "fsdp": 16 * p // n}
    specs = {"ddp": REPLICATED, "zero1": ZERO1, "zero2": ZERO2, "fsdp": FULL_SHARD}
    for name, spec in specs.items():
        assert model_state_bytes(model, spec, n, wrap_policy={nn.Linear}).model_state == want[name], name


def engine_cases() -> dict[str, tuple]:
    block_policy = {Block}
    return {
        "ddp": (REPLICATED, None, None),
        "zero1": (ZERO1, None, None),
        "zero2": (ZERO2, None, None),
        "fsdp": (FULL_SHARD, block_policy, None),
        "fsdp-root-only": (FULL_SHARD, None, None),
        "fsdp-bf16": (FULL_SHARD, block_policy, torch.bfloat16),
        "zero1-bf16": (ZERO1, None, torch.bfloat16),
        "zero2-bf16": (ZERO2, None, torch.bfloat16),
    }


def body_plan_and_engine_report() -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """Per case: the plan's (parameters, gradients, optimizer) for this rank and the engine's report after a
    real set-up and one AdamW step (TiedLM: a tied embedding, a frozen weight, units that need padding)."""
    from strategies.sharding.memory import memory_report
    from strategies.wrap import resolve_wrap_policy

    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    out = {}
    for name, (spec, policy, param_dtype) in engine_cases().items():
        torch.manual_seed(0)
        model = TiedLM()
        planned = model_state_bytes(
            model, spec, world_size, rank=rank, wrap_policy=policy, param_dtype=param_dtype, optimizer="adamw"
        )
        engine = ShardingEngine(
            model,
            spec,
            wrap_policy=resolve_wrap_policy(policy),
            unit_options=UnitOptions(param_dtype=param_dtype) if param_dtype else None,
        )
        optimizer = engine.setup_optimizer(torch.optim.AdamW(model.parameters()))
        x = torch.randint(0, VOCAB, (2, 4), generator=torch.Generator().manual_seed(rank))
        F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
        optimizer.step()
        report = memory_report(engine)
        out[name] = (
            (planned.parameters, planned.gradients, planned.optimizer),
            (report["parameters"], report["gradients"], report["optimizer_state"]),
        )
    return out


@pytest.mark.parametrize("world_size", [1, 2])
def test_model_state_equals_the_engine_report_after_setup(rank_pool, world_size):
    results = [body_plan_and_engine_report()] if world_size == 1 else rank_pool(2).run(body_plan_and_engine_report)
    for by_case in results:
        for name, (planned, reported) in by_case.items():
            assert planned == reported, (world_size, name, planned, reported)


# ---------------------------------------------------------------------------------------------- activations


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(torch.relu(self.l1(x)))

    def example_input(self, batch_size: int, seq_len: int | None) -> torch.Tensor:
        return torch.randn(batch_size, 8)


def test_activations_are_what_autograd_saves():
    """l1 saves its input (for its weight's gradient), relu and l2 share relu's output; weights are not
    activations."""
    assert plan_memory(MLP(), batch_size=3).activations == (3 * 8 + 3 * 16) * 4


class Residual(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.l2(torch.tanh(self.l1(x)))


class ResidualStack(nn.Module):
    def __init__(self, depth: int = 4, width: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Residual(width, hidden) for _ in range(depth)))
        self.width = width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)

    def example_input(self, batch_size: int, seq_len: int | None) -> torch.Tensor:
        return torch.randn(batch_size, self.width)


def test_activation_checkpointing_keeps_only_the_inputs():
    """Each block saves its input (l1) and tanh's output (tanh, l2). Checkpointed, a block keeps its input, and
    backward recomputes one block at a time: its tanh output comes back on top of the kept inputs."""
    b, depth, width, hidden = 2, 4, 8, 32
    plain = plan_memory(ResidualStack(depth, width, hidden), batch_size=b).activations
    assert plain == depth * b * (width + hidden) * 4
    checkpointed = plan_memory(
        ResidualStack(depth, width, hidden), batch_size=b, activation_checkpointing={Residual}
    ).activations
    assert checkpointed == depth * b * width * 4 + b * hidden * 4


def test_mixed_precision_and_token_models():
    """A token model (first parameter an Embedding) gets int64 tokens and a next-token loss. bf16 autocast saves
    fewer bytes than fp32 (not half: the loss works in fp32, and the bf16 copies of the weights are saved too);
    bf16-true and 16-true (every precision the Trainer takes) halve the model state as well."""
    from examples.llama import llama_tiny

    fp32, bf16, true, fp16_true = (
        plan_memory(llama_tiny(), batch_size=8, seq_len=64, precision=precision)
        for precision in ("32", "bf16-mixed", "bf16-true", "16-true")
    )
    assert 0 < true.activations < bf16.activations < 0.8 * fp32.activations
    assert fp32.strategies["ddp"].model_state == bf16.strategies["ddp"].model_state
    assert fp32.strategies["ddp"].model_state == 2 * true.strategies["ddp"].model_state
    assert fp16_true.strategies["ddp"].model_state == true.strategies["ddp"].model_state


def test_a_70b_model_is_planned_without_memory():
    """Llama-shaped 70B on 8 ranks, 4096 tokens: built on the meta device, activations counted on fake tensors.
    A fresh process, so that its peak resident memory is this plan's alone. There too, the first plan of a
    process agrees with the next (the fake mode runs an operator it meets for the first time as a decomposition
    into others, whose tensors are not the operator's memory: that gave up to 16 MiB more). Within 1% rather
    than exactly: the sharded gradients' replay still differs by some 64 KiB in one process out of a few
    (units_in_flight; not reproduced outside the suite, cause not found)."""
    script = (
        "import json, resource, time, torch\n"
        "from examples.gpt import gpt_quickstart\n"
        "from examples.llama import llama_70b\n"
        "from strategies.plan import plan_memory\n"
        "first, second = (plan_memory(gpt_quickstart(), batch_size=2, activation_checkpointing=lambda m, name:\n"
        "                             type(m).__name__ == 'Block').to_json() for _ in range(2))\n"
        "near = [abs(first[s][k] - second[s][k]) <= 0.01 * first[s]['total'] for s in first for k in first[s]]\n"
        "assert all(near) and first.keys() == second.keys(), (first, second)\n"
        "before, start = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, time.perf_counter()\n"
        "with torch.device('meta'):\n"
        "    model = llama_70b()\n"
        "plan = plan_memory(model, world_size=8, batch_size=1, seq_len=4096, precision='bf16-mixed',\n"
        "                   wrap_policy=lambda m, name: type(m).__name__ == 'Block', forecast=False)\n"
        "grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024\n"
        "print(json.dumps({'grown': grown, 'seconds': time.perf_counter() - start,\n"
        "                  'fsdp': plan.strategies['fsdp'].model_state}))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["grown"] < 300 * 2**20, result
    assert result["seconds"] < 120, result  # seconds in practice; generous on a busy 2-core machine
    assert 16 * 68.9e9 / 8 < result["fsdp"] < 16 * 69.1e9 / 8


# -------------------------------------------------------------------------------------- command line and JSON


def test_command_line_json(capsys):
    plan_main(
        [
            "examples.gpt:gpt_quickstart",
            "--world-size",
            "2",
            "--batch-size",
            "2",
            "--seq-len",
            "32",
            "--wrap",
            "Block",
            "--json",
        ]
    )
    plan = json.loads(capsys.readouterr().out)
    assert list(plan) == [name for name in STRATEGY_ORDER if name != "hsdp"]  # hsdp: with --hybrid-shard or nodes
    for name, row in plan.items():
        assert list(row) == [*KINDS, *FORECAST_KEYS], name  # the forecast's keys: tests/test_forecast.py
        row = {kind: row[kind] for kind in KINDS}
        assert all(isinstance(v, int) and v >= 0 for v in row.values()), row
        transient = row["units_in_flight"] + row["activations"] + row["temporaries"]
        gradients = row["gradients"] + transient if name in ("ddp", "zero1") else max(row["gradients"], transient)
        step = row["parameters"] + row["gradients"] + row["optimizer"] + row["optimizer_step"]
        assert row["total"] == max(row["parameters"] + row["optimizer"] + gradients, step), name
    assert abs(plan["ddp"]["optimizer"] - 2 * plan["ddp"]["parameters"]) <= 2 * 4 * 2  # padding: < 2 elements
    assert plan["fsdp"]["parameters"] < plan["ddp"]["parameters"] and plan["fsdp"]["units_in_flight"] > 0


def test_command_line_table(capsys):
    plan_main(["examples.gpt:gpt_quickstart", "--world-size", "2", "--seq-len", "32", "--device-memory", "1GiB"])
    out = capsys.readouterr().out
    for name in ("ddp", "zero1", "zero2", "fsdp"):
        assert name in out
    assert "1.00 GiB" in out and "least communication" in out


# ------------------------------------------------------------------------------------------- choosing by plan


def synthetic_plan(totals: dict[str, int]) -> MemoryPlan:
    rows = {name: StrategyMemory(total, 0, 0, 0, 0) for name, total in totals.items()}
    return MemoryPlan(rows, world_size=2)


def test_choose_picks_the_least_communicating_strategy_that_fits():
    plan = synthetic_plan({"ddp": 400, "zero1": 300, "zero2": 250, "fsdp": 200})
    assert plan.choose(400) == "ddp"
    assert plan.choose(399) == "zero1"
    assert plan.choose(260) == "zero2"
    assert plan.choose(200) == "fsdp"
    with pytest.raises(ValueError, match=r"no strategy fits 199 B per rank.*ddp 400 B.*fsdp 200 B"):
        plan.choose(199)


class SmallLM(TrainModule):
    """TiedLM without a frozen weight, and no example_input: the plan takes its batch from the DataLoader."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TiedLM()

    def training_step(self, batch, batch_idx):
        return self.lm.training_step(batch, batch_idx)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class TokenTensorLM(TrainModule):
    """A language model whose training_step takes one token tensor and predicts each next token (no
    example_input)."""

    def __init__(self) -> None:
        super().__init__()
        self.lm = TiedLM()

    def training_step(self, tokens, batch_idx):
        logits = self.lm(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


@pytest.mark.parametrize("factory", ["SmallLM", "TokenTensorLM"])
def test_a_token_train_module_is_planned_from_the_command_line(capsys, factory):
    """README's promise: a token model (first parameter an Embedding) gets int64 tokens with a next-token loss; a
    TrainModule's training_step gets them as it takes them, (inputs, targets) or one token tensor."""
    plan_main([f"tests.test_plan:{factory}", "--world-size", "2", "--batch-size", "2", "--seq-len", "4", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert plan["ddp"]["activations"] > 0 and plan["fsdp"]["total"] < plan["ddp"]["total"]


def body_auto_strategy() -> tuple[dict[str, int], list[tuple[int | None, str]]]:
    """The plan's totals at 2 ranks, and the strategy Trainer(strategy="auto") ends with for budgets around them
    (an error's message where none fits)."""
    loader = DataLoader(token_dataset(8), batch_size=2)
    plan = Trainer(strategy="auto", devices=2, **QUIET).plan(SmallLM(), train_dataloaders=loader)
    totals = {name: row.total for name, row in plan.strategies.items()}
    chosen = []
    # the last budget fits nothing, with or without splitting the sequences (strategy="auto" tries context parallel)
    for budget in [None, *sorted(set(totals.values())), 1024]:
        trainer = Trainer(strategy="auto", devices=2, max_steps=1, max_memory_per_rank=budget, **QUIET)
        try:
            trainer.fit(SmallLM(), loader)
            chosen.append((budget, trainer.strategy.name))
        except ValueError as error:
            chosen.append((budget, str(error)))
    return totals, chosen


def test_auto_strategy_decides_by_the_plan(rank_pool):
    """Without a budget on CPU: ddp. With one: the first of ddp, zero1, zero2, fsdp whose total fits."""
    (totals, chosen), other_rank = rank_pool(2).run(body_auto_strategy)
    assert other_rank == (totals, chosen)
    assert chosen[0] == (None, "ddp")
    for budget, name in chosen[1:-1]:
        assert name == next(n for n in STRATEGY_ORDER if totals[n] <= budget), (budget, name, totals)
    assert len({name for _, name in chosen[1:-1]}) > 1, chosen
    assert "no strategy fits" in chosen[-1][1] and "max_memory_per_rank" in chosen[-1][1], chosen[-1]


def test_auto_on_one_rank_is_single_when_the_plan_fits_and_an_error_when_not(capsys):
    """One rank with a budget (on a GPU: its free memory): single if the plan fits it, else a clear error,
    before any memory is taken (as on several ranks)."""
    loader = DataLoader(token_dataset(8), batch_size=2)
    trainer = Trainer(strategy="auto", devices=1, max_steps=1, max_memory_per_rank="1GiB", **QUIET)
    trainer.fit(SmallLM(), loader)
    assert trainer.strategy.name == "single"
    assert "chose single: one rank, and its plan fits 1.00 GiB" in capsys.readouterr().out
    trainer = Trainer(strategy="auto", devices=1, max_steps=1, max_memory_per_rank=1024, **QUIET)
    with pytest.raises(ValueError, match="strategy=.auto. with max_memory_per_rank=1.0 KiB: no strategy fits"):
        trainer.fit(SmallLM(), loader)


def test_plan_after_fit_leaves_the_module_alone(monkeypatch):
    """Planning a module that fsdp has set up (sharded parameters, the engine's hooks) reads only shapes and
    changes nothing. The Trainer's FSDPStrategy options are the plan's: units per Block, not one root unit."""
    from strategies import FSDPStrategy
    from strategies.sharding.collectives import ONE_RANK_COLLECTIVES

    monkeypatch.setenv(ONE_RANK_COLLECTIVES, "1")  # units and hooks as on several ranks (one rank keeps none)

    module, loader = SmallLM(), DataLoader(token_dataset(8), batch_size=2)
    trainer = Trainer(strategy=FSDPStrategy(auto_wrap_policy={Block}), devices=1, max_steps=1, **QUIET)
    trainer.fit(module, loader)
    before, hooks = trainer.strategy.full_state_dict(), len(module.lm.blocks[0]._forward_pre_hooks)
    plan = trainer.plan(module, train_dataloaders=loader)
    root_only = Trainer(strategy="fsdp", devices=1, **QUIET).plan(module, train_dataloaders=loader)
    assert "by the wrap policy" in plan.description[1] and "one unit" in root_only.description[1]
    assert plan.strategies["fsdp"].units_in_flight <= root_only.strategies["fsdp"].units_in_flight
    after = trainer.strategy.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before) and before.keys() == after.keys()
    assert hooks > 0 and len(module.lm.blocks[0]._forward_pre_hooks) == hooks


# ------------------------------------------------------------------------------------------------ bad input


def test_bad_arguments_are_value_errors_naming_them():
    with pytest.raises(ValueError, match="max_memory_per_rank='lots'"):
        parse_bytes("lots", "max_memory_per_rank")
    assert parse_bytes("2GiB", "x") == 2 * 2**30 and parse_bytes("1.5 GB", "x") == 1_500_000_000
    assert parse_bytes(1024, "x") == 1024
    with pytest.raises(ValueError, match="world_size=0"):
        plan_memory(MLP(), world_size=0)
    with pytest.raises(ValueError, match="optimizer='shampoo'.*adamw"):
        plan_memory(MLP(), optimizer="shampoo")
    with pytest.raises(ValueError, match="precision='fp8'.*bf16-mixed"):
        plan_memory(MLP(), precision="fp8")
    with pytest.raises(ValueError, match="nodes=2"):
        plan_memory(MLP(), world_size=3, nodes=2)
    with pytest.raises(ValueError, match="example_input"):
        plan_memory(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="max_memory_per_rank='lots'"):
        Trainer(strategy="auto", devices=1, max_memory_per_rank="lots", **QUIET)
    with pytest.raises(ValueError, match="max_memory_per_rank.*strategy='auto'"):
        Trainer(strategy="ddp", devices=1, max_memory_per_rank="1GiB", **QUIET)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["examples.gpt"], "MODULE:FACTORY"),
        (["examples.nothing_here:f"], "examples.nothing_here"),
        (["examples.gpt:no_such_factory"], "no_such_factory"),
        (["examples.gpt:gpt_quickstart", "--wrap", "Nope"], "--wrap"),
        (["examples.gpt:gpt_quickstart", "--device-memory", "lots"], "--device-memory"),
    ],
)
def test_command_line_errors(capsys, argv, message):
    with pytest.raises(SystemExit) as info:
        plan_main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_hybrid_sharding_is_planned_as_fsdp_over_its_group():
    """hsdp's model state is fsdp's over G ranks (replicated across the groups); with several nodes it is
    planned by default with G = the ranks of one node."""
    model, sample = TiedLM(), token_dataset()[0]
    plan = plan_memory(model, world_size=8, hybrid_shard=2, wrap_policy={Block}, sample=sample)
    over_two = plan_memory(model, world_size=2, wrap_policy={Block}, sample=sample).strategies["fsdp"]
    assert plan.strategies["hsdp"].model_state == over_two.model_state
    assert plan.strategies["fsdp"].model_state < plan.strategies["hsdp"].model_state
    assert "hsdp" in plan.to_json() and "hsdp" not in plan_memory(model, world_size=8, sample=sample).to_json()
    by_nodes = plan_memory(model, world_size=8, nodes=4, wrap_policy={Block}, sample=sample)
    assert by_nodes.strategies["hsdp"].model_state == over_two.model_state
    with pytest.raises(ValueError, match="hybrid_shard=3"):
        plan_memory(model, world_size=8, hybrid_shard=3, sample=sample)


# ------------------------------------------------------------------------------------- plan against measurement

# A GPT of 3.7M parameters trained on 2 real ranks, 4 x 256 tokens each: the plan's total against each rank's peak
# resident memory above its baseline (issue 27: within [0.95, 1.10] of it, so that a plan saying "fits" does not
# run out). Large enough that model state and activations dominate what the loop adds.
MEASURED_CONFIG = {"block_size": 256, "n_layer": 2, "n_head": 6, "n_embd": 384}
MEASURED_BATCH = 4
MEASURED_CASES = {  # name: (strategy, precision, activation checkpointing per Block)
    "ddp": ("ddp", "32", False),
    "zero1": ("zero1", "32", False),
    "zero2": ("zero2", "32", False),
    "fsdp": ("fsdp", "32", False),
    "fsdp-bf16-mixed": ("fsdp", "bf16-mixed", False),
    "fsdp-checkpointed": ("fsdp", "32", True),
}


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024


_WARM: set[tuple] = set()  # cases this rank process has trained once


def body_peak_above_baseline(strategy: str, precision: str, checkpointed: bool) -> int:
    """Peak resident memory of this rank while a Trainer sets up and trains 2 steps, above its resident memory
    just before. Freed heap pages are returned first, and blocks of 64 KiB or more are given back to the system
    when freed (benchmarks/memory.py runs with MALLOC_MMAP_THRESHOLD_=1MiB), so the rise is what training holds.
    The first fit of a case in a process is not measured: it also makes what a process keeps once made (3 to
    11 MiB here: the CPU kernels' code and caches for these shapes and dtypes, read-in pages of torch's
    libraries), which the plan does not count; benchmarks/memory.py measures that first fit."""
    import ctypes
    import importlib

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 2**10)  # M_MMAP_THRESHOLD: blocks from 64 KiB up (a bf16 copy of a weight) given back
    importlib.import_module("torch._dynamo")  # what the first optimizer imports: not training's memory
    case = (strategy, precision, checkpointed)
    if case not in _WARM:
        _fit_measured(*case, steps=1)
        _WARM.add(case)
    return _fit_measured(*case)


def _fit_measured(strategy: str, precision: str, checkpointed: bool, steps: int = 2) -> int:
    import ctypes
    import gc

    from examples.gpt import Block, GPTConfig, GPTModule, TextWindows
    from strategies import FSDPStrategy

    config = GPTConfig(**MEASURED_CONFIG)
    data = TextWindows(torch.randint(0, 256, (config.block_size * 16 + 1,), dtype=torch.uint8), config.block_size)
    loader = DataLoader(data, batch_size=MEASURED_BATCH)
    chosen = (
        FSDPStrategy(auto_wrap_policy={Block}, activation_checkpointing={Block} if checkpointed else None)
        if strategy == "fsdp"
        else strategy
    )
    trainer = Trainer(strategy=chosen, devices=2, max_steps=steps, precision=precision, **QUIET)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from here
    baseline = _rss("VmRSS:")
    trainer.fit(GPTModule(config, max_steps=steps), loader)
    return _rss("VmHWM:") - baseline


@pytest.mark.parametrize("case", list(MEASURED_CASES))
def test_plan_total_is_within_ten_percent_of_the_measured_peak(rank_pool, case):
    from examples.gpt import Block, GPTConfig, GPTModule

    strategy, precision, checkpointed = MEASURED_CASES[case]
    with torch.device("meta"):
        module = GPTModule(GPTConfig(**MEASURED_CONFIG))
    plan = plan_memory(
        module,
        world_size=2,
        batch_size=MEASURED_BATCH,
        precision=precision,
        wrap_policy={Block},
        activation_checkpointing={Block} if checkpointed else None,
    )
    planned = plan.strategies[strategy].total
    measured = rank_pool(2).run(body_peak_above_baseline, strategy, precision, checkpointed)
    ratios = [planned / peak for peak in measured]
    # In bf16-mixed, oneDNN's bf16 kernels keep workspaces beneath torch's operators that the plan does not count
    # (docs/plan.md); they vary from one CPU and one run to another by some MiB (0.94 of the peak seen once).
    lowest = 0.90 if precision == "bf16-mixed" else 0.95
    assert all(lowest <= r <= 1.10 for r in ratios), (case, planned / 2**20, [m / 2**20 for m in measured], ratios)


# ------------------------------------------------------------------ tensor parallel in the plan


def _kind(op: object) -> str:
    name = str(op)
    return next(kind for kind in ("all_gather", "reduce_scatter", "all_reduce") if kind in name)


def _counts(collectives: list[tuple[str, int]]) -> dict[str, int]:
    from collections import Counter

    return dict(Counter(kind for kind, _ in collectives))


def body_tensor_parallel_rank(loss_parallel: bool) -> dict:
    """One rank of the tiny Llama under ddp at tp 2 (torch's tensor parallel under the engine): its parameters'
    elements and the collectives of a forward and a backward, counted by torch's CommDebugMode."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import loss_parallel as parallel_loss

    from examples.llama import LLAMA_PRESETS, Llama, tensor_parallel
    from strategies import DDPStrategy

    strategy = DDPStrategy(tensor_parallel_size=2)
    torch.manual_seed(0)
    mesh = strategy.device_mesh["tensor_parallel"]
    model = strategy.setup_module(tensor_parallel(Llama(LLAMA_PRESETS["tiny"]), mesh, loss_parallel=loss_parallel))
    tokens = torch.randint(0, 256, (2, 64))
    with CommDebugMode() as forward:
        logits = model(tokens)
        with parallel_loss() if loss_parallel else torch.enable_grad():
            loss = F.cross_entropy(logits.flatten(0, 1), tokens.flatten())
    with CommDebugMode() as backward, parallel_loss() if loss_parallel else torch.enable_grad():
        loss.backward()
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    count = {}
    for phase, mode in (("forward", forward), ("backward", backward)):
        count[phase] = {}
        for op, n in mode.get_comm_counts().items():
            count[phase][_kind(op)] = count[phase].get(_kind(op), 0) + n
    return {"elements": local, **count}


@pytest.mark.parametrize("loss_parallel", [False, True])
def test_tensor_parallel_plan_matches_torchs_split_of_the_tiny_llama(rank_pool, loss_parallel):
    """The planned rank holds the parameter elements a rank of torch's tensor parallel holds, and runs the
    collectives it runs, by kind, in forward and in backward (torch's CommDebugMode counts them)."""
    from examples.llama import LLAMA_PRESETS, Llama, tensor_parallel_plan
    from strategies.plan.tensor_parallel import resolve_plan, split_for_one_rank

    torch_rank = rank_pool(2).run(body_tensor_parallel_rank, loss_parallel)[0]
    with torch.device("meta"):
        model = Llama(LLAMA_PRESETS["tiny"])
    record = split_for_one_rank(model, resolve_plan(model, tensor_parallel_plan(model, loss_parallel)), 2)
    assert sum(p.numel() for p in model.parameters()) == torch_rank["elements"]
    model.to_empty(device="cpu")
    tokens = torch.randint(0, 256, (2, 64))
    logits = model(tokens % 128)  # (the embedding's local rows: the shapes are what is checked)
    assert logits.shape == (2, 64, 256 // 2 if loss_parallel else 256)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten() % logits.shape[-1]).backward()
    assert _counts(record.forward) == torch_rank["forward"]
    assert _counts(record.backward) == torch_rank["backward"]


def test_tensor_parallel_divides_the_model_state_and_activations_and_adds_its_collectives():
    """Four layers of Llama 3.1 70B on 64 ranks as 8 nodes of 8: tp 8 holds an eighth of the split weights per
    rank, fsdp shards that over the 8 data-parallel ranks, and the tensor-parallel collectives are in the
    forecast."""
    from dataclasses import replace

    from examples.llama import LLAMA_PRESETS, Block, Llama, tensor_parallel_plan

    with torch.device("meta"):
        model = Llama(replace(LLAMA_PRESETS["3.1-70b"], n_layers=4))
    options = dict(
        world_size=64, nodes=8, batch_size=1, seq_len=8192, precision="bf16-mixed", param_dtype=torch.bfloat16,
        wrap_policy={Block}, activation_checkpointing={Block}, hardware="h100",
    )  # fmt: skip
    plain = plan_memory(model, **options)
    split = plan_memory(model, tensor_parallel=8, tensor_parallel_plan=tensor_parallel_plan, **options)
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    params = sum(p.numel() for p in model.parameters())
    assert split.strategies["ddp"].parameters == 2 * ((params - norms) // 8 + norms)  # (in the param dtype)
    local = (params - norms) // 8 + norms  # one tensor-parallel rank's elements
    assert split.strategies["fsdp"].parameters == pytest.approx(4 * local / 8, rel=1e-3)  # fp32 master shard
    # the blocks' saved inputs split along the sequence; the logits gathered whole unless the loss is parallel
    assert split.strategies["fsdp"].activations < 0.6 * plain.strategies["fsdp"].activations
    loss_parallel = plan_memory(
        model, tensor_parallel=8, tensor_parallel_plan=lambda m: tensor_parallel_plan(m, True), **options
    )
    assert loss_parallel.strategies["fsdp"].activations < split.strategies["fsdp"].activations / 3
    # tensor parallel within the node spares fsdp's gathers of the whole model across nodes; its own
    # collectives run exposed (no async tensor parallel), and the group of 8 trains one batch together
    assert split.forecasts["fsdp"].exposed_comm_s < plain.forecasts["fsdp"].exposed_comm_s
    assert split.forecasts["fsdp"].tokens_per_s_per_rank == pytest.approx(8192 / 8 / split.forecasts["fsdp"].step_s)
    assert "8 tensor-parallel x 8 data-parallel" in split.table()
    with pytest.raises(ValueError, match="tensor_parallel_plan"):
        plan_memory(model, tensor_parallel=8, **options)
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide world_size=64"):
        plan_memory(model, tensor_parallel=3, tensor_parallel_plan=tensor_parallel_plan, **options)


def test_command_line_plans_tensor_parallel(capsys):
    """--tensor-parallel takes the target module's tensor_parallel_plan; a module without one is refused."""
    planned = {}
    for tp in ("1", "2"):
        plan_main(["examples.llama:llama_tiny", "--world-size", "4", "--tensor-parallel", tp, "--wrap", "Block"])
        planned[tp] = capsys.readouterr().out
        plan_main(
            ["examples.llama:llama_tiny", "--world-size", "4", "--tensor-parallel", tp, "--wrap", "Block", "--json"]
        )
        planned[tp + "json"] = json.loads(capsys.readouterr().out)
    assert "2 tensor-parallel x 2 data-parallel" in planned["2"]
    assert planned["2json"]["ddp"]["parameters"] < 0.6 * planned["1json"]["ddp"]["parameters"]
    with pytest.raises(SystemExit):
        plan_main(["examples.gpt:gpt_quickstart", "--world-size", "4", "--tensor-parallel", "2"])
    assert "has no tensor_parallel_plan" in capsys.readouterr().err


def body_trainer_plan_under_tensor_parallel() -> tuple[dict, dict]:
    from examples.llama import tensor_parallel_plan
    from strategies import FSDPStrategy
    from tests.test_tensor_parallel import TinyLlama

    trainer = Trainer(strategy=FSDPStrategy(tensor_parallel_size=2), devices=2, logger=False)
    module = TinyLlama()
    plan = {f"model.{path}": style for path, style in tensor_parallel_plan().items()}
    loader = DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 256, (8, 17))), batch_size=2)
    planned = trainer.plan(module, train_dataloaders=loader, tensor_parallel_plan=plan)
    return planned.to_json(), {"description": planned.description}


def test_trainer_plan_under_tensor_parallel_plans_each_ranks_share(rank_pool):
    """trainer.plan under FSDPStrategy(tensor_parallel_size=2) on 2 ranks: the module's configure_model applies
    torch's tensor parallel (on the meta copy too), and the plan lays out one rank's share of the split model."""
    from examples.llama import LLAMA_PRESETS, Llama

    planned, info = rank_pool(2).run(body_trainer_plan_under_tensor_parallel)[0]
    assert "2 tensor-parallel x 1 data-parallel" in info["description"][0]
    with torch.device("meta"):
        whole = sum(p.numel() for p in Llama(LLAMA_PRESETS["tiny"]).parameters())
    assert planned["ddp"]["parameters"] < 0.6 * 4 * whole


class SplitTinyLlama(TrainModule):
    """The tiny Llama, split by examples.llama's tensor-parallel plan when the strategy's mesh asks, and saying so
    in tensor_parallel_plan() (what trainer.plan and strategy="auto" read)."""

    def configure_model(self) -> None:
        from examples.llama import LLAMA_PRESETS, Llama, tensor_parallel

        torch.manual_seed(0)
        self.model = Llama(LLAMA_PRESETS["tiny"])
        if self.trainer.strategy.tensor_parallel_size > 1:
            tensor_parallel(self.model, self.device_mesh["tensor_parallel"])

    def tensor_parallel_plan(self) -> dict:
        from examples.llama import tensor_parallel_plan

        return {f"model.{path}": style for path, style in tensor_parallel_plan().items()}

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return F.cross_entropy(self.model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def body_auto_with_tensor_parallel() -> tuple[int, int, str, int, str]:
    """The smallest plan at tp 1 and at tp 2 on 4 ranks, and what strategy="auto" chooses for a budget between
    (with what it printed)."""
    import contextlib
    import io

    loader = DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 256, (16, 33))), batch_size=2)
    trainer = Trainer(strategy="auto", devices=4, **QUIET)
    plans = {
        tp: planning.make_plan(trainer, SplitTinyLlama(), train_dataloaders=loader, forecast=False, tensor_parallel=tp)
        for tp in (1, 2)
    }
    least = {tp: min(row.total for row in plan.strategies.values()) for tp, plan in plans.items()}
    budget = (least[1] + least[2]) // 2
    trainer = Trainer(strategy="auto", devices=4, max_steps=2, max_memory_per_rank=budget, **QUIET)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer.fit(SplitTinyLlama(), loader)
    return least[1], least[2], trainer.strategy.name, trainer.strategy.tensor_parallel_size, printed.getvalue()


def test_auto_strategy_tries_tensor_parallel_when_nothing_fits_without(rank_pool):
    """4 ranks and a budget below every strategy's plan at tp 1 but above one at tp 2: strategy="auto" picks that
    strategy with tensor_parallel_size=2, says so, and the module (split by its configure_model) trains."""
    least_one, least_two, name, tensor_parallel, printed = rank_pool(4).run(body_auto_with_tensor_parallel)[0]
    assert least_two < least_one
    assert tensor_parallel == 2 and name in STRATEGY_ORDER
    assert "with tensor_parallel_size=2 (nothing fits without)" in printed


def test_planned_units_are_in_the_engines_reduction_order(monkeypatch):
    """fsdp reduces units in the order backward finishes them (the last block first, the root last) and the plan
    replays its sharded gradients in that order: with the order of a dict of names instead (the root first, and
    full-precision norm units sorted as text, layers.10 before layers.2), the replay held every gradient until
    the end, and a 12-layer model planned more units in flight than a 2-layer one."""
    from dataclasses import replace

    from examples.llama import LLAMA_PRESETS, Llama
    from examples.llama import Block as LlamaBlock
    from strategies import FSDPStrategy, MixedPrecision
    from strategies.plan.model_bytes import plan_units
    from strategies.sharding.collectives import ONE_RANK_COLLECTIVES

    monkeypatch.setenv(ONE_RANK_COLLECTIVES, "1")  # units as on several ranks
    config = replace(LLAMA_PRESETS["tiny"], n_layers=12)
    mixed = MixedPrecision(param_dtype=torch.bfloat16)
    strategy = FSDPStrategy(auto_wrap_policy={LlamaBlock}, mixed_precision=mixed)
    strategy.setup_module(Llama(config))
    with torch.device("meta"):
        meta = Llama(config)
    planned = plan_units(meta, strategy.spec, 1, {LlamaBlock}, torch.bfloat16)
    assert [u.name for u in planned] == [u.name for u in strategy.engine.units]
    in_flight = {}
    for layers in (2, 12):
        with torch.device("meta"):
            model = Llama(replace(config, n_layers=layers))
        plan = plan_memory(
            model, world_size=4, batch_size=2, seq_len=64, precision="bf16-mixed", param_dtype=torch.bfloat16,
            wrap_policy={LlamaBlock}, activation_checkpointing={LlamaBlock}, forecast=False,
        )  # fmt: skip
        in_flight[layers] = plan.strategies["fsdp"].units_in_flight
    assert in_flight[12] <= in_flight[2] * 1.2
