"""The longest sequence that trains within a fixed memory per rank at context parallel 1, 2 and 4, and the step
time of cp 2 beside one process at the same sequence: the Llama example (examples/llama.py) on gloo ranks.

    python -m benchmarks.context_parallel [--budget-mib 160] [--sizes 1,2,4] [--time-seq 4096] [--json FILE]

Each trial is a fresh job of C ranks (one thread each, MALLOC_MMAP_THRESHOLD_=1 MiB so that freed buffers leave the
resident set): `FSDPStrategy(auto_wrap_policy={Block}, context_parallel_size=C)` set up through the Strategy API,
then one AdamW step on one sequence of L tokens in a plain loop (`strategy.split_sequence`, the step under
`strategy.forward_context()`, backward under `strategy.backward_context()`). Its memory is the largest rise of any
rank's peak resident memory over its resident memory after set-up (/proc/self/clear_refs, VmHWM): the activations,
gradients, optimizer state and the exchanges of one step. The longest sequence: doubling from --start tokens per
rank until a trial goes over --budget-mib, then halving the gap twice. Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.compare import free_port, machine, release_and_reset_peak, rss_bytes
from examples.llama import Block, Llama, LlamaConfig

MiB = 2**20


def config(seq: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=512, dim=128, n_layers=2, n_heads=8, n_kv_heads=4, hidden_dim=352, max_seq_len=max(seq, 8)
    )


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from strategies import FSDPStrategy

    strategy = FSDPStrategy(auto_wrap_policy={Block}, context_parallel_size=args.cp)
    torch.manual_seed(0)
    model = strategy.setup_module(Llama(config(args.seq)))
    optimizer = strategy.setup_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))
    generator = torch.Generator().manual_seed(1)
    windows = torch.randint(0, 512, (1, args.seq + 1), generator=generator)
    release_and_reset_peak()
    settled = rss_bytes("VmRSS:")
    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        x, y = strategy.split_sequence((windows[:, :-1], windows[:, 1:]))
        with strategy.forward_context():
            loss = strategy.weigh_loss(F.cross_entropy(model(x).flatten(0, 1), y.flatten()))
        with strategy.backward_context():
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.barrier()
        times.append(time.perf_counter() - start)
    rise = torch.tensor([float(rss_bytes("VmHWM:") - settled)])
    dist.all_reduce(rise, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"rise": rise.item(), "times": times}, f)
    dist.destroy_process_group()


def trial(cp: int, seq: int, steps: int) -> dict:
    """One job of `cp` ranks training on one sequence of `seq` tokens: the largest rise and the step times."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        command = [sys.executable, "-m", "benchmarks.context_parallel", "--worker", "--cp", str(cp)]
        command += ["--seq", str(seq), "--steps", str(steps), "--out", out]
        env = {
            "MALLOC_MMAP_THRESHOLD_": str(MiB),
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(cp),
            "LOCAL_WORLD_SIZE": str(cp),
        }
        procs = [
            subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE)
            for r in range(cp)
        ]
        errors = [p.communicate()[1].decode() for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"cp {cp}, {seq} tokens failed:\n{errors[0][-3000:]}")
        with open(out) as f:
            return json.load(f)


def longest(cp: int, budget: float, start: int) -> tuple[int, float]:
    """The longest sequence (a multiple of 64 x cp) whose step rises at most `budget` bytes, and its rise."""
    step = 64 * cp
    fits, rise, seq = 0, 0.0, start * cp
    while True:
        measured = trial(cp, seq, 1)["rise"]
        print(f"  cp {cp}: {seq:6d} tokens -> {measured / MiB:6.0f} MiB", flush=True)
        if measured > budget:
            break
        fits, rise, seq = seq, measured, seq * 2
    low, high = fits, seq
    for _ in range(2):
        middle = (low + high) // 2 // step * step
        if middle in (low, high):
            break
        measured = trial(cp, middle, 1)["rise"]
        print(f"  cp {cp}: {middle:6d} tokens -> {measured / MiB:6.0f} MiB", flush=True)
        if measured <= budget:
            low, rise = middle, measured
        else:
            high = middle
    return low, rise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel", description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mib", type=float, default=160, help="the most a step may raise a rank's memory")
    parser.add_argument("--sizes", default="1,2,4", help="context-parallel sizes (ranks) to try")
    parser.add_argument("--start", type=int, default=1024, help="tokens per rank of the first trial")
    parser.add_argument("--time-seq", type=int, default=4096, help="the sequence cp 2 and one process are timed at")
    parser.add_argument("--time-steps", type=int, default=3)
    parser.add_argument("--json", metavar="FILE", help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cp", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seq", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    print(f"date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")
    print(f"machine: {machine()}")
    print(f"command: python -m benchmarks.context_parallel {' '.join(sys.argv[1:])}".rstrip())
    model = "Llama dim 128, 2 layers, 8 heads (4 key/value), vocabulary 512, fsdp, AdamW fp32"
    print(f"{model}; budget {args.budget_mib} MiB")
    budget = args.budget_mib * MiB
    rows = {}
    for cp in (int(c) for c in args.sizes.split(",")):
        rows[cp] = longest(cp, budget, args.start)
    timed = {cp: statistics.median(trial(cp, args.time_seq, args.time_steps)["times"][1:]) for cp in (1, 2)}
    first = rows[min(rows)][0]
    print("\n| context parallel (ranks) | longest sequence within the budget (tokens) | x cp 1 | its rise (MiB) |")
    print("|---|---|---|---|")
    for cp, (seq, rise) in rows.items():
        print(f"| {cp} | {seq} | {seq / first:.2f} | {rise / MiB:.0f} |")
    print(f"\n| {args.time_seq} tokens | median step (s) | x one process |\n|---|---|---|")
    for cp, seconds in timed.items():
        print(f"| {'one process' if cp == 1 else f'cp {cp}'} | {seconds:.3f} | {seconds / timed[1]:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"longest": rows, "timed": timed}, f)


if __name__ == "__main__":
    main()
