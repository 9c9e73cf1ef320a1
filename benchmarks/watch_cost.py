"""What watching the engine's collectives costs, per collective (host time), without the noise of a training step.

    python -m benchmarks.watch_cost            # ~1 min on 2 cores

1. In one process: `observe.start` unwatched (what every collective pays in every run), a unit forward's report
   unwatched, and a whole watched call (start, issued, waiting, done) seen by the Trainer's StepTimer.
2. On two gloo ranks: tiny all-gathers through the engine's collectives (1 element each, so the collective itself is
   as cheap as it gets), in interleaved blocks: unwatched, timed (the StepTimer: as in every Trainer fit) and checked
   (StepTimer + detect_divergence's store check).
Multiply by the collectives per step (benchmarks/compare.py prints them: fsdp on the 30m preset makes 25) for the
cost per step; compare.py's "+timed" and "+checked" variants measure the same inside real steps.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from statistics import median

import torch
import torch.distributed as dist

from strategies import observe
from strategies.sharding import collectives
from trainer.observe.divergence import DivergenceCheck
from trainer.observe.timing import StepTimer

CALLS = 200_000


def per_call_ns(fn, calls: int = CALLS) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e9


def watched_call() -> None:
    call = observe.start("all_gather", "h.0", 1024, None, "all_gather")
    call.issued()
    call.waiting()
    call.done()


def in_one_process() -> None:
    baseline = per_call_ns(lambda: None)
    start = per_call_ns(lambda: observe.start("all_gather", "h.0", 1024, None, "all_gather")) - baseline
    unit = per_call_ns(lambda: observe.unit_forward("h.0", True)) - baseline
    with observe.watched_by(StepTimer()):
        timed = per_call_ns(watched_call, CALLS // 4) - baseline
    print(
        f"one process: unwatched observe.start {start:.0f} ns per collective, unit_forward {unit:.0f} ns per "
        f"unit forward; watched by the StepTimer {timed:.0f} ns per collective"
    )


def on_two_ranks(blocks: int = 12, per_block: int = 200) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stats, full = collectives.CommStats(), torch.zeros(2)
    shard = full[rank : rank + 1]
    modes = {
        "unwatched": [],
        "timed": [StepTimer()],
        "checked": [StepTimer(), DivergenceCheck.connect(datetime.timedelta(minutes=2))],
    }
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(blocks):
        for mode, watchers in modes.items():
            with observe.watched_by(*watchers):
                dist.barrier()
                start = time.perf_counter()
                for _ in range(per_block):
                    collectives.all_gather(full, shard, None, stats, async_op=False, unit="h.0")
                times[mode].append((time.perf_counter() - start) / per_block * 1e6)
    if rank == 0:
        print(
            f"two gloo ranks, a 1-element all_gather through the engine ({blocks} interleaved blocks of "
            f"{per_block}), us per collective, fastest block / median block: "
            + ", ".join(f"{mode} {min(t):.1f} / {median(t):.1f}" for mode, t in times.items())
        )
    dist.destroy_process_group()


def main() -> None:
    if os.environ.get("RANK") is not None:
        on_two_ranks()
        return
    print(f"torch {torch.__version__}; load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    in_one_process()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": "2",
    }
    command = [sys.executable, "-m", "benchmarks.watch_cost"]
    procs = [subprocess.Popen(command, env={**env, "RANK": str(r)}) for r in range(2)]
    if any(p.wait() != 0 for p in procs):
        raise SystemExit("the two-rank part failed")


if __name__ == "__main__":
    main()
