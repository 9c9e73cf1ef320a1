"""The GPU check's speed parts, all variants in one process, interleaved round by round:

- GPT-2 small's shape (12 layers, 768 wide, 1024 tokens, vocabulary 50,304), batch 8, bf16 autocast, AdamW(fused):
  plain torch, torch's fully_shard per Block, this project's ddp, zero2 and fsdp; then plain torch with each Block
  compiled and fsdp with compile={Block}. Median step (CUDA events), tokens/s, MFU, max_memory_allocated.
- 48 blocks of width 64, where GPU work is negligible: the framework's own cost per step and per unit (with
  "fsdp-hooked", fsdp whose backward hooks every parameter, as before it ran once per unit).

A variant name ending in "@nccl" runs with one-rank collectives (collectives.py): the path of many GPUs, each
unit all-gathered and reduce-scattered through nccl, which fully_shard takes on one GPU too.
"""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from examples.gpt import GPT, Block, GPTConfig
from strategies import FSDPStrategy, get_strategy

from .common import (
    Settings,
    backward_per_parameter,
    check,
    lm_loss,
    new_gpt,
    one_rank_collectives,
    report,
    token_batches,
)
from .host_split import split_host_time

BF16_PEAK = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense bf16 FLOP/s by the vendors' datasheets
Step = Callable[[], None]


def gpu_peak() -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in BF16_PEAK.items() if key in name), None)


def flops_per_step(config: GPTConfig, params: int, tokens: int) -> float:
    """nanoGPT's estimate: 6 N per token for the weights, 12 L d T for attention (forward and backward)."""
    return tokens * (6 * params + 12 * config.n_layer * config.n_embd * config.block_size)


# ---------------------------------------------------------------------------------------------- variants


def collectives_of(variant: str):
    """One-rank collectives on for an "@nccl" variant, off otherwise."""
    return one_rank_collectives(variant.endswith("@nccl"))


def build_variant(name: str, config: GPTConfig, settings: Settings) -> tuple[Any, torch.optim.Optimizer]:
    """(model, optimizer) of one variant, from the same seed."""
    name = name.removesuffix("@nccl")
    device = settings.torch_device
    model = new_gpt(config)
    compiled = name.endswith("+compile")
    base = name.removesuffix("+compile")
    fused = settings.device == "cuda"
    if base == "torch":
        model = model.to(device)
        if compiled:
            for block in (m for m in model.modules() if isinstance(m, Block)):
                block.forward = torch.compile(block.forward)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    if base == "fully_shard":
        from torch.distributed.fsdp import fully_shard

        model = model.to(device)
        for block in model.h:
            fully_shard(block)
        fully_shard(model)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    if base in ("fsdp", "fsdp-hooked"):
        strategy = FSDPStrategy(auto_wrap_policy={Block}, compile={Block} if compiled else None)
    else:
        strategy = get_strategy(base)
    with backward_per_parameter(base == "fsdp-hooked"):
        model = strategy.setup_module(model)
    optimizer = strategy.setup_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused))
    # The engine's gradient hooks hold it weakly: a strategy dropped here takes its engine with it at the next
    # garbage collection, and the variant would go on timing a plain model (ddp) or fail (zero2: see overhead.py).
    optimizer.keep_alive = strategy
    return model, optimizer


def make_step(model: Any, optimizer: torch.optim.Optimizer, batch: tuple, settings: Settings) -> Step:
    x, y = (t.to(settings.torch_device) for t in batch)
    autocast = settings.device == "cuda"

    def step() -> None:
        with torch.autocast(settings.device, dtype=torch.bfloat16, enabled=autocast):
            loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed_steps(step: Step, count: int, settings: Settings, host: list[float] | None = None) -> list[float]:
    """Seconds per step: CUDA events on the GPU (the device's timeline, launch gaps included). `host` gets the
    host's seconds per step (the time to queue it): near the device's, the step is bound by the host."""
    if settings.device != "cuda":
        times = []
        for _ in range(count):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        if host is not None:
            host += times
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(count)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    if host is not None:  # a few more steps, each queued on an idle GPU: the host's own time per step
        for _ in range(3):
            began = time.perf_counter()
            step()
            host.append(time.perf_counter() - began)
            torch.cuda.synchronize()
    return [start.elapsed_time(end) / 1000 for start, end in events]


