"""--measure: a hardware profile of the machine this runs on, for the step-time forecast.

1. Rates, with the threads one rank of this machine gets (its cores shared by the ranks of a node): a large fp32 and
   bf16 matmul, a memory-bound add, the cost of a tiny op, fused attention against the matmul rate.
2. One training step of the model itself on this device (plain torch, AdamW), when it fits in memory: the forecast
   of that same step at world size 1 is scaled to it, so what the micro-benchmarks miss (this model's op mix,
   cache effects) is calibrated away.
3. A sweep of the engine's own collectives (all-gather, reduce-scatter, all-reduce; 4 KiB to 16 MiB) over real
   ranks of this machine; latency and bandwidth fitted by least squares to the ring model of link.py.
Only the machine's own links can be measured: the inter-node link is taken to be the same.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from ..pipeline_parallel import stages_per_rank
from .activations import AUTOCAST
from .hardware import Hardware, Link, default_hardware
from .pipeline import check_microbatches
from .pipeline_forecast import PipelineShape

SWEEP_BYTES = [2**k for k in range(12, 25, 2)]  # 4 KiB .. 16 MiB


def _median_seconds(fn: Callable[[], Any], repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_rates(device: torch.device) -> dict[str, float]:
    """Matmul FLOP/s by dtype, memory bytes/s, seconds per tiny op, attention's share of the matmul rate."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    n = 2048 if device.type == "cuda" else 768
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a = torch.randn(n, n, device=device, dtype=dtype)
        rates[str(dtype).removeprefix("torch.")] = 2 * n**3 / _median_seconds(lambda a=a: (a @ a, sync()))
    x, y = torch.randn(2, 2**22, device=device).unbind()  # 16 MiB each: past the caches
    memory = 3 * x.nbytes / _median_seconds(lambda: (x.add_(y), sync()))
    tiny = torch.ones(1, device=device)
    overhead = _median_seconds(lambda: [tiny.add(1) for _ in range(100)] and sync()) / 100
    q = torch.randn(1, 8, 512, 64, device=device)
    attention = 4 * 8 * 512 * 512 * 64 / _median_seconds(lambda: (F.scaled_dot_product_attention(q, q, q), sync()))
    return {**rates, "memory": memory, "overhead": overhead, "attention_fraction": attention / rates["float32"]}


