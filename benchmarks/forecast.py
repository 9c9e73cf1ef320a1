"""The step-time forecast checked two ways, each printed as a table.

    python -m benchmarks.forecast                # both
    python -m benchmarks.forecast --only cpu     # this machine: calibrate, forecast, measure
    python -m benchmarks.forecast --only tp      # the same for fsdp x tensor parallel 2 at 4 and 8 ranks
    python -m benchmarks.forecast --only paper   # Llama 3.1 8B against torchtitan's published H100 table
    python -m benchmarks.forecast --only tp-paper  # Llama 3.1 70B at tp 1-8, and torchtitan's FSDP 32 x TP 8 run
    python -m benchmarks.forecast --only cp      # context parallel 4 on 4 gloo ranks: calibrate, forecast, measure
    python -m benchmarks.forecast --only cp-paper  # Llama 3.1 8B at 32K-512K tokens on 8 and 32 H100, cp 1-8
    python -m benchmarks.forecast --only pp      # pipeline parallel at 2 and 4 gloo ranks: calibrate, forecast, measure
    python -m benchmarks.forecast --only pp-paper  # Llama 3.1 405B on 512 H100 as torchtitan's Table 5 ran it

cpu: `--measure` calibrates a profile on this machine (one step of the 30m GPT with one thread, a gloo sweep over
2 ranks), the plan forecasts ddp, zero2 and fsdp on 2 ranks for benchmarks/compare.py's 30m preset (batch 2 x 128
tokens per rank, fp32 AdamW, fsdp wrapping each Block), then compare.py measures the median step of the same three
(2 gloo ranks, 1 thread each) and the table shows forecast / measured.

paper: examples.llama:llama3_8b planned as torchtitan's Table 1 and 3 ran it (docs/performance.md in pytorch/
torchtitan, "llama3_h100_202412_torchtitan"): FSDP, bf16 parameters, fp32 reduce, sequence 8192, local batch 2,
selective (per-op) activation checkpointing, hosts of 8 H100 (NVLink; 96 GB HBM2e at 2.4 TB/s, 500 W) with 400 Gb/s
per GPU between hosts. The profile is `h100` with the HBM bandwidth set to 2.4 TB/s; its matmul rate is a
published measurement on a 700 W H100 (see strategies/plan/hardware.py), not fitted to these figures. Both torch's
fully_shard schedule (what torchtitan ran) and this engine's are forecast; then the docs' table of the 8B model at
8 to 1,024 GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from types import SimpleNamespace
from typing import Any

import torch

from strategies.plan import HARDWARE, plan_memory
from strategies.plan.hardware import with_changes
from strategies.plan.measure import measure_hardware

TORCHTITAN_TPS = {8: 5762, 128: 5605}  # TPS/GPU, FSDP, Llama 3.1 8B, Tables 1 and 3
CPU_VARIANTS = ("ddp", "zero2", "fsdp")


def cpu_check(rounds: int) -> None:
    from examples.gpt import GPT, GPT_PRESETS, Block

    config = GPT_PRESETS["30m"]
    config = type(config)(**{**config.__dict__, "block_size": 128})
    with torch.device("meta"):
        model = GPT(config)
    args = SimpleNamespace(world_size=2, nodes=1, batch_size=2, seq_len=128, save_hardware=None)
    profile = measure_hardware(model, args, HARDWARE["cpu"])
    plan = plan_memory(model, world_size=2, batch_size=2, seq_len=128, wrap_policy={Block}, hardware=profile)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "compare.json")
        command = [
            sys.executable,
            "-m",
            "benchmarks.compare",
            "--preset",
            "30m",
            "--variants",
            ",".join(CPU_VARIANTS),
            "--rounds",
            str(rounds),
            "--memory",
            "inline",
            "--json",
            out,
        ]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            results = json.load(f)["results"]["30m"]["variants"]
    print("\n| strategy | forecast step (s) | exposed comm (s) | measured median step (s) | forecast / measured |")
    print("|---|---:|---:|---:|---:|")
    for name in CPU_VARIANTS:
        times = sorted(results[name]["times"])
        measured = (times[(len(times) - 1) // 2] + times[len(times) // 2]) / 2
        f = plan.forecasts[name]
        print(f"| {name} | {f.step_s:.3f} | {f.exposed_comm_s:.3f} | {measured:.3f} | {f.step_s / measured:.2f} |")


def tensor_parallel_check(rounds: int) -> None:
    """fsdp x tp 2 on this machine: for 4 and 8 gloo ranks, calibrate a profile (--measure), forecast the Llama of
    benchmarks/tensor_parallel.py split by examples.llama's plan, measure its median step, and compare."""
    from benchmarks.tensor_parallel import config
    from examples.llama import Block, Llama, tensor_parallel_plan

    shape = SimpleNamespace(dim=256, layers=4, seq=128, batch=4)
    with torch.device("meta"):
        model = Llama(config(shape))
    rows = []
    for ranks in (4, 8):
        args = SimpleNamespace(
            world_size=ranks,
            nodes=1,
            batch_size=shape.batch,
            seq_len=shape.seq,
            save_hardware=None,
            tensor_parallel=2,
            tensor_parallel_plan=tensor_parallel_plan,
        )
        profile = measure_hardware(model, args, HARDWARE["cpu"])
        plan = plan_memory(
            model,
            world_size=ranks,
            batch_size=shape.batch,
            seq_len=shape.seq,
            wrap_policy={Block},
            hardware=profile,
            tensor_parallel=2,
            tensor_parallel_plan=tensor_parallel_plan,
        )
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "tp.json")
            command = [sys.executable, "-m", "benchmarks.tensor_parallel", "--ranks", str(ranks), "--only", "ours"]
            command += ["--rounds", str(rounds), "--json", out]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                measured = json.load(f)["fsdp x tp (ours)"]
        rows.append((ranks, plan.forecasts["fsdp"], measured))
    print("\n| ranks | forecast step (s) | of which tensor-parallel and exposed comm (s) | measured median step (s) |"
          " forecast / measured |")  # fmt: skip
    print("|---|---:|---:|---:|---:|")
    for ranks, f, measured in rows:
        print(
            f"| dp {ranks // 2} x tp 2 | {f.step_s:.3f} | {f.exposed_comm_s:.3f} | {measured:.3f} | "
            f"{f.step_s / measured:.2f} |"
        )


