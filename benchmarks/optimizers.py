"""Muon + AdamW on the 31.6M GPT (examples/gpt.py's 30m preset): this project's ddp, zero2 and fsdp against torch's
`fully_shard` with the same two optimizers, in one run on 2 gloo ranks.

    python -m benchmarks.optimizers [--steps 3] [--rounds 2] [--batch 2] [--seq 128] [--json FILE]

Muon's usual split: Muon for the blocks' 2-D weights, AdamW for the rest (embeddings, the tied head, norms, biases).
Our strategies step Muon on whole matrices that each rank owns (strategies/sharding/whole_tensors.py) and AdamW on
pieces; `fully_shard` leaves Muon to DTensor. Each variant is built anew from the same seed in each round (the order
alternating), steps --warmup untimed and --steps timed steps on the same per-rank batches, a step timed on rank 0
between two barriers. Peak resident memory per rank: the kernel's peak counter reset after set-up (VmHWM), read
after the variant's first round. Each rank uses one thread (OMP_NUM_THREADS=1); run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.compare import batches_for_rank, loss_fn, release_and_reset_peak, rss_bytes
from examples.gpt import GPT, GPT_PRESETS, Block

VARIANTS = ("ddp", "zero2", "fsdp", "fully_shard")
MiB = 2**20


def muon_and_adamw(model: torch.nn.Module, lr: float) -> list[torch.optim.Optimizer]:
    """Muon for the blocks' matrices, AdamW for everything else."""
    matrices = [p for name, p in model.named_parameters() if p.ndim == 2 and name.startswith("h.")]
    chosen = {id(p) for p in matrices}
    others = [p for p in model.parameters() if id(p) not in chosen]
    return [torch.optim.Muon(matrices, lr=lr), torch.optim.AdamW(others, lr=lr)]


def build(name: str, args: argparse.Namespace, mesh) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], object]:
    torch.manual_seed(0)
    model = GPT(replace(GPT_PRESETS["30m"], block_size=args.seq))
    if name == "fully_shard":
        from torch.distributed.fsdp import fully_shard

        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, muon_and_adamw(model, args.lr), None
    from strategies import DDPStrategy, FSDPStrategy, ZeroStrategy

    strategy = {
        "ddp": DDPStrategy,
        "zero2": lambda: ZeroStrategy(stage=2),
        "fsdp": lambda: FSDPStrategy(auto_wrap_policy={Block}),
    }[name]()
    model = strategy.setup_module(model)
    return model, [strategy.setup_optimizer(o) for o in muon_and_adamw(model, args.lr)], strategy


def run_variant(name: str, args: argparse.Namespace, batches: list, mesh, measure_memory: bool) -> tuple:
    """Timed steps' seconds, the last loss (mean over ranks) and the peak resident bytes since set-up."""
    model, optimizers, strategy = build(name, args, mesh)
    if measure_memory:
        release_and_reset_peak()
    times = []
    for i, (x, y) in enumerate(batches):
        dist.barrier()
        start = time.perf_counter()
        loss = loss_fn(model(x), y)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
        for optimizer in optimizers:
            optimizer.zero_grad()
        dist.barrier()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
    dist.all_reduce(mean := loss.detach().clone())
    peak = rss_bytes("VmHWM:")
    if strategy is not None:
        strategy.teardown()
    return times, mean.item() / dist.get_world_size(), peak


def rank(index: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index), WORLD_SIZE="2")
    os.environ.update(LOCAL_RANK=str(index), LOCAL_WORLD_SIZE="2")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))  # one for every fully_shard variant, made once (as benchmarks.compare)
    batch_args = argparse.Namespace(warmup=args.warmup, steps=args.steps, batch_size=args.batch)
    config = replace(GPT_PRESETS["30m"], block_size=args.seq)
    batches = batches_for_rank(config, batch_args, index, 2)
    variants = args.variants.split(",")
    times: dict[str, list[float]] = {v: [] for v in variants}
    losses, peaks = {}, {}
    for round_ in range(args.rounds):
        order = variants[round_ % len(variants) :] + variants[: round_ % len(variants)]
        for name in order:
            measured, losses[name], peak = run_variant(name, args, batches, mesh, measure_memory=round_ == 0)
            times[name] += measured
            if round_ == 0:
                peaks[name] = peak
    gathered: list = [None, None]
    dist.all_gather_object(gathered, peaks)
    if index == 0:
        medians = {name: statistics.median(t) for name, t in times.items()}
        base = medians.get("fully_shard")
        print("| variant | median step (s) | x fully_shard | peak RSS rank 0 / 1 (MiB) | last loss |")
        print("|---|---|---|---|---|")
        for name in variants:
            ratio = f"{medians[name] / base:.2f}" if base else "-"
            rss = " / ".join(f"{g[name] / MiB:.0f}" for g in gathered)
            print(f"| {name} | {medians[name]:.3f} | {ratio} | {rss} | {losses[name]:.4f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"medians": medians, "peak_rss": gathered, "losses": losses}, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.optimizers", description=__doc__.split("\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each starting one variant later")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--json", metavar="FILE", help="also write the medians, peaks and losses here")
    args = parser.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    print(
        f"GPT 30m (block size {args.seq}), 2 gloo ranks x 1 thread, batch {args.batch} per rank, Muon + AdamW, fp32; "
        f"{args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed) steps"
    )
    mp.spawn(rank, args=(args, 29500 + os.getpid() % 400), nprocs=2)


if __name__ == "__main__":
    main()
