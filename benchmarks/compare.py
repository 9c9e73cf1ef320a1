"""Step time and peak memory of this project's strategies next to torch's own, on the same GPT, in one run.

    python -m benchmarks.compare                                  # 30m and 100m presets, every variant
    python -m benchmarks.compare --preset 30m --rounds 3
    python -m benchmarks.compare --variants torch-ddp,ddp,floor --memory inline

For each preset two ranks (gloo, one thread each: OMP_NUM_THREADS=1 and torch.set_num_threads(1)) are started
once and train every variant in turn, round after round (each round starts one variant later), so machine drift
touches all alike:

  torch-ddp    torch.nn.parallel.DistributedDataParallel (defaults)
  torch-zero   torch.distributed.optim.ZeroRedundancyOptimizer(AdamW) over DDP (defaults)
  torch-fsdp   torch.distributed.fsdp.fully_shard on every Block, then on the root
  ddp, zero1, zero2, fsdp   this project's strategies, set up with strategy.setup_module / setup_optimizer and
               driven by the same plain torch step as the torch variants (model(x), loss.backward(),
               opt.step(), opt.zero_grad()); fsdp is FSDPStrategy(auto_wrap_policy={Block})
  floor        the compute floor: each rank trains a plain model with plain AdamW on the same per-rank batch,
               with no communication (both ranks at once, so they share the machine as the others do)
  floor-solo   (not run by default) rank 0 alone does the floor's work while rank 1 waits
  fsdp-hooked  (not run by default) fsdp with the engine's backward per parameter (a hook on each gradient, as
               before it ran once per unit; docs/architecture.md, "A unit's backward")
  <strategy>+timed, <strategy>+checked   (not run by default; ddp, zero1, zero2, fsdp, hsdp) the strategy with the
               Trainer's step timer watching every collective (as in every Trainer fit), or with the timer and
               detect_divergence's check: "vs torch" then compares with the same strategy unwatched
  hsdp, torch-hsdp   (not run by default; for --ranks 4) hybrid sharding in groups of 2 ranks: this project's
               FSDPStrategy(auto_wrap_policy={Block}, hybrid_shard=2), and fully_shard per Block + root on a 2-D
               (replicate, shard) device mesh, torch's HSDP

Every round builds each variant anew from the same seed and runs --warmup untimed and --steps timed AdamW steps
on the same per-rank batches of stdlib source text. A step is timed on rank 0 between two barriers; the table shows
the median and the fastest over all timed steps of all rounds, the ratios of the medians, and rank 0's process
CPU time per step (its compute thread and gloo's threads: on a busy machine wall time swells, CPU time much
less). The final loss (mean over ranks, last step) of every variant that averages gradients must agree with
torch-ddp's to about 1e-4.

Peak resident memory per rank (--memory): after a variant is set up, each rank resets the kernel's peak counter
(/proc/self/clear_refs "5") and reads VmHWM after the variant's steps, so the peak counts the whole process
(torch, gloo, the batches: the "process" line) and excludes set-up. With "fresh" (default), after the timing
rounds each variant runs once more in its own new pair of processes (1 warm-up and 1 step) with glibc's mmap
threshold fixed at 1 MiB (MALLOC_MMAP_THRESHOLD_, as benchmarks/memory.py) so freed buffers leave the resident
set; timings never run with it (it costs page faults on every new buffer: +10% on most variants, +35% on fsdp).
With "inline" the peak comes from round 1 of the timing processes after gc and malloc_trim: no extra time, but
with glibc's default threshold and what earlier variants left in the heap it reads a few hundred MiB high.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks.gpu.common import backward_per_parameter
from examples.gpt import GPT, GPT_PRESETS, Block, GPTConfig, TextWindows, load_corpus
from strategies import observe

MiB = 2**20
VARIANTS = ("torch-ddp", "torch-zero", "torch-fsdp", "ddp", "zero1", "zero2", "fsdp", "floor")
COMPILED_VARIANTS = ("floor+compile", "ddp+compile", "fsdp+compile", "torch-fsdp+compile")
EXTRA_VARIANTS = ("floor-solo", "hsdp", "torch-hsdp", "fsdp-hooked", *COMPILED_VARIANTS)
HSDP_GROUP = 2  # ranks that shard among themselves in the hsdp variants
# what watches the engine's collectives (trainer/observe/timing.py, trainer/observe/divergence.py)
WATCHED = ("+timed", "+checked")
WATCHABLE = ("ddp", "zero1", "zero2", "fsdp", "hsdp")
COUNTERPART = {
    "ddp": "torch-ddp",
    "zero1": "torch-zero",
    "zero2": "torch-ddp",
    "fsdp": "torch-fsdp",
    "fsdp-hooked": "torch-fsdp",
    "hsdp": "torch-hsdp",
    "fsdp+compile": "torch-fsdp+compile",
}
AVERAGING = (
    "torch-ddp",
    "torch-zero",
    "torch-fsdp",
    "torch-hsdp",
    "ddp",
    "zero1",
    "zero2",
    "fsdp",
    "fsdp-hooked",
    "hsdp",
    "ddp+compile",
    "fsdp+compile",
    "torch-fsdp+compile",
)


def theory_bytes(variant: str, params: int, world: int) -> float:
    """Per-rank model-state bytes (fp32 Adam) of the table in docs/architecture.md; torch's variants as their
    counterparts."""
    p, n = params, world
    for suffix in ("+compile", *WATCHED):
        variant = variant.removesuffix(suffix)
    kinds = {"torch-ddp": "ddp", "torch-zero": "zero1", "torch-fsdp": "fsdp", "torch-hsdp": "hsdp"}
    kind = kinds.get(variant, "fsdp" if variant == "fsdp-hooked" else variant)
    return {
        "ddp": 16 * p,
        "zero1": 8 * p + 8 * p / n,
        "zero2": 4 * p + 12 * p / n,
        "fsdp": 16 * p / n,
        "hsdp": 16 * p / HSDP_GROUP,
        "floor": 16 * p,
        "floor-solo": 16 * p,
    }[kind]


# ---------------------------------------------------------------------------------------------- memory


def rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024


def release_and_reset_peak() -> None:
    """Hand freed heap memory back to the kernel, then restart the peak-RSS counter (VmHWM) from now."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


