"""Peak resident memory per rank for a ~100M-parameter GPT under ddp, zero1, zero2 and fsdp.

    python benchmarks/memory.py                      # all four strategies, 2 ranks, prints a table
    python benchmarks/memory.py --preset 30m --steps 3

Each strategy runs as its own 2-rank job (started by the Trainer). After set-up, each rank resets its kernel
peak-RSS counter (/proc/self/clear_refs), trains a few AdamW steps, and reports its peak resident memory, the
engine's memory report, and the theoretical model-state bytes of DESIGN.md's table. Beside them: the memory plan's
total per rank (strategies/plan, computed here on the meta device) against the peak above the process's baseline:
its resident memory once torch, gloo and the Trainer are up and torch._dynamo is imported (torch.optim imports it
with the first optimizer: ~150 MiB of code in every training process), before the model is built.
Then every rank writes a full checkpoint (`trainer.save_checkpoint(path, full=True)`, gathered unit by unit to
rank 0) and reports how far its resident memory rose during that save, next to the file's size. The jobs run with
MALLOC_MMAP_THRESHOLD_=1048576 (unless set) so that freed buffers leave the resident set (see main()).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from callbacks import Callback  # noqa: E402
from examples.gpt import GPT, GPT_PRESETS, GPTModule, TextWindows  # noqa: E402
from trainer import Trainer, seed_everything  # noqa: E402

MiB = 2**20
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
BATCH_SIZE = 2  # sequences of block_size tokens per rank


def theory_bytes(strategy: str, params: int, world_size: int) -> float:
    p, n = params, world_size
    return {"ddp": 16 * p, "zero1": 8 * p + 8 * p / n, "zero2": 4 * p + 12 * p / n, "fsdp": 16 * p / n}[strategy]


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS, which is returned in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _rss_kib("VmRSS:") * 1024


class PeakMemory(Callback):
    """Reset the peak-RSS counter when training starts; read it when training ends."""

    def on_train_start(self, trainer, module) -> None:
        self.start_rss = _reset_peak_rss()

    def on_train_end(self, trainer, module) -> None:
        self.peak_rss = _rss_kib("VmHWM:") * 1024
        self.report = trainer.strategy.memory_report()


def run_one(strategy: str, preset: str, steps: int, devices: int) -> None:
    seed_everything(0)
    config = GPT_PRESETS[preset]
    data = TextWindows(torch.randint(0, 256, (config.block_size * 64 + 1,), dtype=torch.uint8), config.block_size)
    policy = {"auto_wrap_policy": None}
    if strategy == "fsdp":
        from examples.gpt import Block
        from strategies import FSDPStrategy

        strategy_arg = FSDPStrategy(auto_wrap_policy={Block})
    else:
        strategy_arg = strategy
    del policy
    peak = PeakMemory()
    trainer = Trainer(strategy=strategy_arg, devices=devices, max_steps=steps, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, callbacks=[peak])
    importlib.import_module("torch._dynamo")  # what the first optimizer imports (torch.optim's add_param_group)

    baseline = _rss_kib("VmRSS:") * 1024  # torch, gloo, the Trainer and what a step imports; no model yet
    trainer.fit(GPTModule(config, max_steps=steps), DataLoader(data, batch_size=BATCH_SIZE))
    row = {"strategy": strategy, "rank": trainer.global_rank, "peak_rss": peak.peak_rss, "start_rss": peak.start_rss,
           "baseline_rss": baseline, "report": peak.report, "params": GPT.count_parameters(config),
           **_full_save_rise(trainer)}
    rows = trainer.strategy.all_gather_object(row)
    if trainer.is_global_zero:
        print("RESULT " + json.dumps(rows), flush=True)


def _full_save_rise(trainer: Trainer) -> dict[str, int]:
    """How far this rank's resident memory rises while a full checkpoint is gathered and written."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(trainer.strategy.broadcast(tmp), "full.pt")
        before = _reset_peak_rss()
        trainer.save_checkpoint(path, full=True)
        rise = _rss_kib("VmHWM:") * 1024 - before
        size = os.path.getsize(path) if trainer.is_global_zero else 0
        trainer.strategy.barrier()
    return {"save_rise": rise, "save_file": size}


def memory_plan(preset: str, devices: int):
    """The plan for the benchmark's set-up: the same module, batch and fsdp units (each Block)."""
    from examples.gpt import Block
    from strategies.plan import plan_memory

    return plan_memory(GPTModule(GPT_PRESETS[preset]), world_size=devices, batch_size=BATCH_SIZE,
                       wrap_policy={Block})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="100m", choices=sorted(GPT_PRESETS))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        run_one(args.one, args.preset, args.steps, args.devices)
        return
    plan = memory_plan(args.preset, args.devices)
    print(plan.table() + "\n")
    print(f"{'strategy':8} {'rank':>4} {'model-state theory':>18} {'engine report':>14} {'peak RSS in training':>21}"
          f" {'RSS at start':>13} {'baseline':>9} {'plan total':>10} {'peak - baseline':>15} {'plan/measured':>13}"
          f" {'full save: RSS rise':>19} {'file':>6}   (MiB; params, grads, optimizer state by the engine)")
    for strategy in args.strategies.split(","):
        command = [sys.executable, os.path.abspath(__file__), "--one", strategy, "--preset", args.preset,
                   "--steps", str(args.steps), "--devices", str(args.devices)]
        # glibc raises its mmap threshold as large blocks are freed, after which freed multi-MiB buffers stay in
        # the heap and peak RSS counts memory the process no longer uses; a fixed threshold returns them.
        env = {"MALLOC_MMAP_THRESHOLD_": str(2**20), **os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(command, capture_output=True, text=True, env=env)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{strategy}: failed\n{out.stderr[-3000:]}")
            continue
        for row in json.loads(line[len("RESULT "):]):
            r = row["report"]
            model_state = r["parameters"] + r["gradients"] + r["optimizer_state"]
            theory = theory_bytes(strategy, row["params"], args.devices)
            planned, measured = plan.strategies[strategy].total, row["peak_rss"] - row["baseline_rss"]
            print(f"{strategy:8} {row['rank']:>4} {theory / MiB:>18.0f} {model_state / MiB:>14.0f}"
                  f" {row['peak_rss'] / MiB:>21.0f} {row['start_rss'] / MiB:>13.0f}"
                  f" {row['baseline_rss'] / MiB:>9.0f} {planned / MiB:>10.0f} {measured / MiB:>15.0f}"
                  f" {planned / measured:>13.3f}"
                  f" {row['save_rise'] / MiB:>19.0f} {row['save_file'] / MiB:>6.0f}"
                  f"   ({r['parameters'] / MiB:.0f}, {r['gradients'] / MiB:.0f}, {r['optimizer_state'] / MiB:.0f})")


if __name__ == "__main__":
    main()
