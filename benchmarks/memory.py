"""Peak resident memory per rank for a ~100M-parameter GPT under ddp, zero1, zero2 and fsdp.

    python -m benchmarks.memory                      # all four strategies, 2 ranks, prints a table
    python -m benchmarks.memory --preset 30m --steps 3
    python -m benchmarks.memory --preset 10m --batch-size 4 --training-only    # issue 27's case (10.8M)
    python -m benchmarks.memory --preset 10m --batch-size 4 --training-only --precision bf16-mixed
    python -m benchmarks.memory --preset 10m --batch-size 4 --training-only --strategies fsdp \
        --activation-checkpointing

Each strategy runs as its own 2-rank job (started by the Trainer). After set-up, each rank resets its kernel
peak-RSS counter (/proc/self/clear_refs), trains a few AdamW steps, and reports its peak resident memory, the
engine's memory report, and the theoretical model-state bytes of the table in docs/architecture.md. Beside them:
the memory plan's total per rank (strategies/plan, computed here on the meta device) against the peak above the
process's baseline: its resident memory once torch, gloo and the Trainer are up and torch._dynamo is imported
(torch.optim imports it with the first optimizer: ~150 MiB of code in every training process), before the model is
built; the ratio is
taken less the file pages read in meanwhile (RssFile: torch's kernels' code that the first step touches, ~20 MiB,
not data the plan counts). With --training-only that is all; otherwise, checkpoints:
- a full checkpoint (`save_checkpoint(path, full=True)`, one file written by rank 0 a batch at a time): how far
  each rank's resident memory rises, next to the file's size;
- a checkpoint directory (DCP), saved synchronously and then asynchronously: how long training is stalled by the
  call (each rank, between barriers), when the async save is complete, and the resident memory rise;
- loading that directory into a fresh model and optimizer of the same strategy (`fit(ckpt_path=...)`): each
  rank's resident memory rise while it loads, next to its own shard of model and optimizer state plus its
  largest unit (what it may hold).
The jobs run with MALLOC_MMAP_THRESHOLD_=1048576 (unless set) so that freed buffers leave the resident set.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from callbacks import Callback
from examples.gpt import GPT, GPT_PRESETS, GPTConfig, GPTModule, TextWindows
from trainer import Trainer, seed_everything

MiB = 2**20
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
BATCH_SIZE = 2  # sequences of block_size tokens per rank (default; --batch-size)
# Issue 27's "new user" case: 10.8M parameters (10.6M outside the embeddings), 256 tokens a sequence.
PRESETS = {**GPT_PRESETS, "10m": GPTConfig(block_size=256, n_layer=6, n_head=6, n_embd=384)}


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
        self.file_rss = _rss_kib("RssFile:") * 1024
        self.report = trainer.strategy.memory_report()


@dataclass(frozen=True)
class Case:
    """What one benchmark run trains: the model preset, tokens per rank, precision and fsdp's options."""

    preset: str = "100m"
    batch_size: int = BATCH_SIZE
    precision: str = "32"
    activation_checkpointing: bool = False  # fsdp: each Block recomputes its activations in backward
    steps: int = 2
    devices: int = 2

    @property
    def config(self) -> GPTConfig:
        return PRESETS[self.preset]

    def argv(self) -> list[str]:
        return [
            "--preset",
            self.preset,
            "--batch-size",
            str(self.batch_size),
            "--precision",
            self.precision,
            "--steps",
            str(self.steps),
            "--devices",
            str(self.devices),
        ] + (["--activation-checkpointing"] if self.activation_checkpointing else [])


def _strategy(name: str, case: Case):
    if name != "fsdp":
        return name
    from examples.gpt import Block
    from strategies import FSDPStrategy

    return FSDPStrategy(
        auto_wrap_policy={Block}, activation_checkpointing={Block} if case.activation_checkpointing else None
    )


def _trainer(strategy: str, case: Case, callbacks: list) -> Trainer:
    return Trainer(
        strategy=_strategy(strategy, case),
        devices=case.devices,
        max_steps=case.steps,
        precision=case.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        callbacks=callbacks,
    )


def _data(case: Case) -> TextWindows:
    block = case.config.block_size
    return TextWindows(torch.randint(0, 256, (block * 64 + 1,), dtype=torch.uint8), block)


