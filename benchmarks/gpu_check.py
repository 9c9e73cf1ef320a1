"""One command that checks the project's GPU path (CUDA, nccl) against plain torch on the same GPU.

    python -m benchmarks.gpu_check                         # on a machine with CUDA: every part
    python -m benchmarks.gpu_check --device cpu --tiny     # the same code on CPU at tiny sizes (seconds)
    python -m benchmarks.gpu_check --parts strategies,speed --jobs 1

Every part runs in its own process with its own timeout, at world size 1 over nccl (gloo on CPU): the correctness
parts (several at once, --jobs) compare the project with plain torch, fp32 with TF32 off to 1e-5 and the
reduced-precision modes by their loss curves to 2%; the speed parts run alone afterwards. The script prints a
correctness table, the speed tables and a last line `gpu: K/N checks hold`. With --out-dir DIR the parts' whole
log, the results as JSON and the profiler traces are written to DIR.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from strategies.sharding.collectives import ONE_RANK_COLLECTIVES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the parts run as modules from here


@dataclass(frozen=True)
class Part:
    module: str  # in benchmarks/gpu/
    function: str
    timeout_s: int
    checks: int  # how many checks it reports on CUDA (one fewer where noted for CPU)
    speed: bool = False  # runs alone, after the correctness parts
    cpu_checks: int | None = None
    # Correctness parts run the collectives even on one rank (as many GPUs do; collectives.py), unless "0".
    one_rank_collectives: str = "1"


PARTS: dict[str, Part] = {
    "strategies": Part("correctness", "part_strategies", 180, 10),
    "strategies_alone": Part("correctness", "part_strategies", 180, 10, one_rank_collectives="0"),
    "precision": Part("correctness", "part_precision", 180, 7),
    "offload": Part("correctness", "part_offload", 150, 3, cpu_checks=2),
    "activations": Part("correctness", "part_activations", 150, 2),
    "compile": Part("correctness", "part_compile", 240, 1),
    "fused_adamw": Part("correctness", "part_fused_adamw", 150, 5),
    "checkpoint": Part("correctness", "part_checkpoint", 150, 3),
    "auto": Part("correctness", "part_auto", 120, 1),
    "two_ranks": Part("two_ranks", "part_two_ranks", 300, 9),
    "round": Part("round_checks", "part_round", 240, 3),  # whole-tensor optimizers, context parallel
    "streams": Part("streams", "part_streams", 120, 1, speed=True),
    "speed": Part("speed", "part_speed", 240, 1, speed=True, cpu_checks=0),
    "overhead": Part("speed", "part_overhead", 120, 0, speed=True),
    "forecast": Part("speed", "part_forecast", 120, 0, speed=True),
}


@dataclass
class Outcome:
    name: str
    returncode: int | None  # None: timed out
    seconds: float
    rows: list[dict[str, Any]] = field(default_factory=list)
    log: str = ""


# -------------------------------------------------------------------------------------------------- a part


def run_part_here(name: str, device: str, tiny: bool, speed_batch: int, out_dir: str | None) -> None:
    """The body of one part's process."""
    import importlib

    from benchmarks.gpu.common import Settings, finish, start

    part = PARTS[name]
    settings = Settings(device, tiny, speed_batch, out_dir)
    start(settings, deterministic=not part.speed)
    getattr(importlib.import_module(f"benchmarks.gpu.{part.module}"), part.function)(settings)
    finish()


def launch(name: str, args: argparse.Namespace) -> Outcome:
    from benchmarks.gpu.common import RESULT_PREFIX

    command = [sys.executable, "-m", "benchmarks.gpu_check", "--run-part", name, "--device", args.device]
    command += ["--tiny"] if args.tiny else []
    command += ["--speed-batch", str(args.speed_batch)]
    command += ["--out-dir", args.out_dir] if args.out_dir else []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not PARTS[name].speed:
        env[ONE_RANK_COLLECTIVES] = PARTS[name].one_rank_collectives
    started = time.monotonic()
    timeout = min(PARTS[name].timeout_s * args.timeout_scale, args.deadline - started)
    if timeout < 10:
        print(f"  part {name}: skipped, --budget-s spent", flush=True)
        return Outcome(name, None, 0.0, log="skipped: --budget-s spent")
    try:
        done = subprocess.run(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, timeout=timeout, cwd=ROOT
        )
        returncode, log = done.returncode, done.stdout
    except subprocess.TimeoutExpired as expired:
        returncode, log = None, _text(expired.stdout)
    outcome = Outcome(name, returncode, time.monotonic() - started, log=log)
    for line in log.splitlines():
        if line.startswith(RESULT_PREFIX):
            outcome.rows.append(json.loads(line[len(RESULT_PREFIX) :]))
    status = "timed out" if returncode is None else f"exit {returncode}"
    print(f"  part {name}: {status} after {outcome.seconds:.0f} s", flush=True)
    return outcome


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


