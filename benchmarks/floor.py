"""Where the compute floor's time goes, and what the compiler can take off it (one process, one thread).

    python -m benchmarks.floor                    # the 100m preset, batch 2 x 128 tokens, as compare.py's floor
    python -m benchmarks.floor --preset 30m

Three tables: the eager step split by the profiler into matrix products and attention (the kernels inductor
hands to the same BLAS on a CPU), AdamW and the rest; forward + backward with the blocks eager, compiled by
inductor (default mode) and compiled with mode="max-autotune"; and AdamW's step over the whole model as
torch's default (foreach), fused=True and torch.compile(optimizer.step).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from examples.gpt import GPT, GPT_PRESETS, Block

BLAS_KERNELS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}


def new_model(preset: str, compile_mode: str | None = None) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPT_PRESETS[preset])
    if compile_mode is not None:
        for block in (m for m in model.modules() if isinstance(m, Block)):
            block.compile(mode=None if compile_mode == "default" else compile_mode)
    return model


def timed(fn, warmup: int, steps: int) -> tuple[float, float]:
    """(first call, median of the next `steps` after `warmup` more) in seconds."""
    start = time.perf_counter()
    fn()
    first = time.perf_counter() - start
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return first, sorted(times)[len(times) // 2]


def forward_backward(model: GPT, x: torch.Tensor, y: torch.Tensor):
    def run() -> None:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        model.zero_grad(set_to_none=False)

    return run


def split_of_eager_step(preset: str, x, y) -> dict[str, float]:
    model = new_model(preset)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()

    timed(step, 1, 1)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        total = time.perf_counter() - start
    events = prof.key_averages()
    blas = sum(e.self_cpu_time_total for e in events if e.key in BLAS_KERNELS) / 1e6
    adamw = sum(e.cpu_time_total for e in events if e.key.startswith("Optimizer.step#")) / 1e6
    return {
        "step": total,
        "matrix products and attention": blas,
        "AdamW step (foreach)": adamw,
        "everything else": total - blas - adamw,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="100m", choices=sorted(GPT_PRESETS))
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokens = min(128, GPT_PRESETS[args.preset].block_size)  # compare.py's batch: 2 sequences of 128 tokens
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 256, (2, tokens), generator=g) for _ in range(2))

    split = split_of_eager_step(args.preset, x, y)
    print(f"## {args.preset}: eager step, one process, one thread, batch 2 x {tokens} tokens\n")
    print("| part | seconds | share |\n|---|---:|---:|")
    for part, seconds in split.items():
        print(f"| {part} | {seconds:.3f} | {seconds / split['step']:.0%} |")

    print("\n## forward + backward\n\n| blocks | first call (s) | median (s) | vs eager |\n|---|---:|---:|---:|")
    eager = None
    for mode in (None, "default", "max-autotune"):
        first, median = timed(forward_backward(new_model(args.preset, mode), x, y), 1, args.steps)
        eager = eager or median
        print(f"| {mode or 'eager'} | {first:.1f} | {median:.3f} | {median / eager:.2f} |")

    print("\n## AdamW step over every parameter\n\n| optimizer | first call (s) | median (s) | vs foreach |")
    print("|---|---:|---:|---:|")
    foreach = None
    for kind in ("foreach", "fused=True", "torch.compile(step)"):
        model = new_model(args.preset)
        for p in model.parameters():
            p.grad = torch.randn_like(p) * 1e-3
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=kind == "fused=True")
        first, median = timed(torch.compile(opt.step) if kind.startswith("torch.compile") else opt.step, 1, args.steps)
        foreach = foreach or median
        print(f"| {kind} | {first:.1f} | {median:.3f} | {median / foreach:.2f} |")


if __name__ == "__main__":
    main()