def run_interleaved(
    variants: list[str],
    config: GPTConfig,
    batch: tuple,
    settings: Settings,
    rounds: int,
    steps: int,
    warmup: int,
    profiled: tuple[str, ...] = (),
) -> dict[str, dict[str, Any]]:
    """Each round runs every variant's `steps` (rotating which goes first). Variants are built in round one;
    a variant's memory is its peak over that first run less what was allocated before it was built."""
    built: dict[str, Step] = {}
    results: dict[str, dict[str, Any]] = {name: {"times": [], "host": []} for name in variants}
    for r in range(rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for name in order:
            with collectives_of(name):
                if name not in built:
                    before = _allocated(settings)
                    model, optimizer = build_variant(name, config, settings)
                    built[name] = make_step(model, optimizer, batch, settings)
                    _reset_peak(settings)
                    timed_steps(built[name], warmup, settings)
                    results[name]["memory"] = _peak(settings) - before
                results[name]["times"] += timed_steps(built[name], steps, settings, results[name]["host"])
    for name in (n for n in variants if n in profiled):
        with collectives_of(name):
            profile_steps(name, built[name], settings, units=config.n_layer + 1)
    return results


def _allocated(settings: Settings) -> int:
    """What is allocated now, once the variants of an earlier table are really gone."""
    gc.collect()
    if settings.device != "cuda":
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def _reset_peak(settings: Settings) -> None:
    if settings.device == "cuda":
        torch.cuda.reset_peak_memory_stats()


def _peak(settings: Settings) -> int:
    return torch.cuda.max_memory_allocated() if settings.device == "cuda" else 0


# Variants of the GPT-2 table profiled for 3 steps after timing: where the host's time goes and how often it
# waits for the device (the profile of the many-GPU path against plain torch's).
PROFILED = ("torch", "fsdp@nccl")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")  # (not ...Async)


def profile_steps(name: str, step: Step, settings: Settings, units: int, steps: int = 3) -> None:
    """Report where the host's time per step goes (host_split.py), and on the GPU its busiest operations and its
    waits for the device inside the steps; the trace goes to --out-dir."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = settings.device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    host = 0.0
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            began = time.perf_counter()
            with record_function(STEP_MARK):
                step()
            host += time.perf_counter() - began
        if cuda:
            torch.cuda.synchronize()
    split = split_host_time(prof.events(), host, steps, STEP_MARK)
    report("host_split", variant=name, units=units, split_us=split, host_ms=host / steps * 1e3)
    if settings.out_dir:
        prof.export_chrome_trace(os.path.join(settings.out_dir, f"speed_{name.replace('@', '_')}.json"))
    if not cuda:
        return
    events = prof.key_averages()
    waits = {key: count / steps for key, count in waits_inside_steps(prof.events(), SYNCS).items()}
    busiest = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    top = ", ".join(f"{e.key} {e.self_cpu_time_total / steps / 1e3:.2f} ms x{e.count // steps}" for e in busiest)
    report("note", text=f"profile {name} per step: host waits {waits or 'none'}; host self time: {top}")
    if name.startswith("fsdp"):  # every parameter is used, so the used flags are known on the host (gradients.py)
        stalls = sum(waits.values())
        check(
            "fsdp, many-GPU path: the host never waits for the GPU inside a step",
            stalls == 0,
            f"{stalls:g} synchronizations or blocking copies per step",
        )


STEP_MARK = "shardtrain_profiled_step"


def waits_inside_steps(events: Any, names: tuple[str, ...]) -> dict[str, int]:
    """How many of the events called `names` began inside a STEP_MARK range. By time, not by name alone: the
    profiler's own synchronizations at its end (torch 2.11 adds one to ours) are no step's."""
    steps = [(e.time_range.start, e.time_range.end) for e in events if e.name == STEP_MARK]
    counts: dict[str, int] = {}
    for event in (e for e in events if e.name in names):
        if any(start <= event.time_range.start <= end for start, end in steps):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


# ------------------------------------------------------------------------------------------------ parts


def part_speed(settings: Settings) -> None:
    if settings.tiny:
        config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
        batch_size, rounds, steps, warmup = 2, 2, 2, 1
    else:
        config = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)
        batch_size, rounds, steps, warmup = settings.speed_batch, 3, 10, 3
    batch = token_batches(config, 1, batch_size)[0]
    params = GPT.count_parameters(config)
    peak, tokens = gpu_peak(), batch_size * config.block_size
    groups = [["torch", "fully_shard", "ddp", "zero2", "fsdp", "fsdp@nccl"], ["torch+compile", "fsdp+compile"]]
    for variants in groups:
        results = run_interleaved(variants, config, batch, settings, rounds, steps, warmup, PROFILED)
        for name in variants:
            median = statistics.median(results[name]["times"])
            mfu = flops_per_step(config, params, tokens) / median / peak if peak else None
            report(
                "speed",
                table="gpt2",
                variant=name,
                step_ms=median * 1e3,
                tokens_per_s=tokens / median,
                mfu=mfu,
                memory_mib=results[name]["memory"] / 2**20,
                steps=len(results[name]["times"]),
                host_ms=statistics.median(results[name]["host"]) * 1e3,
                batch=batch_size,
                fastest_ms=min(results[name]["times"]) * 1e3,
            )
    _report_compilation()


def _report_compilation() -> None:
    """How many graphs dynamo made and where it broke them (a compiled unit that falls back to eager shows here)."""
    from torch._dynamo.utils import counters

    stats = dict(counters["stats"])
    breaks = dict(sorted(counters["graph_break"].items(), key=lambda kv: -kv[1])[:3])
    report("note", text=f"dynamo: {stats}; graph breaks: {breaks or 'none'}")


def part_overhead(settings: Settings) -> None:
    """48 blocks of width 64: GPU work is tiny, so a step's time is mostly the framework's own (hooks, launches,
    collectives). Microseconds per unit over plain torch, beside fully_shard's."""
    layers = 4 if settings.tiny else 48
    config = GPTConfig(vocab_size=256, block_size=64, n_layer=layers, n_head=4, n_embd=64)
    batch = token_batches(config, 1, 2)[0]
    rounds, steps, warmup = (2, 2, 1) if settings.tiny else (3, 20, 5)
    variants = ["torch", "fully_shard", "ddp", "zero2", "fsdp", "ddp@nccl", "zero2@nccl", "fsdp@nccl"]
    variants.append("fsdp-hooked@nccl")  # the engine's backward per parameter (common.py, backward_per_parameter)
    results = run_interleaved(variants, config, batch, settings, rounds, steps, warmup)
    plain = statistics.median(results["torch"]["times"])
    for name in variants:
        median = statistics.median(results[name]["times"])
        report(
            "speed",
            table="overhead",
            variant=name,
            step_ms=median * 1e3,
            units=layers + 1,
            us_per_unit=(median - plain) / (layers + 1) * 1e6,
        )


def part_forecast(settings: Settings) -> None:
    """The plan's step-time forecast of the speed part's run (GPT-2 small shape, batch 8 x 1024, bf16 autocast,
    one rank): on the shipped profile of this GPU, and calibrated here by --measure (rates, one step of the
    model), to print beside the measured steps."""
    from types import SimpleNamespace

    from strategies.plan import plan_memory
    from strategies.plan.hardware import default_hardware
    from strategies.plan.measure import measure_hardware

    if settings.tiny:
        config, batch_size = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32), 2
    else:
        config, batch_size = GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768), 8
    with torch.device("meta"):
        model = GPT(config)
    args = SimpleNamespace(
        world_size=1,
        nodes=1,
        batch_size=batch_size,
        seq_len=config.block_size,
        precision="bf16-mixed",
        save_hardware=None,
    )
    shipped = default_hardware()
    measured = measure_hardware(model, args, shipped)
    for profile in (shipped, measured):
        plan = plan_memory(
            model,
            batch_size=batch_size,
            seq_len=config.block_size,
            precision="bf16-mixed",
            wrap_policy={Block},
            hardware=profile,
        )
        steps = ", ".join(f"{name} {f.step_s * 1e3:.2f} ms (MFU {f.mfu:.1%})" for name, f in plan.forecasts.items())
        report("note", text=f"forecast on {profile.name}: {steps}")
