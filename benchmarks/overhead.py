"""The framework's own host time on CPU: 48 tiny blocks, where compute is small and hooks, copies and collectives
show. All variants of a table run in one run, interleaved step by step.

    python -m benchmarks.overhead                      # both tables (~2 min on 2 busy cores)
    python -m benchmarks.overhead --part one --rounds 7
    python -m benchmarks.overhead --part two --variants torch-ddp,zero2
    python -m benchmarks.overhead --part one --isolated   # each variant in a process of its own
    python -m benchmarks.overhead --part one --split 4    # and where each variant's host time goes

Model: examples.gpt GPT with 48 Blocks of width 64 (4 heads, 64 tokens, vocabulary 256), batch 2, fp32,
AdamW(foreach=True), one thread per process. A step is model(x), cross-entropy, backward, optimizer.step(),
optimizer.zero_grad(set_to_none=True).

- `--part one`: world size 1 (gloo). "@many" variants run with SHARDTRAIN_ONE_RANK_COLLECTIVES=1: the engine's
  many-rank path (units, hooks, gather and reduce buffers; on gloo one rank's collectives are local copies), as
  torch's `fully_shard` runs its collectives on one rank too. The table gives each variant's median step and its
  extra host time per unit over plain torch ((median - torch's median) / 49 units: 48 Blocks and the root).
  With `--isolated` each variant runs in a process of its own (still step by step in turn): the variants then do not
  share the C allocator's heap, which in one process hides fsdp's page faults (docs/benchmarks.md).
- "fsdp-hooked" is fsdp with the engine's backward per parameter (a hook on each gradient, as before the
  backward ran once per unit; docs/architecture.md, "A unit's backward"), for the two side by side:
  `--variants torch,fsdp@many,fsdp-hooked@many`.
- `--part two`: 2 gloo ranks on this machine, step timed on rank 0 between two barriers: torch's
  DistributedDataParallel and `fully_shard` (per Block, then the root) beside this project's ddp, zero2 and fsdp.

Each round runs --warmup untimed steps of every variant, then --steps cycles of one timed step of every variant in
turn (each round starts one variant later): the steps compared are seconds apart, so the machine's slower moments
fall on every variant alike. Variants are built once, from the same seed. Medians are over all timed steps of all
rounds; "spread" is the range of the per-round medians over the overall median, a measure of the machine's noise
in that run. The fsdp ratios are also given paired by round (each round's extra over that round's torch), with
a 95% interval from resampling the rounds: how far this run's noise leaves the ratio uncertain.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import resource
import shlex
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.gpu.common import backward_per_parameter, one_rank_collectives
from examples.gpt import GPT, Block, GPTConfig
from strategies import FSDPStrategy, get_strategy
from strategies.sharding.collectives import ONE_RANK_COLLECTIVES

CONFIG = GPTConfig(vocab_size=256, block_size=64, n_layer=48, n_head=4, n_embd=64)
UNITS = CONFIG.n_layer + 1
ONE_RANK = ["torch", "fully_shard", "ddp", "zero2", "fsdp", "ddp@many", "zero2@many", "fsdp@many"]
TWO_RANKS = ["torch-ddp", "fully_shard", "ddp", "zero2", "fsdp"]
Step = Callable[[], None]


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1 + rank)
    stream = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.block_size + 1), generator=g)
    return stream[:, :-1].contiguous(), stream[:, 1:].contiguous()


def collectives_of(variant: str):
    """One-rank collectives on for an "@many" variant, off otherwise."""
    return one_rank_collectives(variant.endswith("@many"))


def build(variant: str, rank: int) -> Step:
    torch.manual_seed(0)
    model = GPT(CONFIG)
    name = variant.removesuffix("@many")
    if name == "torch":
        wrapped = model
    elif name == "torch-ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped = DistributedDataParallel(model)
    elif name == "fully_shard":
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block)
        wrapped = fully_shard(model)
    else:
        strategy = FSDPStrategy(auto_wrap_policy={Block}) if name.startswith("fsdp") else get_strategy(name)
        with backward_per_parameter(name == "fsdp-hooked"):
            wrapped = strategy.setup_module(model)
        optimizer = strategy.setup_optimizer(torch.optim.AdamW(wrapped.parameters(), lr=1e-4, foreach=True))
        return make_step(wrapped, optimizer, rank, strategy)
    return make_step(wrapped, torch.optim.AdamW(wrapped.parameters(), lr=1e-4, foreach=True), rank)


def make_step(model: Any, optimizer: torch.optim.Optimizer, rank: int, strategy: Any = None) -> Step:
    """`strategy` is kept alive with the step: the engine's gradient hooks hold it weakly, so a dropped strategy's
    engine goes with the next garbage collection and its model trains on unaveraged gradients."""
    x, y = batch(rank)

    def step() -> None:
        assert strategy is None or strategy.engine is not None
        logits = model(x)
        F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def timed(step: Step, count: int, barrier: bool) -> list[tuple[float, float, int]]:
    """(wall, process CPU) seconds and the process's minor page faults of each step."""
    times = []
    for _ in range(count):
        if barrier:
            dist.barrier()
        start, cpu, faults = time.perf_counter(), time.process_time(), minor_faults()
        step()
        if barrier:
            dist.barrier()
        times.append((time.perf_counter() - start, time.process_time() - cpu, minor_faults() - faults))
    return times