def run_one(strategy: str, case: Case, training_only: bool) -> None:
    seed_everything(0)
    data = _data(case)
    peak = PeakMemory()
    trainer = _trainer(strategy, case, [peak])
    importlib.import_module("torch._dynamo")  # what the first optimizer imports (torch.optim's add_param_group)
    baseline = _rss_kib("VmRSS:") * 1024  # torch, gloo, the Trainer and what a step imports; no model yet
    baseline_files = _rss_kib("RssFile:") * 1024
    trainer.fit(GPTModule(case.config, max_steps=case.steps), DataLoader(data, batch_size=case.batch_size))
    row = {
        "strategy": strategy,
        "rank": trainer.global_rank,
        "peak_rss": peak.peak_rss,
        "start_rss": peak.start_rss,
        "baseline_rss": baseline,
        "report": peak.report,
        "params": GPT.count_parameters(case.config),
        "files_read_in": max(0, peak.file_rss - baseline_files),
    }
    if not training_only:
        row.update(_full_save_rise(trainer))
        with tempfile.TemporaryDirectory() as tmp:
            directory = os.path.join(trainer.strategy.broadcast(tmp), "ckpt")
            row.update(_save_stalls(trainer, directory))
            del trainer, peak  # the model and optimizer of training go before the load is measured
            gc.collect()
            trainer = _load_rise(strategy, case, directory, data, row)
            trainer.strategy.barrier()
    rows = trainer.strategy.all_gather_object(row)
    if trainer.is_global_zero:
        print("RESULT " + json.dumps(rows), flush=True)


def _full_save_rise(trainer: Trainer) -> dict[str, int]:
    """How far this rank's resident memory rises while a full checkpoint is written."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(trainer.strategy.broadcast(tmp), "full.pt")
        before = _reset_peak_rss()
        trainer.save_checkpoint(path, full=True)
        rise = _rss_kib("VmHWM:") * 1024 - before
        size = os.path.getsize(path) if trainer.is_global_zero else 0
        trainer.strategy.barrier()
    return {"save_rise": rise, "save_file": size}


def memory_plan(case: Case):
    """The plan for the benchmark's set-up: the same module, batch, precision and fsdp units (each Block)."""
    from examples.gpt import Block
    from strategies.plan import plan_memory

    return plan_memory(
        GPTModule(case.config),
        world_size=case.devices,
        batch_size=case.batch_size,
        precision=case.precision,
        wrap_policy={Block},
        activation_checkpointing={Block} if case.activation_checkpointing else None,
    )


def _save_stalls(trainer: Trainer, directory: str) -> dict[str, float]:
    """Seconds `save_checkpoint` blocks this rank, synchronously and with async_save (then when the async save
    is complete), and the resident memory rise of each. The sync one stays at `directory` for loading."""
    out: dict[str, float] = {}
    for mode, path in (("sync", directory), ("async", directory + "-async")):
        trainer.strategy.barrier()
        before, start = _reset_peak_rss(), time.perf_counter()
        trainer.save_checkpoint(path, async_save=mode == "async")
        out[f"{mode}_stall"] = time.perf_counter() - start
        trainer.checkpointer.wait()
        out[f"{mode}_done"] = time.perf_counter() - start
        out[f"{mode}_rise"] = _rss_kib("VmHWM:") * 1024 - before
        trainer.strategy.barrier()
    out["dcp_bytes"] = sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory))
    return out


class _LoadWindow(Callback):
    """The resident memory rise from just before `fit` loads its ckpt_path (configure_optimizers runs right
    before) until training would start; and what this rank may hold: its shard of the model and the optimizer
    state (fp32 AdamW: 12 bytes per element of its pieces) plus its largest unit."""

    def on_fit_start(self, trainer, module) -> None:
        engine = trainer.strategy.engine
        self.rise = _rss_kib("VmHWM:") * 1024 - module.rss_before_load
        own = sum(piece.numel for unit in engine.units for piece in unit.pieces) or sum(
            unit.layout.total for unit in engine.units
        )  # ddp: everything
        self.budget = 12 * own + 4 * max(unit.layout.total for unit in engine.units)


class _ResetBeforeLoad(GPTModule):
    def configure_optimizers(self):
        result = super().configure_optimizers()
        self.rss_before_load = _reset_peak_rss()
        return result


