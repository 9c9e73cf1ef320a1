"""fsdp x tensor parallel against torch's own composition of the same plan: `fully_shard` (FSDP2) over the
`parallelize_module`d model, at dp 2 x tp 2 gloo ranks on the Llama example (examples/llama.py's plan), AdamW in
fp32. The two run in the same processes, alternated round by round; the table gives each one's median step and
the ratio.

    python -m benchmarks.tensor_parallel [--steps 7] [--rounds 3] [--dim 256] [--layers 4] [--ranks 4]
                                         [--only ours] [--json FILE]

Each rank uses one thread (OMP_NUM_THREADS=1); run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from examples.llama import Llama, LlamaConfig, tensor_parallel
from strategies import FSDPStrategy

TENSOR_PARALLEL = 2
VARIANTS = ("ours", "torch")


def config(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=1024,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=8,
        n_kv_heads=4,
        hidden_dim=args.dim * 8 // 3 // 8 * 8,
        max_seq_len=args.seq,
    )


def ours(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    strategy = FSDPStrategy(auto_wrap_policy={type(Llama(config(args)).layers[0])}, tensor_parallel_size=2)
    torch.manual_seed(0)
    model = tensor_parallel(Llama(config(args)), strategy.device_mesh["tensor_parallel"])
    model = strategy.setup_module(model)
    return model, strategy.setup_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))


def torchs(args: argparse.Namespace) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (args.ranks // TENSOR_PARALLEL, TENSOR_PARALLEL), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = tensor_parallel(Llama(config(args)), mesh["tp"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step_times(build, args: argparse.Namespace) -> tuple[list[float], float]:
    """The timed steps' seconds, and the last step's loss."""
    model, optimizer = build(args)
    generator = torch.Generator().manual_seed(dist.get_rank() // TENSOR_PARALLEL)  # one batch per data rank
    times = []
    for step in range(args.steps + 2):  # two to warm up
        tokens = torch.randint(0, 1024, (args.batch, args.seq + 1), generator=generator)
        dist.barrier()
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step >= 2:
            times.append(time.perf_counter() - start)
    return times, loss.item()


def rank(index: int, args: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(index), WORLD_SIZE=str(args.ranks))
    os.environ.update(LOCAL_RANK=str(index), LOCAL_WORLD_SIZE=str(args.ranks))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    every = {"fsdp x tp (ours)": ours, "fully_shard x tp (torch)": torchs}
    variants = {name: build for name, build in every.items() if args.only is None or args.only in name}
    measured: dict[str, list[float]] = {name: [] for name in variants}
    losses: dict[str, float] = {}
    for round_ in range(args.rounds):
        order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
        for name in order:
            times, losses[name] = step_times(variants[name], args)
            measured[name] += times
    if index == 0:
        medians = {name: statistics.median(times) for name, times in measured.items()}
        base = medians.get("fully_shard x tp (torch)")
        print("| variant | median step (s) | x torch | last loss (rank 0) |\n|---|---|---|---|")
        for name, median in medians.items():
            ratio = f"{median / base:.2f}" if base else "-"
            print(f"| {name} | {median:.4f} | {ratio} | {losses[name]:.6f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(medians, f)
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tensor_parallel", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=7, help="timed steps per variant and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, the variants' order alternating")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="per data-parallel rank")
    parser.add_argument("--ranks", type=int, default=4, help="gloo ranks: dp ranks / 2 x tp 2 (default 4)")
    parser.add_argument("--only", choices=VARIANTS, help="time one variant only")
    parser.add_argument("--json", metavar="FILE", help="write each variant's median step (s) here")
    args = parser.parse_args(argv)
    print(
        f"dp {args.ranks // TENSOR_PARALLEL} x tp {TENSOR_PARALLEL} gloo ranks, Llama dim {args.dim}, "
        f"{args.layers} layers, seq {args.seq}, batch {args.batch} per data rank, AdamW fp32"
    )
    mp.spawn(rank, args=(args, 29700 + os.getpid() % 200), nprocs=args.ranks)


if __name__ == "__main__":
    main()