def minor_faults() -> int:
    """Page faults of this process so far: memory that the C allocator handed back to the system and takes again
    (glibc returns the top of its heap once enough of it is free) costs one per page touched."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


Times = dict[str, list[list[tuple[float, float, int]]]]  # by variant, by round: (wall, CPU, faults) of each step


def run_interleaved(variants: list[str], rounds: int, steps: int, warmup: int, rank: int, barrier: bool) -> Times:
    """Every variant in this process, built once (at its first use), run by `in_turn`."""
    built: dict[str, Step] = {}

    def run(name: str, count: int) -> list[tuple[float, float, int]]:
        with collectives_of(name):
            if name not in built:
                built[name] = build(name, rank)
            return timed(built[name], count, barrier)

    return in_turn(variants, rounds, steps, warmup, run)


def in_turn(variants: list[str], rounds: int, steps: int, warmup: int, run: Any) -> Times:
    """Each round: `warmup` steps of every variant, then `steps` cycles of one step of every variant in turn (each
    round starts one variant later), so that the steps compared were taken seconds apart. `run(name, count)` runs
    `count` steps of a variant and returns their timings."""
    times: Times = {name: [] for name in variants}
    for r in range(rounds):
        order = variants[r % len(variants) :] + variants[: r % len(variants)]
        for name in order:
            run(name, warmup)
            times[name].append([])
        for _ in range(steps):
            for name in order:
                times[name][-1] += run(name, 1)
    return times


def summary(rounds: list[list[tuple[float, float, int]]], which: int) -> tuple[float, float]:
    """Of wall (which=0) or CPU (1) time: the median over every timed step, and the spread (the range of the
    per-round medians over that median)."""
    median = statistics.median(t[which] for r in rounds for t in r)
    per_round = [statistics.median(t[which] for t in r) for r in rounds]
    return median, (max(per_round) - min(per_round)) / median


# ------------------------------------------------------------------------------------------------ parts


def init(rank: int, world: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)


def part_one(args: argparse.Namespace) -> None:
    variants = args.variants or ONE_RANK
    if args.isolated:
        times = run_isolated(variants, args.rounds, args.steps, args.warmup)
    else:
        init(0, 1, free_port())
        times = run_interleaved(variants, args.rounds, args.steps, args.warmup, 0, barrier=False)
        if args.split:
            print_split(variants, args.split)
        dist.destroy_process_group()
    where = "each variant in a process of its own" if args.isolated else "every variant in this process"
    print(
        f"\nworld size 1 ({args.rounds} rounds x {args.steps} steps per variant, {where}; extra per unit = "
        f"(median - torch's median) / {UNITS} units; host = the process's CPU time)\n"
    )
    print(
        "| variant | median step (ms) | spread | extra per unit (us) | host per step (ms) | spread | "
        "extra host per unit (us) | page faults per step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    extra: dict[str, list[float]] = {}
    for name, rounds in times.items():
        cells = []
        for which in (0, 1):
            median, spread = summary(rounds, which)
            plain = summary(times["torch"], which)[0] if "torch" in times else float("nan")
            extra.setdefault(name, []).append((median - plain) / UNITS * 1e6)
            cells += [f"{median * 1e3:.2f}", f"{spread:.0%}", f"{extra[name][which]:+.0f}"]
        cells.append(f"{statistics.median(t[2] for r in rounds for t in r):.0f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    for a, b in (("fsdp@many", "zero2@many"), ("fsdp@many", "fully_shard")):
        if a in extra and b in extra:
            paired, low, high = paired_ratio(times, a, b)
            print(
                f"\n{a} / {b}, extra per unit: wall {ratio_of(extra[a][0], extra[b][0]):.2f}, "
                f"host {ratio_of(extra[a][1], extra[b][1]):.2f}; paired by round (wall) {paired:.2f}, "
                f"95% bootstrap interval {low:.2f}-{high:.2f}"
            )


def print_split(variants: list[str], steps: int) -> None:
    """Each variant's host time per step split by what spends it (benchmarks/gpu/host_split.py), from `steps`
    profiled steps of each in turn (three times, averaged), and the extra per unit over plain torch by class."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.gpu.host_split import CLASSES, per_unit_difference, split_host_time

    mark, repeats = "overhead_step", 3
    built = {}
    for name in variants:
        with collectives_of(name):
            built[name] = build(name, 0)
            built[name]()
    splits = {name: dict.fromkeys(CLASSES, 0.0) for name in variants}
    for _ in range(repeats):
        for name in variants:
            with collectives_of(name), profile(activities=[ProfilerActivity.CPU]) as prof:
                host = 0.0
                for _ in range(steps):
                    began = time.perf_counter()
                    with record_function(mark):
                        built[name]()
                    host += time.perf_counter() - began
            for key, value in split_host_time(prof.events(), host, steps, mark).items():
                splits[name][key] += value / repeats
    print(
        f"\nhost time per step by what spends it, under the profiler (which adds to every operator), {steps} "
        f"steps x {repeats}; then the extra per unit over torch (us)\n"
    )
    print("| variant | " + " | ".join(f"{c} (ms)" for c in CLASSES) + " | " + " | ".join(CLASSES) + " |")
    print("|---|" + "---:|" * (2 * len(CLASSES)))
    for name in variants:
        extra = per_unit_difference(splits[name], splits["torch"], UNITS) if "torch" in splits else {}
        cells = [f"{splits[name][c] / 1e3:.2f}" for c in CLASSES]
        cells += [f"{extra.get(c, float('nan')):+.0f}" for c in CLASSES]
        print(f"| {name} | " + " | ".join(cells) + " |")