# ---------------------------------------------------------------------------------------------- variants


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def watchers(name: str) -> list:
    """The watchers of a "+timed" or "+checked" variant, installed around its steps."""
    from trainer.observe.divergence import DivergenceCheck
    from trainer.observe.timing import StepTimer

    if name.endswith("+timed"):
        return [StepTimer()]
    if name.endswith("+checked"):
        return [StepTimer(), DivergenceCheck.connect(datetime.timedelta(minutes=5))]
    return []


def build(name: str, config: GPTConfig, lr: float, mesh):
    """A fresh model of the variant (same seed everywhere): step(x, y) -> loss, the engine if any, and close().
    A "+compile" variant compiles each Block (torch.compile, inductor) as torchtitan does."""
    rank = dist.get_rank()
    model = GPT(config)
    for suffix in WATCHED:
        name = name.removesuffix(suffix)
    name, compiled = name.removesuffix("+compile"), name.endswith("+compile")
    if compiled and name in ("floor", "torch-fsdp"):
        for i, block in enumerate(model.h):  # torchtitan: compile each block, then (torch-fsdp) shard it
            model.h[i] = torch.compile(block)
    if name in ("floor", "floor-solo"):
        if name == "floor-solo" and rank != 0:
            return (lambda x, y: None), None, None
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        return _plain_step(model, opt), None, None
    if name in ("torch-ddp", "torch-zero"):
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        if name == "torch-ddp":
            opt = torch.optim.AdamW(ddp.parameters(), lr=lr)
        else:
            opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=lr)
        return _plain_step(ddp, opt), None, None
    if name in ("torch-fsdp", "torch-hsdp"):
        from torch.distributed.fsdp import fully_shard

        mesh = mesh[name]
        for block in model.h:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return _plain_step(model, torch.optim.AdamW(model.parameters(), lr=lr)), None, None

    from strategies import DDPStrategy, FSDPStrategy, ZeroStrategy

    compile_ = {Block} if compiled else None
    strategy = {
        "ddp": lambda: DDPStrategy(compile=compile_),
        "zero1": lambda: ZeroStrategy(stage=1, compile=compile_),
        "zero2": lambda: ZeroStrategy(stage=2, compile=compile_),
        "fsdp": lambda: FSDPStrategy(auto_wrap_policy={Block}, compile=compile_),
        "fsdp-hooked": lambda: FSDPStrategy(auto_wrap_policy={Block}),
        "hsdp": lambda: FSDPStrategy(auto_wrap_policy={Block}, hybrid_shard=HSDP_GROUP),
    }[name]()
    with backward_per_parameter(name == "fsdp-hooked"):
        model = strategy.setup_module(model)
    opt = strategy.setup_optimizer(torch.optim.AdamW(model.parameters(), lr=lr))
    return _plain_step(model, opt), strategy.engine, strategy.teardown