# ------------------------------------------------------------------------------------------------ tables


def correctness_rows(outcomes: list[Outcome], device: str) -> list[tuple[str, str, bool, str]]:
    """(part, check, holds, detail): a check holds when every row of that name says so; checks a part did not
    report (it crashed or timed out) are listed as failures."""
    rows = []
    for outcome in outcomes:
        part = PARTS[outcome.name]
        seen: dict[str, tuple[bool, list[str]]] = {}
        for row in (r for r in outcome.rows if r["kind"] == "check"):
            ok, details = seen.get(row["name"], (True, []))
            seen[row["name"]] = (ok and row["ok"], details + [row["detail"]])
        for check, (ok, details) in seen.items():
            rows.append((outcome.name, check, ok, " | ".join(details)))
        expected = part.cpu_checks if device == "cpu" and part.cpu_checks is not None else part.checks
        missing = expected - len(seen)
        if missing > 0 or (outcome.returncode != 0 and part.checks):
            why = "timed out" if outcome.returncode is None else f"exited with {outcome.returncode}"
            rows.append((outcome.name, f"{max(missing, 1)} check(s) not reported", False, f"the part {why}"))
    return rows


def print_correctness(rows: list[tuple[str, str, bool, str]]) -> None:
    width = max([len(r[1]) for r in rows] + [5])
    print(f"\nCorrectness against plain torch on the same device\n{'check'.ljust(width)}  holds  detail")
    for _, check, ok, detail in rows:
        print(f"{check.ljust(width)}  {'yes' if ok else 'NO ':5}  {detail}")


def print_speed(outcomes: list[Outcome]) -> None:
    rows = [r for o in outcomes for r in o.rows if r["kind"] == "speed"]
    gpt2 = [r for r in rows if r["table"] == "gpt2"]
    if gpt2:
        base = {r["variant"]: r["step_ms"] for r in gpt2}
        print(
            f"\nSpeed: GPT-2 small shape, batch {gpt2[0]['batch']} x 1024 tokens, bf16 autocast, AdamW(fused), "
            "one GPU; host ms: the host's time to queue one step on an idle GPU"
        )
        print(
            f"{'variant':15} {'step ms':>9} {'fastest':>8} {'host ms':>8} {'tokens/s':>10} {'MFU':>6} "
            f"{'memory MiB':>11} {'vs torch':>9}"
        )
        for r in gpt2:
            mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
            versus = r["step_ms"] / base["torch"] if "torch" in base else float("nan")
            print(
                f"{r['variant']:15} {r['step_ms']:9.2f} {r.get('fastest_ms', float('nan')):8.2f} "
                f"{r.get('host_ms', float('nan')):8.2f} {r['tokens_per_s']:10.0f} {mfu:>6} "
                f"{r['memory_mib']:11.0f} {versus:9.3f}"
            )
        if "torch+compile" in base and "fsdp+compile" in base and "torch" in base:
            print(f"compiled fsdp vs eager plain torch: {base['torch'] / base['fsdp+compile']:.2f}x faster")
    overhead = [r for r in rows if r["table"] == "overhead"]
    if overhead:
        print(f"\nFramework overhead: {overhead[0]['units']} units of width 64 (GPU work negligible)")
        print(f"{'variant':16} {'step ms':>9} {'us per unit over torch':>23}")
        for r in overhead:
            print(f"{r['variant']:16} {r['step_ms']:9.3f} {r['us_per_unit']:23.1f}")
    print_host_split([r for o in outcomes for r in o.rows if r["kind"] == "host_split"])
    for r in (r for o in outcomes for r in o.rows if r["kind"] == "note"):
        print(f"\n{r['text']}")
    for r in (r for o in outcomes for r in o.rows if r["kind"] == "trace"):
        print(
            f"\nTrace {r['variant']}: streams (kernel us) {r['streams']}; collectives {r['comm_events']} events "
            f"on {r['comm_streams']}, {r['overlap_us']:.0f} of {r['comm_us']:.0f} us overlapping compute; "
            f"{r['comm_names']}"
        )


