"""Peak resident memory per rank while a ~1B-parameter model built on the meta device is materialized under fsdp.

    python -m benchmarks.meta_init                       # a 1.1B Llama (HuggingFace transformers), 2 ranks
    python -m benchmarks.meta_init --layers 4 --no-eager # smaller, quicker

Each rank builds the model inside `FSDPStrategy.model_init_context()` (on the meta device, its construction
recorded) and `setup_module` materializes it unit by unit (strategies/sharding/meta_init.py): the values of one
unit's parameters are replayed, rank 0's broadcast, each rank keeps its pieces. Per rank the table gives the resident
memory once torch, transformers and the process group are up (the baseline), the rise of the peak above it while
the model is built and materialized, and what the design allows: this rank's shard plus the largest unit, in full.
For contrast the same model built eagerly in one process (--no-eager leaves it out): the whole model is resident.
The jobs run with MALLOC_MMAP_THRESHOLD_=1048576 (unless set) so that freed buffers leave the resident set.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

GiB = 2**30


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024


def _reset_peak() -> int:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS, which is returned in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss("VmRSS:")


def llama_config(layers: int):
    import transformers

    # TinyLlama-1.1B's shape (22 layers: 1.10B parameters), untied embeddings
    return transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )


def run_rank(layers: int) -> None:
    import torch
    import torch.distributed as dist
    import transformers

    from strategies import FSDPStrategy

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    strategy = FSDPStrategy(auto_wrap_policy={transformers.models.llama.modeling_llama.LlamaDecoderLayer})
    baseline = _reset_peak()
    start = time.perf_counter()
    with strategy.model_init_context():
        model = transformers.LlamaForCausalLM(llama_config(layers))
    recorded = time.perf_counter() - start
    after_build = _rss("VmHWM:") - baseline
    strategy.setup_module(model)
    seconds = time.perf_counter() - start
    peak = _rss("VmHWM:") - baseline
    units = strategy.engine.units
    row = {
        "rank": dist.get_rank(),
        "baseline": baseline,
        "build_rise": after_build,
        "peak_rise": peak,
        "shard": strategy.memory_report()["parameters"],
        "record_s": recorded,
        "total_s": seconds,
        "unit": max(u.layout.padded_total * u.master.element_size() for u in units),
        "params": sum(u.layout.total for u in units),
        "units": len(units),
    }
    rows = strategy.all_gather_object(row)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)
    dist.destroy_process_group()


def run_eager(layers: int) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    baseline = _reset_peak()
    start = time.perf_counter()
    model = transformers.LlamaForCausalLM(llama_config(layers))
    row = {
        "baseline": baseline,
        "peak_rise": _rss("VmHWM:") - baseline,
        "total_s": time.perf_counter() - start,
        "params": sum(p.numel() for p in model.parameters()),
    }
    print("RESULT " + json.dumps([row]), flush=True)


def _launch(args: list[str], world_size: int) -> list[dict]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517",
        "WORLD_SIZE": str(world_size),
    }
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "1048576")
    command = [sys.executable, "-m", "benchmarks.meta_init", *args]
    procs = [
        subprocess.Popen(command, env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
        for r in range(world_size)
    ]
    outputs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a rank failed: {[p.returncode for p in procs]}")
    line = next(line for out in outputs for line in out.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--no-eager", action="store_true", help="leave out the eager build in one process")
    parser.add_argument("--rank-job", choices=["sharded", "eager"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job == "sharded":
        return run_rank(args.layers)
    if args.rank_job == "eager":
        return run_eager(args.layers)
    rows = _launch(["--rank-job", "sharded", "--layers", str(args.layers)], args.devices)
    print(
        f"Llama, {rows[0]['params'] / 1e9:.2f}B parameters (fp32: {4 * rows[0]['params'] / GiB:.2f} GiB), "
        f"{rows[0]['units']} units, fsdp on {args.devices} ranks (gloo, CPU); GiB"
    )
    print(
        "| rank | baseline | rise after build (meta) | peak rise, built + materialized | shard | largest unit "
        "| shard + unit | within (peak - bound) | seconds (record / total) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bound = r["shard"] + r["unit"]
        print(
            f"| {r['rank']} | {r['baseline'] / GiB:.2f} | {r['build_rise'] / GiB:.2f} | {r['peak_rise'] / GiB:.2f} "
            f"| {r['shard'] / GiB:.2f} | {r['unit'] / GiB:.2f} | {bound / GiB:.2f} | "
            f"{'yes' if r['peak_rise'] <= bound else 'NO'} ({(r['peak_rise'] - bound) / 2**20:+.0f} MiB) | "
            f"{r['record_s']:.1f} / {r['total_s']:.1f} |"
        )
    if not args.no_eager:
        (eager,) = _launch(["--rank-job", "eager", "--layers", str(args.layers)], 1)
        print(
            f"eager, one process: baseline {eager['baseline'] / GiB:.2f}, peak rise {eager['peak_rise'] / GiB:.2f} "
            f"GiB, {eager['total_s']:.1f} s"
        )


if __name__ == "__main__":
    main()