def _sweep_worker(rank: int, world: int, port: int, threads: int, results: Any) -> None:
    from ..sharding.collectives import CommStats, all_gather, all_reduce_sum, reduce_scatter_sum, wait

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    stats, found = CommStats(), []
    for nbytes in SWEEP_BYTES:
        full = torch.zeros(nbytes // 4)
        shard = torch.zeros(full.numel() // world)
        runs = {
            "all_gather": lambda f=full, s=shard: wait(all_gather(f, s, None, stats, async_op=True)),
            "reduce_scatter": lambda f=full, s=shard: wait(reduce_scatter_sum(s, f, None, stats, async_op=True)),
            "all_reduce": lambda f=full: wait(all_reduce_sum(f, None, stats, async_op=True)),
        }
        for kind, run in runs.items():
            dist.barrier()
            found.append((kind, nbytes, _median_seconds(run)))
    if rank == 0:
        results.put(found)
    dist.barrier()
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sweep_collectives(ranks: int, threads: int) -> list[tuple[str, int, float]]:
    """(kind, bytes, seconds) of the engine's collectives over `ranks` gloo ranks of this machine."""
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(_sweep_worker, args=(ranks, _free_port(), threads, results), nprocs=ranks, start_method="spawn")
    return results.get()


def fit_link(samples: list[tuple[str, int, float]], ranks: int) -> Link:
    """Least-squares latency per ring step and bandwidth from the sweep, in link.py's model."""
    rows = []
    for kind, nbytes, seconds in samples:
        factor = 2 if kind == "all_reduce" else 1  # a ring all-reduce is two passes
        rows.append((factor * (ranks - 1), factor * (ranks - 1) / ranks * nbytes, seconds))
    a = torch.tensor([[steps, moved] for steps, moved, _ in rows], dtype=torch.float64)
    b = torch.tensor([seconds for *_, seconds in rows], dtype=torch.float64)
    latency, seconds_per_byte = torch.linalg.lstsq(a, b[:, None]).solution.flatten().tolist()
    return Link(bandwidth=1 / max(seconds_per_byte, 1e-15), latency=max(latency, 0.0))


def _one_step_seconds(
    model: nn.Module,
    batch_size: int,
    seq_len: int | None,
    device: torch.device,
    precision: str = "32",
    materialize: bool = True,
    optimizer: bool = True,
) -> float | None:
    """A real AdamW step of the model (tokens in, next-token loss, under the precision's autocast) on this device
    (`materialize`: the model is a meta copy, made real first; without `optimizer`, forward and backward only);
    None where it is no token model or does not fit."""
    embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None or seq_len is None:
        return None
    try:
        if materialize:
            model = model.to_empty(device=device)
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.02)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = torch.randint(embedding.num_embeddings, (batch_size, seq_len), device=device)

        autocast = AUTOCAST.get(precision)

        def step() -> None:
            with torch.autocast(device.type, dtype=autocast) if autocast else nullcontext():
                logits = model(tokens)
            F.cross_entropy(logits.flatten(0, -2).float(), tokens.flatten()).backward()
            if optimizer:
                opt.step()
            opt.zero_grad()

        def steps(count: int = 3) -> None:  # queued back to back, as a training loop runs: one wait at the end
            for _ in range(count):
                step()
            if device.type == "cuda":
                torch.cuda.synchronize()

        return _median_seconds(steps, repeat=3) / 3
    except (RuntimeError, MemoryError):
        return None


def measure_hardware(model: nn.Module, args: Any, base: Hardware | None = None) -> Hardware:
    """The profile of this machine for the plan's arguments (`args` of python -m strategies.plan); prints it."""
    base = base or default_hardware()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    local = max(1, args.world_size // args.nodes)
    threads = max(1, (os.cpu_count() or 1) // local) if device.type == "cpu" else torch.get_num_threads()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rates = measure_rates(device)
        print(
            f"measured on {device.type} with {threads} thread(s) per rank: matmul fp32 "
            f"{rates['float32'] / 1e9:,.1f} GFLOP/s, bf16 {rates['bfloat16'] / 1e9:,.1f} GFLOP/s, memory "
            f"{rates['memory'] / 1e9:,.2f} GB/s, {rates['overhead'] * 1e6:,.1f} us per op, attention at "
            f"{rates['attention_fraction']:.2f} of the matmul rate",
            flush=True,
        )
        profile = replace(
            base,
            name=f"{device.type} (measured)",
            matmul_flops={"float32": rates["float32"], "bfloat16": rates["bfloat16"], "float16": rates["bfloat16"]},
            peak_flops=base.peak_flops
            if device.type == "cuda"
            else {"float32": rates["float32"], "bfloat16": rates["bfloat16"], "float16": rates["bfloat16"]},
            memory_bandwidth=rates["memory"],
            op_overhead=rates["overhead"],
            attention_fraction=min(1.0, rates["attention_fraction"]),
            sources=["measured by python -m strategies.plan --measure on this machine"],
            comm_overlaps_compute=device.type == "cuda",
        )
        profile = _calibrated(profile, model, args, device)
    finally:
        torch.set_num_threads(previous)
    if local > 1 and device.type == "cpu":
        link = fit_link(sweep_collectives(local, threads), local)
        print(
            f"collectives over {local} gloo ranks: {link.bandwidth / 1e9:,.2f} GB/s bus bandwidth, "
            f"{link.latency * 1e6:,.0f} us per ring step",
            flush=True,
        )
        profile = replace(profile, intra_node=link, inter_node=link)
    tensor_parallel = getattr(args, "tensor_parallel", 1)
    if tensor_parallel > 1 and device.type == "cpu":
        profile = _tensor_parallel_calibrated(profile, model, args, tensor_parallel, local, threads)
    profile = _shared_cores(profile, local, threads, device, pipeline=_pipeline_shape(args))
    if args.save_hardware:
        import json

        with open(args.save_hardware, "w") as f:
            json.dump(profile.to_json(), f, indent=1)
    return profile


def _tensor_parallel_worker(
    rank: int, world: int, size: int, port: int, threads: int, model: nn.Module, plan: Any, shape: tuple, results: Any
) -> None:
    """One of `world` ranks, in groups of `size` each training its own copy of `model` split by torch's tensor
    parallel (`plan`), all at once as the planned run shares the cores: rank 0 puts the median seconds of a step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world // size, size), mesh_dim_names=("data_parallel", "tensor_parallel"))
    torch.manual_seed(0)
    model = model.to_empty(device="cpu")
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    model = parallelize_module(model, mesh["tensor_parallel"], plan(model) if callable(plan) else plan)
    # forward and backward: the engine steps its optimizer on plain local tensors, not on these DTensors
    seconds = _one_step_seconds(model, *shape, torch.device("cpu"), materialize=False, optimizer=False)
    if rank == 0:
        results.put(seconds)
    dist.barrier()
    dist.destroy_process_group()


def _tensor_parallel_calibrated(
    profile: Hardware, model: nn.Module, args: Any, size: int, ranks: int, threads: int
) -> Hardware:
    """Time a step of `size` tensor-parallel ranks here, `ranks` of them at once (as many as the planned run puts
    on this machine), and set the profile's tensor_parallel_slowdown so that the forecast of that step (compute at
    the share of the cores each rank gets) equals it."""
    from .planner import meta_copy, plan_memory

    plan = args.tensor_parallel_plan
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    shape = (args.batch_size, args.seq_len)
    mp.start_processes(
        _tensor_parallel_worker,
        args=(ranks, size, _free_port(), threads, meta_copy(model), plan, shape, results),
        nprocs=ranks,
        start_method="spawn",
    )
    measured = results.get()
    if measured is None:
        print(f"one step at tensor parallel {size}: not measured (not a token model); the link model only")
        return profile
    ranks_share = _shared_cores(profile, ranks, threads, torch.device("cpu"), quiet=True)
    forecast = plan_memory(
        model,
        world_size=size,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        precision=getattr(args, "precision", "32"),
        hardware=ranks_share,
        tensor_parallel=size,
        tensor_parallel_plan=plan,
    ).forecasts["ddp"]
    # one data-parallel rank: every collective is tensor parallel's, on the compute clock
    slowdown = max(0.1, (measured - forecast.compute_s) / forecast.comm_s) if forecast.comm_s else 1.0
    print(
        f"forward and backward at tensor parallel {size} ({ranks} ranks at once): measured {measured * 1e3:,.1f} "
        f"ms, forecast {(forecast.compute_s + forecast.comm_s) * 1e3:,.1f} ms of which collectives "
        f"{forecast.comm_s * 1e3:,.1f} ms: "
        f"tensor-parallel collectives take {slowdown:.2f} x the link model's",
        flush=True,
    )
    return replace(profile, tensor_parallel_slowdown=slowdown)


def _pipeline_shape(args: Any) -> PipelineShape | None:
    """The pipeline the plan's arguments run (`args.pipeline_parallel` > 1), else None. Under it a rank computes
    its micro-batches in its schedule's slots (pipeline_forecast.py), waiting for the other stages the rest of the
    time, and each of its computations is one micro-batch's."""
    size = getattr(args, "pipeline_parallel", 1) or 1
    if size == 1:
        return None
    schedule = getattr(args, "pipeline_schedule", "1F1B")
    microbatches = check_microbatches(schedule, size, getattr(args, "pipeline_microbatches", None), args.batch_size)
    return PipelineShape(schedule, size, microbatches)


def pipeline_core_share(shape: PipelineShape, threads: int, cores: int) -> float:
    """The rate a pipeline's ranks compute at, over the step, where `threads` (all ranks') share `cores`. Its
    schedule runs V x M + P - 1 slots of one stage's micro-batch on P ranks (V stages each): in slot k, the stages
    holding a micro-batch, min(k + 1, P, slots - k), compute at once and their threads share the cores; the others
    wait (gloo's receives do not spin)."""
    chunks = stages_per_rank(shape.schedule, None, shape.size)
    slots = chunks * shape.microbatches + shape.size - 1
    per_stage = threads / shape.size
    stretched = sum(max(1.0, min(k + 1, shape.size, slots - k) * per_stage / cores) for k in range(slots))
    return slots / stretched


def _shared_cores(
    profile: Hardware,
    ranks: int,
    threads: int,
    device: torch.device,
    quiet: bool = False,
    pipeline: PipelineShape | None = None,
) -> Hardware:
    """On CPU, more ranks' threads than cores share the cores: each rank computes at its share of the rates
    measured alone. Under a pipeline fewer ranks compute at once (pipeline_core_share)."""
    cores = os.cpu_count() or 1
    if pipeline is None:
        share = min(1.0, cores / (ranks * threads))
    else:
        share = pipeline_core_share(pipeline, ranks * threads, cores)
    if device.type != "cpu" or share == 1.0:
        return profile
    if not quiet:
        waiting = " (a pipeline's, some waiting)" if pipeline is not None else ""
        print(
            f"{ranks} ranks of {threads} thread(s){waiting} share {cores} cores: each computes at {share:.2f} of "
            "these rates"
        )
    return replace(
        profile,
        matmul_flops={k: v * share for k, v in profile.matmul_flops.items()},
        peak_flops={k: v * share for k, v in profile.peak_flops.items()},
        memory_bandwidth=profile.memory_bandwidth * share,
        op_overhead=profile.op_overhead / share,
    )


def _calibrated(profile: Hardware, model: nn.Module, args: Any, device: torch.device) -> Hardware:
    """Scale every rate so that the forecast of one step at world size 1 equals a measured step of the model (of
    one micro-batch, under a pipeline)."""
    from .planner import meta_copy, plan_memory

    precision = getattr(args, "precision", "32")
    pipeline = _pipeline_shape(args)
    batch_size = args.batch_size // pipeline.microbatches if pipeline is not None else args.batch_size
    measured = _one_step_seconds(meta_copy(model), batch_size, args.seq_len, device, precision)
    if measured is None:
        print("one step of the model: not measured (not a token model, or it does not fit); micro-benchmarks only")
        return profile
    forecast = (
        plan_memory(
            model, world_size=1, batch_size=batch_size, seq_len=args.seq_len, precision=precision, hardware=profile
        )
        .forecasts["ddp"]
        .step_s
    )
    scale = measured / forecast
    print(
        f"one step of the model: measured {measured * 1e3:,.1f} ms, micro-benchmarks forecast "
        f"{forecast * 1e3:,.1f} ms: every rate scaled by {1 / scale:.2f}",
        flush=True,
    )
    return replace(
        profile,
        matmul_flops={k: v / scale for k, v in profile.matmul_flops.items()},
        memory_bandwidth=profile.memory_bandwidth / scale,
        op_overhead=profile.op_overhead * scale,
    )
