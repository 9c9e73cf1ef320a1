"""Pipeline parallel at pp 2 on 2 gloo ranks against torch's own pipelining of the same stages and schedule, in one
run: the Llama example (examples/llama.py) cut in two, AdamW, one step = one batch of --microbatches micro-batches.

    python -m benchmarks.pipeline [--schedules 1F1B,GPipe,Interleaved1F1B] [--rounds 3] [--steps 6] [--json FILE]

Each trial is a fresh job of 2 ranks (one thread each). "torch": the stages built by hand as torch's pipelining
docs do (each rank keeps its half of the blocks, the embedding on the first, the norm and head on the last; for the
interleaved schedule two chunks per rank), `torch.distributed.pipelining.PipelineStage`s and the schedule class with
the loss function, `optimizer.step()`. "ours": `DDPStrategy(pipeline_parallel_size=2, pipeline_schedule=...)` set up
through the Strategy API (`setup_module`, `setup_optimizer`), `strategy.pipeline_step(batch)` under
`no_backward_sync`, `synchronize_gradients`, `optimizer.step()`. The step time is the median over the steps after
the first two; the trials of the two alternate, round after round. Run it alone on the machine.
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
from torch import nn

from benchmarks.compare import free_port, machine
from examples.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=512, dim=256, n_layers=8, n_heads=8, n_kv_heads=4, hidden_dim=704, max_seq_len=128)
BATCH, SEQ = 8, 128


class PipelinedLlama(Llama):
    """The Llama example with the loss its last stage gives (what pipeline_parallel_size asks of a module)."""

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def torch_stages(model: Llama, schedule: str, rank: int) -> tuple[list[tuple[nn.Module, int]], int]:
    """This rank's stages of `model` cut by hand, as torch's pipelining docs do, (module, stage index) each, and
    the number of stages."""
    chunks = 2 if schedule == "Interleaved1F1B" else 1
    stages, per_stage = 2 * chunks, CONFIG.n_layers // (2 * chunks)
    out = []
    for index in range(rank, stages, 2):
        part = PipelinedLlama(CONFIG)
        part.load_state_dict(model.state_dict())
        part.layers = nn.ModuleList(part.layers[index * per_stage : (index + 1) * per_stage])
        if index > 0:
            part.tok_embeddings = None
        if index < stages - 1:
            part.norm, part.output = None, None
        out.append((part, index))
    return out, stages


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, device = dist.get_rank(), torch.device("cpu")
    torch.manual_seed(0)
    model = PipelinedLlama(CONFIG)
    generator = torch.Generator().manual_seed(1)
    windows = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), generator=generator)
    x, y = windows[:, :-1], windows[:, 1:]
    if args.impl == "torch":
        from torch.distributed import pipelining
        from torch.distributed.pipelining.schedules import get_schedule_class

        parts, stages = torch_stages(model, args.schedule, rank)
        built = [pipelining.PipelineStage(part, index, stages, device) for part, index in parts]
        cls = get_schedule_class(args.schedule)
        loss_fn = PipelinedLlama.pipeline_loss.__get__(model)
        schedule = cls(built[0] if len(built) == 1 else built, args.microbatches, loss_fn=loss_fn)
        params = [p for part, _ in parts for p in part.parameters()]
        optimizer = torch.optim.AdamW(params, lr=1e-4)

        def step() -> None:
            schedule.step(*((x,) if rank == 0 else ()), target=y if rank == 1 else None)
            optimizer.step()
            optimizer.zero_grad()

    else:
        from examples.llama import Block
        from strategies import DDPStrategy, FSDPStrategy

        options = dict(pipeline_schedule=args.schedule, pipeline_microbatches=args.microbatches)
        options["pipeline_parallel_size"] = args.pipeline
        if args.strategy == "fsdp":
            strategy = FSDPStrategy(auto_wrap_policy={Block}, **options)
        else:
            strategy = DDPStrategy(**options)
        model = strategy.setup_module(model)
        optimizer = strategy.setup_optimizer(torch.optim.AdamW(model.parameters(), lr=1e-4))

        def step() -> None:
            with strategy.no_backward_sync():
                strategy.pipeline_step((x, y))
            strategy.synchronize_gradients()
            optimizer.step()
            optimizer.zero_grad()

    times = []
    for _ in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        step()
        dist.barrier()
        times.append(time.perf_counter() - start)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"times": times}, f)
    dist.destroy_process_group()


def trial(
    impl: str, schedule: str, steps: int, microbatches: int, ranks: int = 2, pipeline: int = 2, strategy: str = "ddp"
) -> float:
    """The median step of one job of `ranks` ranks, after its first two steps. "ours" runs `pipeline` stages, each
    spread over the ranks that remain by `strategy` ("ddp" or "fsdp", each Block a unit); "torch" runs 2 ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        command = [sys.executable, "-m", "benchmarks.pipeline", "--worker", "--impl", impl, "--schedule", schedule]
        command += ["--steps", str(steps), "--microbatches", str(microbatches), "--out", out]
        command += ["--pipeline", str(pipeline), "--strategy", strategy]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        env.update(WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks))
        procs = [
            subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stderr=subprocess.PIPE)
            for r in range(ranks)
        ]
        errors = [p.communicate()[1].decode() for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"{impl} {schedule} failed:\n" + "".join(e[-3000:] for e in errors))
        with open(out) as f:
            return statistics.median(json.load(f)["times"][2:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pipeline", description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", default="1F1B,GPipe,Interleaved1F1B")
    parser.add_argument("--rounds", type=int, default=3, help="trials of each, alternated")
    parser.add_argument("--steps", type=int, default=6, help="steps per trial (the first two not timed)")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--json", metavar="FILE", help="also write the results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--impl", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--pipeline", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return
    print(f"date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")
    print(f"machine: {machine()}")
    print(f"command: python -m benchmarks.pipeline {' '.join(sys.argv[1:])}".rstrip())
    print(
        f"Llama dim {CONFIG.dim}, {CONFIG.n_layers} layers, batch {BATCH} x {SEQ} tokens, "
        f"{args.microbatches} micro-batches, AdamW fp32, pp 2 on 2 gloo ranks"
    )
    results: dict[str, dict[str, list[float]]] = {}
    for schedule in args.schedules.split(","):
        results[schedule] = {"torch": [], "ours": []}
        for _ in range(args.rounds):
            for impl in ("torch", "ours"):
                results[schedule][impl].append(trial(impl, schedule, args.steps, args.microbatches))
    print("\n| schedule | torch's pipelining (s/step) | ours (s/step) | ours / torch |\n|---|---|---|---|")
    for schedule, times in results.items():
        theirs, ours = statistics.median(times["torch"]), statistics.median(times["ours"])
        print(f"| {schedule} | {theirs:.4f} | {ours:.4f} | {ours / theirs:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