def torchtitan_h100_plan(
    model: torch.nn.Module, gpus: int, batch_size: int, schedule: str, seq_len: int = 8192, **options: Any
):
    """`model` (the Llama example, on meta) planned as torchtitan's H100 runs train it: nodes of 8, sequence 8192 (or
    `seq_len`),
    bf16 parameters, fp32 reduce, each Block a unit and checkpointed, 96 GB per GPU, on the h100 profile at the
    HBM2e bandwidth of those runs' GPUs. `options`: plan_memory's other arguments (checkpoint mode, tensor parallel)."""
    from examples.llama import Block

    hardware = with_changes(HARDWARE["h100"], name="h100 (HBM2e 2.4 TB/s)", memory_bandwidth=0.8 * 2.4e12)
    return plan_memory(
        model,
        world_size=gpus,
        nodes=gpus // 8,
        batch_size=batch_size,
        seq_len=seq_len,
        precision="bf16-mixed",
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        wrap_policy={Block},
        activation_checkpointing={Block},
        hardware=hardware,
        schedule=schedule,
        device_memory="96GB",
        **options,
    )


def llama_plan(gpus: int, schedule: str):
    """Llama 3.1 8B, batch 2 per GPU, selective activation checkpointing (torchtitan's 8B settings)."""
    from examples.llama import llama3_8b

    with torch.device("meta"):
        model = llama3_8b()
    return torchtitan_h100_plan(model, gpus, 2, schedule, checkpoint_mode="selective")