def _plain_step(wrapped, opt):
    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(wrapped(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def run_variant(name: str, config: GPTConfig, batches: list, args, mesh, measure_memory: bool) -> dict:
    gc.collect()
    torch.manual_seed(args.seed)
    step, engine, close = build(name, config, args.lr, mesh)
    if measure_memory:
        release_and_reset_peak()
    setup_rss = rss_bytes("VmRSS:")
    with observe.watched_by(*watchers(name)):
        times, cpu, loss, first = timed_steps(step, engine, batches, args)
    out = {"times": times, "cpu": cpu, "first": first, "loss": None if loss is None else loss.item()}
    if measure_memory:
        out.update(peak_rss=rss_bytes("VmHWM:"), setup_rss=setup_rss)
    if engine is not None and hasattr(engine, "stats") and args.steps:
        stats = engine.stats
        out["comm"] = {k: [stats.calls[k] / args.steps, stats.elements[k] / args.steps] for k in stats.calls}
    if close is not None:
        close()
    del step, engine, close
    gc.collect()
    return out


def timed_steps(step, engine, batches: list, args) -> tuple[list[float], list[float], torch.Tensor, float]:
    """Each step between two barriers: wall and CPU times of the timed ones, the last loss, the first step's time."""
    times, cpu, loss, first = [], [], None, None
    for i, (x, y) in enumerate(batches):
        if i == args.warmup and engine is not None and hasattr(engine, "stats"):
            engine.stats.reset()
        dist.barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = step(x, y)
        dist.barrier()
        if i == 0:
            first = time.perf_counter() - start  # with compilation, for the compiled variants
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
    return times, cpu, loss, first


def batches_for_rank(config: GPTConfig, args, rank: int, world: int) -> list:
    """Step s of rank r reads windows (s * world + r) * B ... + B of the stdlib text: a global batch per step."""
    train, _ = load_corpus(max_bytes=400_000)
    windows = TextWindows(train, config.block_size)
    batches = []
    for s in range(args.warmup + args.steps):
        first = ((s * world + rank) * args.batch_size) % (len(windows) - args.batch_size)
        pairs = [windows[first + i] for i in range(args.batch_size)]
        batches.append((torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])))
    return batches