def extras_by_round(times: Times, name: str) -> list[float]:
    """`name`'s extra wall time per unit over plain torch (us), round by round: each round's against the same
    round's plain torch, whose steps alternate with it, so a slower minute of the machine falls on both sides."""
    return [
        (statistics.median(t[0] for t in mine) - statistics.median(t[0] for t in plain)) / UNITS * 1e6
        for mine, plain in zip(times[name], times["torch"])
    ]


def paired_ratio(times: Times, a: str, b: str, resamples: int = 2000) -> tuple[float, float, float]:
    """The ratio of the median per-round extras of `a` and `b`, and its 95% interval from resampling the rounds
    (how far the machine's noise in this run leaves the ratio uncertain)."""
    if "torch" not in times:
        return (float("nan"),) * 3
    first, second = extras_by_round(times, a), extras_by_round(times, b)
    pick = random.Random(0)
    ratios = []
    for _ in range(resamples):
        rounds = [pick.randrange(len(first)) for _ in first]
        ratios.append(
            ratio_of(statistics.median(first[r] for r in rounds), statistics.median(second[r] for r in rounds))
        )
    ratios.sort()
    ratio = ratio_of(statistics.median(first), statistics.median(second))
    return ratio, ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def ratio_of(extra: float, other: float) -> float:
    """`extra` over `other`; infinite where `other` is no extra at all (a run in which noise hid it)."""
    return extra / other if other > 0 else float("inf")