def paper_check() -> None:
    print(
        "\n| schedule | GPUs | forecast TPS/GPU | torchtitan TPS/GPU | forecast / torchtitan | MFU | exposed comm (s) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    found = {}
    for schedule in ("fully_shard", "engine"):
        for gpus in (8, 128):
            f = llama_plan(gpus, schedule).forecasts["fsdp"]
            found[schedule, gpus] = f.tokens_per_s_per_rank
            print(
                f"| {schedule} | {gpus} | {f.tokens_per_s_per_rank:,.0f} | {TORCHTITAN_TPS[gpus]:,} | "
                f"{f.tokens_per_s_per_rank / TORCHTITAN_TPS[gpus]:.2f} | {f.mfu:.1%} | {f.exposed_comm_s:.3f} |"
            )
    theirs = TORCHTITAN_TPS[128] / TORCHTITAN_TPS[8]
    for schedule in ("fully_shard", "engine"):
        ours = found[schedule, 128] / found[schedule, 8]
        print(
            f"\n128/8 GPUs, {schedule}: forecast {ours:.3f}, torchtitan {theirs:.3f} "
            f"({100 * (ours - theirs):+.1f} points)"
        )
    print(
        "\n| GPUs (nodes of 8) | strategy | step (s) | tokens/s per GPU | MFU | exposed comm (s) | "
        "planned memory per GPU |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|")
    for gpus in (8, 64, 128, 1024):
        plan = llama_plan(gpus, "engine")
        for name in ("zero2", "hsdp", "fsdp"):
            if name not in plan.forecasts:
                continue
            f, row = plan.forecasts[name], plan.strategies[name]
            print(
                f"| {gpus} | {name} | {f.step_s:.2f} | {f.tokens_per_s_per_rank:,.0f} | {f.mfu:.1%} | "
                f"{f.exposed_comm_s:.2f} | {row.total / 2**30:.1f} GiB |"
            )


TORCHTITAN_70B_TP8 = 597.3  # TPS/GPU, Llama 3.1 70B, 256 H100, FSDP 32 x TP 8, bf16, compile, full AC, batch 16


def llama70b_plan(gpus: int, tp: int, schedule: str = "engine"):
    """Llama 3.1 70B on `gpus` H100 in nodes of 8 at tensor parallel `tp` (examples.llama's plan, loss parallel, as
    torchtitan runs it), with torchtitan's 70B settings: sequence 8192, bf16 parameters, fp32 reduce, full
    activation checkpointing, and 16 sequences per 8 GPUs (its local batch of 16 at tp 8), so that every tp
    trains the same tokens per GPU."""
    from examples.llama import llama3_70b, tensor_parallel_plan

    with torch.device("meta"):
        model = llama3_70b()
    return torchtitan_h100_plan(
        model,
        gpus,
        2 * tp,  # sequences per data-parallel rank
        schedule,
        tensor_parallel=tp,
        tensor_parallel_plan=lambda m: tensor_parallel_plan(m, loss_parallel=True),
    )


def tensor_parallel_paper_check() -> None:
    """Llama 3.1 70B at 64, 256 and 1,024 H100 with tp 1, 2, 4, 8 under fsdp; and torchtitan's 2-D run beside the
    forecast of its settings (fully_shard's schedule, as torchtitan ran)."""
    f = llama70b_plan(256, 8, "fully_shard").forecasts["fsdp"]
    print("\n| run | TPS/GPU | forecast TPS/GPU | forecast / torchtitan | forecast MFU |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| torchtitan, 256 H100, FSDP 32 x TP 8, bf16, torch.compile, full AC, local batch 16 x 8192 | "
        f"{TORCHTITAN_70B_TP8:,.1f} | {f.tokens_per_s_per_rank:,.1f} | "
        f"{f.tokens_per_s_per_rank / TORCHTITAN_70B_TP8:.2f} | {f.mfu:.1%} |"
    )
    print(
        "\n| GPUs (nodes of 8) | tp | sequences per dp rank | step (s) | tokens/s per GPU | MFU | exposed comm (s) | "
        "planned memory per GPU |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for gpus in (64, 256, 1024):
        for tp in (1, 2, 4, 8):
            plan = llama70b_plan(gpus, tp)
            f, row = plan.forecasts["fsdp"], plan.strategies["fsdp"]
            print(
                f"| {gpus} | {tp} | {2 * tp} | {f.step_s:.2f} | {f.tokens_per_s_per_rank:,.0f} | {f.mfu:.1%} | "
                f"{f.exposed_comm_s:.2f} | {row.total / 2**30:.1f} GiB |",
                flush=True,
            )


def context_parallel_check(seq: int = 8192, ranks: int = 4) -> None:
    """Context parallel on this machine: calibrate a profile for `ranks` gloo ranks (--measure), forecast the Llama
    of benchmarks/context_parallel.py at cp `ranks` on one sequence of `seq` tokens, measure its median step
    there, and compare."""
    from benchmarks.context_parallel import config, trial
    from examples.llama import Block, Llama

    with torch.device("meta"):
        model = Llama(config(seq))
    args = SimpleNamespace(world_size=ranks, nodes=1, batch_size=1, seq_len=seq // ranks, save_hardware=None)
    profile = measure_hardware(model, args, HARDWARE["cpu"])
    plan = plan_memory(
        model, world_size=ranks, seq_len=seq, context_parallel=ranks, wrap_policy={Block}, hardware=profile
    )
    times = trial(ranks, seq, 4)["times"][1:]
    measured = sorted(times)[len(times) // 2]
    f = plan.forecasts["fsdp"]
    print("\n| run | forecast step (s) | of which comm (s) | measured median step (s) | forecast / measured |")
    print("|---|---:|---:|---:|---:|")
    print(
        f"| cp {ranks}, {seq} tokens | {f.step_s:.3f} | {f.comm_s:.3f} | {measured:.3f} | {f.step_s / measured:.2f} |"
    )


def context_parallel_paper_check() -> None:
    """Llama 3.1 8B on 8 and 32 H100 (nodes of 8) at 32K, 128K and 512K tokens, cp 1 to 8, fsdp per Block over the
    data-parallel x context-parallel ranks, one sequence per data-parallel rank, bf16 parameters, fp32 reduce, full
    activation checkpointing: memory per GPU and the step."""
    from examples.llama import LLAMA_PRESETS, Llama

    with torch.device("meta"):  # (max_seq_len: the longest sequence; Llama 3.1's rotary tables are computed)
        model = Llama(dataclasses.replace(LLAMA_PRESETS["3.1-8b"], max_seq_len=524288))
    print(
        "\n| GPUs | sequence (tokens) | cp | planned memory per GPU | step (s) | tokens/s per GPU | MFU | "
        "of which all-to-all and exposed comm (s) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for gpus in (8, 32):
        for seq in (32768, 131072, 524288):
            for cp in (1, 2, 4, 8):
                plan = torchtitan_h100_plan(model, gpus, 1, "engine", seq_len=seq, context_parallel=cp)
                f, row = plan.forecasts["fsdp"], plan.strategies["fsdp"]
                fits = "" if row.total <= 96e9 else " (does not fit)"
                print(
                    f"| {gpus} | {seq:,} | {cp} | {row.total / 2**30:.1f} GiB{fits} | {f.step_s:.2f} | "
                    f"{f.tokens_per_s_per_rank:,.0f} | {f.mfu:.1%} | {f.exposed_comm_s:.2f} |",
                    flush=True,
                )


PIPELINE_RUNS = (  # (ranks, pipeline stages, strategy over each stage's ranks)
    (2, 2, "ddp"),
    (4, 2, "ddp"),
    (4, 2, "fsdp"),
    (4, 4, "ddp"),
)


def pipeline_check(rounds: int, microbatches: int = 4) -> None:
    """Pipeline parallel on this machine: for each of PIPELINE_RUNS, calibrate a profile for its gloo ranks
    (--measure, one step of the model at the micro-batch's size), forecast benchmarks/pipeline.py's Llama under
    1F1B, measure its median step there (`rounds` trials), and compare."""
    from benchmarks.pipeline import BATCH, CONFIG, SEQ, trial
    from examples.llama import Block, Llama

    with torch.device("meta"):
        model = Llama(CONFIG)
    rows = []
    for ranks, stages, strategy in PIPELINE_RUNS:
        args = SimpleNamespace(world_size=ranks, nodes=1, batch_size=BATCH, seq_len=SEQ, save_hardware=None)
        args.pipeline_parallel, args.pipeline_schedule, args.pipeline_microbatches = stages, "1F1B", microbatches
        profile = measure_hardware(model, args, HARDWARE["cpu"])
        plan = plan_memory(
            model,
            world_size=ranks,
            batch_size=BATCH,
            seq_len=SEQ,
            wrap_policy={Block},
            hardware=profile,
            pipeline_parallel=stages,
            pipeline_schedule="1F1B",
            pipeline_microbatches=microbatches,
        )
        times = [trial("ours", "1F1B", 6, microbatches, ranks, stages, strategy) for _ in range(rounds)]
        rows.append((ranks, stages, strategy, plan.forecasts[strategy], statistics.median(times)))
    print(
        f"\n{CONFIG.n_layers}-layer Llama (dim {CONFIG.dim}), batch {BATCH} x {SEQ} tokens per data-parallel rank in "
        f"{microbatches} micro-batches, 1F1B, AdamW fp32"
    )
    print("\n| ranks | layout | forecast step (s) | of which exposed comm (s) | measured median step (s) |"
          " forecast / measured |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|")
    for ranks, stages, strategy, f, measured in rows:
        layout = f"pp {stages}" + (f" x {strategy} {ranks // stages}" if ranks > stages else "")
        cells = f"{f.step_s:.3f} | {f.exposed_comm_s:.3f} | {measured:.3f} | {f.step_s / measured:.2f}"
        print(f"| {ranks} | {layout} | {cells} |")


TORCHTITAN_405B = {"1F1B": (100, 82.5), "Interleaved1F1B": (128, 72.7)}  # Table 5: TPS/GPU, memory GiB


def pipeline_paper_check() -> None:
    """Llama 3.1 405B on 512 H100 (nodes of 8) as torchtitan's Table 5 ran it: FSDP 8 x TP 8 x PP 8, local batch 32
    of 8192 tokens in micro-batches of one, full activation checkpointing, bf16 parameters, fp32 reduce; under 1F1B
    and Interleaved1F1B, beside its published TPS/GPU and memory."""
    from examples.llama import LLAMA_PRESETS, Llama, tensor_parallel_plan

    with torch.device("meta"):
        model = Llama(LLAMA_PRESETS["3.1-405b"])
    print("\n| schedule | planned memory per GPU | torchtitan's | step (s) | tokens/s per GPU | torchtitan's | "
          "ratio | MFU | exposed comm (s) |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for schedule, (tps, memory) in TORCHTITAN_405B.items():
        plan = torchtitan_h100_plan(
            model,
            512,
            32,
            "engine",
            tensor_parallel=8,
            tensor_parallel_plan=tensor_parallel_plan,
            pipeline_parallel=8,
            pipeline_schedule=schedule,
            pipeline_microbatches=32,
        )
        f, row = plan.forecasts["fsdp"], plan.strategies["fsdp"]
        print(
            f"| {schedule} | {row.total / 2**30:.1f} GiB | {memory} GiB | {f.step_s:.1f} | "
            f"{f.tokens_per_s_per_rank:,.0f} | {tps} | {f.tokens_per_s_per_rank / tps:.2f} | {f.mfu:.1%} | "
            f"{f.exposed_comm_s:.2f} |",
            flush=True,
        )


class OneLayer(torch.nn.Module):
    """One Llama 3.1 8B decoder layer on a batch of hidden states: what the paper check's compute rests on."""

    def __init__(self) -> None:
        super().__init__()
        from examples.llama import LLAMA_PRESETS, Block

        self.layer = Block(LLAMA_PRESETS["3.1-8b"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def example_input(self, batch_size: int, seq_len: int | None) -> torch.Tensor:
        return torch.empty(batch_size, seq_len, 4096)


def layer_check() -> None:
    """On a GPU: one decoder layer's forward and backward (bf16 autocast, torchtitan's selective checkpointing)
    timed, beside the forecast of the same on the h100 profile: the measured achieved rate the paper check's
    compute could rest on instead of the published matmul rate."""
    if not torch.cuda.is_available():
        print("\nlayer: needs a GPU (torch.cuda.is_available() is False here)")
        return
    from torch.utils.checkpoint import checkpoint

    from strategies.plan.activation_checkpointing import selective_context

    with torch.device("meta"):
        meta = OneLayer()
    forecast = plan_memory(
        meta,
        batch_size=2,
        seq_len=8192,
        precision="bf16-mixed",
        hardware="h100",
        activation_checkpointing={OneLayer},
        checkpoint_mode="selective",
    ).forecasts["ddp"]
    model = OneLayer().cuda()
    x = torch.randn(2, 8192, 4096, device="cuda", requires_grad=True)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = checkpoint(model, x, use_reentrant=False, context_fn=selective_context)
        y.float().mean().backward()

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        step()
    end.record()
    torch.cuda.synchronize()
    measured = start.elapsed_time(end) / 10 / 1e3
    print(
        f"\nlayer on {torch.cuda.get_device_name()}: measured {measured * 1e3:.1f} ms, forecast on h100 "
        f"{forecast.compute_s * 1e3:.1f} ms, forecast / measured {forecast.compute_s / measured:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        choices=["cpu", "tp", "cp", "pp", "paper", "tp-paper", "cp-paper", "pp-paper", "layer"],
        help="layer: on a GPU, one 8B decoder layer measured against its forecast (not run by default)",
    )
    parser.add_argument("--rounds", type=int, default=2, help="compare.py's rounds for the measured steps")
    args = parser.parse_args()
    print(
        f"date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}; machine: {platform.machine()}, "
        f"{os.cpu_count()} CPUs; torch {torch.__version__}"
    )
    print(f"command: python -m benchmarks.forecast {' '.join(sys.argv[1:])}".rstrip())
    if args.only in (None, "cpu"):
        cpu_check(args.rounds)
    if args.only in (None, "tp"):
        tensor_parallel_check(args.rounds)
    if args.only in (None, "paper"):
        paper_check()
    if args.only in (None, "tp-paper"):
        tensor_parallel_paper_check()
    if args.only in (None, "cp"):
        context_parallel_check()
    if args.only in (None, "cp-paper"):
        context_parallel_paper_check()
    if args.only in (None, "pp"):
        pipeline_check(args.rounds)
    if args.only in (None, "pp-paper"):
        pipeline_paper_check()
    if args.only == "layer":
        layer_check()


if __name__ == "__main__":
    main()