def _load_rise(strategy: str, case: Case, directory: str, data, row: dict) -> Trainer:
    """Load `directory` into a new model and optimizer (max_steps is the checkpoint's step: nothing is trained);
    adds the rise and the budget to `row`."""
    window = _LoadWindow()
    trainer = _trainer(strategy, case, [window])
    trainer.fit(
        _ResetBeforeLoad(case.config, max_steps=case.steps),
        DataLoader(data, batch_size=case.batch_size),
        ckpt_path=directory,
    )
    row.update(load_rise=window.rise, load_budget=window.budget)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="100m", choices=sorted(PRESETS))
    parser.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="sequences per rank")
    parser.add_argument("--precision", default="32", choices=["32", "bf16-mixed", "bf16-true"])
    parser.add_argument("--activation-checkpointing", action="store_true", help="fsdp: recompute each Block")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--training-only", action="store_true", help="leave out the checkpoint measurements")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    case = Case(args.preset, args.batch_size, args.precision, args.activation_checkpointing, args.steps, args.devices)
    if args.one:
        run_one(args.one, case, args.training_only)
        return
    plan = memory_plan(case)
    print(plan.table() + "\n")
    print(
        f"{'strategy':8} {'rank':>4} {'model-state theory':>18} {'engine report':>14} {'peak RSS in training':>21}"
        f" {'RSS at start':>13} {'baseline':>9} {'plan total':>10} {'peak - baseline':>15} {'code read in':>12}"
        f" {'plan/measured':>13}"
        f" {'full save: RSS rise':>19} {'file':>6}   (MiB; params, grads, optimizer state by the engine)"
    )
    checkpoint_rows = []
    for strategy in args.strategies.split(","):
        command = [sys.executable, "-m", "benchmarks.memory", "--one", strategy, *case.argv()] + (
            ["--training-only"] if args.training_only else []
        )
        # glibc raises its mmap threshold as large blocks are freed, after which freed multi-MiB buffers stay in
        # the heap and peak RSS counts memory the process no longer uses; a fixed threshold returns them.
        env = {"MALLOC_MMAP_THRESHOLD_": str(2**20), **os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(command, capture_output=True, text=True, env=env)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{strategy}: failed\n{out.stderr[-3000:]}")
            continue
        for row in json.loads(line[len("RESULT ") :]):
            r = row["report"]
            model_state = r["parameters"] + r["gradients"] + r["optimizer_state"]
            theory = theory_bytes(strategy, row["params"], args.devices)
            planned, measured = plan.strategies[strategy].total, row["peak_rss"] - row["baseline_rss"]
            files = row["files_read_in"]
            saved = (
                f" {row['save_rise'] / MiB:>19.0f} {row['save_file'] / MiB:>6.0f}"
                if not args.training_only
                else f" {'-':>19} {'-':>6}"
            )
            print(
                f"{strategy:8} {row['rank']:>4} {theory / MiB:>18.0f} {model_state / MiB:>14.0f}"
                f" {row['peak_rss'] / MiB:>21.0f} {row['start_rss'] / MiB:>13.0f}"
                f" {row['baseline_rss'] / MiB:>9.0f} {planned / MiB:>10.0f} {measured / MiB:>15.0f}"
                f" {files / MiB:>12.0f} {planned / (measured - files):>13.3f}{saved}"
                f"   ({r['parameters'] / MiB:.0f}, {r['gradients'] / MiB:.0f}, {r['optimizer_state'] / MiB:.0f})"
            )
            checkpoint_rows.append(row)
    if args.training_only:
        return
    print(
        f"\n{'strategy':8} {'rank':>4} {'sync save: stall s':>18} {'RSS rise':>9} {'async save: stall s':>19}"
        f" {'complete s':>10} {'RSS rise':>9} {'load: RSS rise':>14} {'own shard + unit':>16} {'checkpoint':>10}"
        "   (MiB)"
    )
    for row in checkpoint_rows:
        print(
            f"{row['strategy']:8} {row['rank']:>4} {row['sync_stall']:>18.2f} {row['sync_rise'] / MiB:>9.0f}"
            f" {row['async_stall']:>19.2f} {row['async_done']:>10.2f} {row['async_rise'] / MiB:>9.0f}"
            f" {row['load_rise'] / MiB:>14.0f} {row['load_budget'] / MiB:>16.0f} {row['dcp_bytes'] / MiB:>10.0f}"
        )


if __name__ == "__main__":
    main()