def run_isolated(variants: list[str], rounds: int, steps: int, warmup: int) -> Times:
    """As run_interleaved, but each variant built and run in a process of its own (its own heap: what the C
    allocator hands back to the system after one variant's step is not what the next variant's step takes), still
    step by step in turn, so that the machine's noise falls on every variant alike."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    pipes, processes = {}, []
    for name in variants:
        parent, child = context.Pipe()
        process = context.Process(target=_isolated_variant, args=(name, child))
        process.start()
        pipes[name], processes = parent, processes + [process]

    def run(name: str, count: int) -> list[tuple[float, float, int]]:
        pipes[name].send(count)
        return pipes[name].recv()

    times = in_turn(variants, rounds, steps, warmup, run)
    for name in variants:
        pipes[name].send("stop")
    for process in processes:
        process.join()
    return times


def _isolated_variant(name: str, pipe: Any) -> None:
    """One variant's process: runs as many steps as it is sent, until "stop"."""
    init(0, 1, free_port())
    with collectives_of(name):
        step = build(name, 0)
        while (count := pipe.recv()) != "stop":
            pipe.send(timed(step, count, barrier=False))
    dist.destroy_process_group()


def _rank_two(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    init(rank, 2, port)
    os.environ[ONE_RANK_COLLECTIVES] = "0"
    times = run_interleaved(args.variants or TWO_RANKS, args.rounds, args.steps, args.warmup, rank, barrier=True)
    if rank == 0:
        queue.put(times)
    dist.barrier()
    dist.destroy_process_group()


def part_two(args: argparse.Namespace) -> None:
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    queue = context.SimpleQueue()
    port = free_port()
    processes = [context.Process(target=_rank_two, args=(rank, args, port, queue)) for rank in range(2)]
    for p in processes:
        p.start()
    times = queue.get()
    for p in processes:
        p.join()
    print(
        f"\n2 gloo ranks ({args.rounds} rounds x {args.steps} steps per variant; rank 0, between barriers; "
        "CPU: rank 0's process, gloo's threads included)\n"
    )
    print("| variant | median step (ms) | spread | vs torch | CPU per step (ms) | vs torch | page faults per step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    counterpart = {"ddp": "torch-ddp", "zero2": "torch-ddp", "fsdp": "fully_shard"}
    for name, rounds in times.items():
        (wall, spread), (cpu, _) = summary(rounds, 0), summary(rounds, 1)
        other = counterpart.get(name)
        if other in times:
            ratios = [
                f"{wall / summary(times[other], 0)[0]:.2f} x {other}",
                f"{cpu / summary(times[other], 1)[0]:.2f} x",
            ]
        else:
            ratios = ["", ""]
        faults = statistics.median(t[2] for r in rounds for t in r)
        print(
            f"| {name} | {wall * 1e3:.2f} | {spread:.0%} | {ratios[0]} | {cpu * 1e3:.2f} | {ratios[1]} | {faults:.0f} |"
        )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["one", "two", "both"], default="both")
    parser.add_argument(
        "--variants",
        type=lambda s: s.split(","),
        default=None,
        help=f"comma-separated; world size 1: {','.join(ONE_RANK)},fsdp-hooked,fsdp-hooked@many; "
        f"2 ranks: {','.join(TWO_RANKS)},fsdp-hooked",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--isolated",
        action="store_true",
        help="world size 1: each variant in a process of its own (its own heap), still in turn",
    )
    parser.add_argument(
        "--split",
        type=int,
        default=0,
        metavar="STEPS",
        help="world size 1: also profile STEPS steps of each variant and split its host time by what spends it",
    )
    args = parser.parse_args()
    if args.split and args.isolated:
        parser.error("--split profiles the variants in this process: leave out --isolated")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = datetime.datetime.now(datetime.timezone.utc)
    print(
        f"{started:%Y-%m-%d %H:%M} UTC; {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs; Python {platform.python_version()}, torch {torch.__version__}"
    )
    print("command: python -m benchmarks.overhead " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    if args.part in ("one", "both"):
        part_one(args)
    if args.part in ("two", "both"):
        part_two(args)
    print(f"\n({(datetime.datetime.now(datetime.timezone.utc) - started).total_seconds():.0f} s)")


if __name__ == "__main__":
    main()