def worker(args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    variants = args.variants.split(",")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = {}
    if any(v.startswith("torch-fsdp") for v in variants):
        mesh["torch-fsdp"] = init_device_mesh("cpu", (world,))
    if "torch-hsdp" in variants:  # fully_shard on a 2-D mesh: replicate across groups, shard within
        mesh["torch-hsdp"] = init_device_mesh(
            "cpu", (world // HSDP_GROUP, HSDP_GROUP), mesh_dim_names=("replicate", "shard")
        )
    config = model_config(args)
    batches = batches_for_rank(config, args, rank, world)
    process_rss = rss_bytes("VmRSS:")
    results = {v: {"times": [], "cpu": []} for v in variants}
    for r in range(args.rounds):
        for name in variants[r % len(variants) :] + variants[: r % len(variants)]:
            out = run_variant(name, config, batches, args, mesh, measure_memory=r == 0)
            results[name]["times"] += out.pop("times")
            results[name]["cpu"] += out.pop("cpu")
            if r == 0:
                results[name].update(out)
            if rank == 0 and not args.quiet:
                so_far = median(results[name]["times"])
                print(
                    f"  [{args.preset} round {r + 1}/{args.rounds}] {name:10} median so far {so_far:.3f} s", flush=True
                )
    per_rank = {v: {k: results[v].get(k) for k in ("peak_rss", "setup_rss", "loss")} for v in variants}
    gathered = [None] * world
    dist.all_gather_object(gathered, {"process_rss": process_rss, "variants": per_rank})
    if rank == 0:
        summary = {
            "params": GPT.count_parameters(config),
            "world": world,
            "process_rss": [g["process_rss"] for g in gathered],
            "variants": {},
        }
        for v in variants:
            losses = [g["variants"][v]["loss"] for g in gathered if g["variants"][v]["loss"] is not None]
            summary["variants"][v] = {
                "times": results[v]["times"],
                "cpu": results[v]["cpu"],
                "first": results[v].get("first"),
                "loss": sum(losses) / len(losses) if losses else None,
                "peak_rss": [g["variants"][v]["peak_rss"] for g in gathered],
                "setup_rss": [g["variants"][v]["setup_rss"] for g in gathered],
                "comm": results[v].get("comm"),
            }
        with open(args.out, "w") as f:
            json.dump(summary, f)
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------- driver


def model_config(args) -> GPTConfig:
    return replace(GPT_PRESETS[args.preset], block_size=args.block_size)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_preset(args, preset: str, variants: list[str]) -> dict:
    """Every round of one preset in one pair of processes, then (--memory fresh) each variant's peak memory in its
    own new pair; returns rank 0's summary (per variant: step times, CPU times, peak RSS, final loss)."""
    summary = launch(args, preset, variants, args.rounds, args.warmup, args.steps, quiet=False)
    if args.memory == "fresh":
        # glibc raises its mmap threshold as large blocks are freed, after which freed multi-MiB buffers stay in
        # the heap and count in the peak; a fixed threshold returns them (as benchmarks/memory.py does). Only
        # here: it costs every variant page faults on each new buffer, so timings are taken without it.
        env = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
        for v in variants:
            row = launch(args, preset, [v], 1, 1, 1, quiet=True, env=env)["variants"][v]
            summary["variants"][v]["peak_rss"] = row["peak_rss"]
            print(
                f"  [{preset} memory, new processes] {v:10} peak RSS "
                f"{' / '.join(f'{b / MiB:.0f}' for b in row['peak_rss'])} MiB",
                flush=True,
            )
    return summary


def launch(
    args, preset: str, variants: list[str], rounds: int, warmup: int, steps: int, quiet: bool, env: dict | None = None
) -> dict:
    """One 2-rank job (this script with --worker) that runs `variants`; returns rank 0's summary."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        command = [
            sys.executable,
            "-m",
            "benchmarks.compare",
            "--worker",
            "--out",
            out,
            "--preset",
            preset,
            "--variants",
            ",".join(variants),
            "--rounds",
            str(rounds),
            "--warmup",
            str(warmup),
            "--steps",
            str(steps),
            "--batch-size",
            str(args.batch_size),
            "--block-size",
            str(args.block_size),
            "--lr",
            str(args.lr),
            "--seed",
            str(args.seed),
        ]
        command += ["--quiet"] * quiet
        env = {
            **(env or {}),
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(free_port()),
            "WORLD_SIZE": str(args.ranks),
        }
        procs, logs = [], []
        for rank in range(args.ranks):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            stdout = None if rank == 0 else log
            procs.append(
                subprocess.Popen(
                    command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, stdout=stdout, stderr=log
                )
            )
            logs.append(log)
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):  # one rank failed: the others would wait forever
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            time.sleep(0.2)
        if any(p.returncode != 0 for p in procs) or not os.path.exists(out):
            for rank, log in enumerate(logs):
                log.seek(0)
                print(f"--- rank {rank} (exit {procs[rank].returncode}):\n{log.read()[-4000:]}", file=sys.stderr)
            raise SystemExit(f"{preset}: the job for {variants} failed")
        with open(out) as f:
            return json.load(f)


def median(values: list[float]) -> float:
    s = sorted(values)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2 if s else float("nan")


def report(preset: str, summary: dict, args) -> str:
    p, world, rows = summary["params"], summary["world"], summary["variants"]
    med = {v: median(r["times"]) for v, r in rows.items()}
    floor_name = "floor" if "floor" in med else "floor-solo"
    floor = med.get(floor_name)
    reference = rows.get("torch-ddp", rows.get("ddp", {})).get("loss")
    lines = [
        f"### {preset}: {p / 1e6:.1f}M parameters, batch {args.batch_size} x {args.block_size} tokens per rank, "
        f"{world} ranks, {len(next(iter(rows.values()))['times'])} timed steps per variant",
        "",
        "| variant | median step (s) | fastest (s) | first step (s) | vs torch | vs floor | CPU s per step | "
        "peak RSS per rank (MiB) | model-state theory (MiB) | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v, r in rows.items():
        other = next((v.removesuffix(w) for w in WATCHED if v.endswith(w)), COUNTERPART.get(v))
        vs_torch = f"{med[v] / med[other]:.2f} x {other}" if other in med else ""
        vs_floor = f"{med[v] / floor:.2f}" if floor and v != floor_name else ""
        peak = " / ".join(f"{b / MiB:.0f}" for b in r["peak_rss"] if b is not None)
        first = f"{r['first']:.1f}" if r.get("first") is not None else ""
        cells = [
            v,
            f"{med[v]:.3f}",
            f"{min(r['times']):.3f}",
            first,
            vs_torch,
            vs_floor,
            f"{median(r['cpu']):.2f}",
            peak,
            f"{theory_bytes(v, p, world) / MiB:.0f}",
            _loss_cell(v, r["loss"], reference),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    where = (
        "in new processes per variant, MALLOC_MMAP_THRESHOLD_=1MiB"
        if args.memory == "fresh"
        else "in round 1 of the timing processes"
    )
    lines.append(
        f"process without a model (torch, gloo, batches): "
        f"{' / '.join(f'{b / MiB:.0f}' for b in summary['process_rss'])} MiB per rank; peak RSS measured "
        f"{where}, "
        f"after set-up. (=) final loss within 1e-4 of torch-ddp's. CPU s per step: rank 0's process CPU "
        f"time (compute thread and gloo's threads), median; wall time above CPU time is waiting."
    )
    comm = {v: r["comm"] for v, r in rows.items() if r.get("comm")}
    if comm:
        lines.append(
            "engine collectives per step, rank 0 (calls, MiB of fp32 elements sent): "
            + "; ".join(
                f"{v}: " + ", ".join(f"{k} {c:.0f}x {e * 4 / MiB:.0f}" for k, (c, e) in sorted(kinds.items()))
                for v, kinds in comm.items()
            )
        )
        from strategies.sharding.collectives import describe

        lines.append(f"engine collectives on gloo: {describe('gloo')}")
    return "\n".join(lines)


def _loss_cell(variant: str, loss: float | None, reference: float | None) -> str:
    if loss is None:
        return ""
    if reference is None or variant.split("+")[0] not in AVERAGING or variant == "torch-ddp":
        return f"{loss:.6f}"
    diff = abs(loss - reference)
    return f"{loss:.6f} (=)" if diff < 1e-4 else f"{loss:.6f} (DIFFERS from torch-ddp by {diff:.1e})"


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{platform.platform()}, {cpu}, {os.cpu_count()} CPUs, {rss_total_gib():.0f} GiB RAM; Python "
        f"{platform.python_version()}, torch {torch.__version__}; load average at start {load}"
    )


def rss_total_gib() -> float:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) / 2**20


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="both", choices=["both", "30m", "100m"])
    parser.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS + EXTRA_VARIANTS)}"
    )
    parser.add_argument("--rounds", type=int, default=2, help="passes over all variants (alternating)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant and round")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant and round")
    parser.add_argument("--batch-size", type=int, default=2, help="sequences per rank")
    parser.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    parser.add_argument(
        "--memory",
        default="fresh",
        choices=["fresh", "inline"],
        help="fresh: peak RSS of each variant in its own new pair of processes (1 warm-up + 1 step); "
        "inline: from round 1 of the timing processes (no extra time, a few hundred MiB noisier)",
    )
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--json", help="also write the raw results here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    watched = {f"{s}{w}" for s in WATCHABLE for w in WATCHED}
    unknown = set(args.variants.split(",")) - set(VARIANTS + EXTRA_VARIANTS) - watched
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS + EXTRA_VARIANTS)}")
    for name in ("rounds", "steps", "batch_size", "block_size", "ranks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    variants = args.variants.split(",")
    presets = ["30m", "100m"] if args.preset == "both" else [args.preset]
    print(f"date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}")
    print(f"machine: {machine()}")
    print(f"command: python -m benchmarks.compare {shlex.join(sys.argv[1:])}".rstrip())
    print(
        f"each variant: {args.rounds} rounds x ({args.warmup} warm-up + {args.steps} timed) AdamW steps, fp32, "
        f"{args.ranks} ranks on gloo, 1 thread per rank\n",
        flush=True,
    )
    started, raw = time.perf_counter(), {}
    for preset in presets:
        raw[preset] = summary = run_preset(args, preset, variants)
        print("\n" + report(preset, summary, args) + "\n", flush=True)
    print(f"total wall time {time.perf_counter() - started:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine(), "results": raw}, f, indent=1)


if __name__ == "__main__":
    main()