def print_host_split(rows: list[dict[str, Any]]) -> None:
    """The host's microseconds per step by what spends them (gpu/host_split.py), and fsdp's extra per unit."""
    from benchmarks.gpu.host_split import CLASSES, per_unit_difference

    if not rows:
        return
    print("\nHost time per step by what spends it (us; GPT-2 table, profiled steps)")
    print(f"{'variant':15} {'host ms':>8} " + " ".join(f"{c:>15}" for c in CLASSES))
    for r in rows:
        print(f"{r['variant']:15} {r['host_ms']:8.2f} " + " ".join(f"{r['split_us'][c]:15.0f}" for c in CLASSES))
    by_name = {r["variant"]: r for r in rows}
    if "torch" in by_name and "fsdp@nccl" in by_name:
        extra = per_unit_difference(by_name["fsdp@nccl"]["split_us"], by_name["torch"]["split_us"], rows[0]["units"])
        cells = ", ".join(f"{c} {extra[c]:+.0f}" for c in CLASSES)
        print(f"fsdp's many-GPU path over plain torch, us per unit ({rows[0]['units']} units): {cells}")


def environment() -> str:
    import torch

    line = f"torch {torch.__version__}"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
        line += (
            f", CUDA {torch.version.cuda}, nccl {nccl}, {props.name} ({props.total_memory / 2**30:.0f} GiB, "
            f"{props.multi_processor_count} SMs)"
        )
    return line + f", {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"


# -------------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiny", action="store_true", help="small sizes (for a CPU run in seconds)")
    parser.add_argument("--speed-batch", type=int, default=8, help="the speed part's batch (sequences of 1024)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)}")
    parser.add_argument("--jobs", type=int, default=None, help="correctness parts at once (default: 4 on cuda)")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every part's timeout")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="stop starting parts after this many seconds "
        "(and cut the running ones' timeouts to it), so the tables always print",
    )
    parser.add_argument(
        "--out-dir",
        metavar="DIR",
        help="a folder for the parts' whole log, the results as JSON and the profiler traces",
    )
    parser.add_argument("--run-part", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.run_part:
        run_part_here(args.run_part, args.device, args.tiny, args.speed_batch, args.out_dir)
        return 0
    names = [n.strip() for n in args.parts.split(",") if n.strip()]
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from {list(PARTS)}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda, but no CUDA device is visible; use --device cpu --tiny to try it on CPU")
    if args.out_dir:
        args.out_dir = os.path.abspath(args.out_dir)
        os.makedirs(args.out_dir, exist_ok=True)
    args.deadline = time.monotonic() + (args.budget_s or float("inf"))
    print(f"gpu_check: {environment()}", flush=True)
    jobs = args.jobs or (4 if args.device == "cuda" else 1)
    correctness = [n for n in names if not PARTS[n].speed]
    with ThreadPoolExecutor(jobs) as pool:
        outcomes = list(pool.map(lambda n: launch(n, args), correctness))
    outcomes += [launch(n, args) for n in names if PARTS[n].speed]
    rows = correctness_rows(outcomes, args.device)
    print_correctness(rows)
    print_speed(outcomes)
    _write_outputs(outcomes, rows, args.out_dir)
    holding = sum(ok for _, _, ok, _ in rows)
    print(f"\ngpu: {holding}/{len(rows)} checks hold")
    return 0 if holding == len(rows) else 1


def _write_outputs(outcomes: list[Outcome], rows: list, out: str | None) -> None:
    if not out:
        return
    with open(os.path.join(out, "gpu_check.log"), "w") as f:
        for o in outcomes:
            f.write(f"===== part {o.name}: exit {o.returncode}, {o.seconds:.0f} s\n{o.log}\n")
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(
            {"environment": environment(), "checks": rows, "rows": {o.name: o.rows for o in outcomes}}, f, indent=1
        )


if __name__ == "__main__":
    sys.exit(main())
