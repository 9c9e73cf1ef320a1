"""The GPU check's stream part: a profiler trace of fsdp steps (and fully_shard's, for comparison) at world size 1
over nccl, read back to show where the collectives ran: on which CUDA stream, and how much of their time
overlapped compute kernels on the compute stream."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
from typing import Any

import torch

from examples.gpt import GPTConfig

from .common import Settings, check, guarded, report, token_batches
from .speed import build_variant, collectives_of, make_step

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def part_streams(settings: Settings) -> None:
    if settings.tiny:
        config = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
        batch_size = 2
    else:  # blocks whose compute (~5 ms each) outlasts the host's work on them, so the GPU has work queued
        config = GPTConfig(vocab_size=8192, block_size=1024, n_layer=4, n_head=16, n_embd=2048)
        batch_size = 8
    batch = token_batches(config, 1, batch_size)[0]
    for variant in ("fsdp@nccl", "fully_shard"):
        label = f"{variant.removesuffix('@nccl')}: collectives on their own stream, overlapping compute"
        guarded(label, _trace, settings, variant, config, batch)


def _trace(settings: Settings, variant: str, config: GPTConfig, batch: tuple) -> None:
    from torch.profiler import ProfilerActivity, profile

    with collectives_of(variant):
        model, optimizer = build_variant(variant, config, settings)
        step = make_step(model, optimizer, batch, settings)
        for _ in range(3):
            step()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if settings.device == "cuda" else [])
        with profile(activities=activities) as prof:
            for _ in range(2):
                step()
            if settings.device == "cuda":
                torch.cuda.synchronize()
    variant = variant.removesuffix("@nccl")
    folder = tempfile.mkdtemp()
    path = os.path.join(folder, f"trace_{variant}.json")
    prof.export_chrome_trace(path)
    summary = summarize(path)
    if settings.out_dir:
        kept = os.path.join(settings.out_dir, f"trace_{variant}.json.gz")
        with open(path, "rb") as src, gzip.open(kept, "wb") as dst:
            shutil.copyfileobj(src, dst)
    shutil.rmtree(folder, ignore_errors=True)
    report("trace", variant=variant, **summary)
    if variant == "fully_shard":
        return  # torch's own, traced for comparison (the trace line shows it), not a check of this project
    if settings.device != "cuda":
        check(
            f"{variant}: collectives on their own stream, overlapping compute",
            True,
            "no CUDA streams on CPU (trace written and read back)",
        )
        return
    own_stream = summary["comm_events"] > 0 and str(summary["compute_stream"]) not in summary["comm_streams"]
    check(
        f"{variant}: collectives on their own stream, overlapping compute",
        own_stream and summary["overlap_us"] > 0,
        f"{summary['comm_events']} collective events on streams {summary['comm_streams']} (compute stream "
        f"{summary['compute_stream']}); {summary['overlap_us']:.0f} of {summary['comm_us']:.0f} us overlap "
        "compute kernels",
    )


def summarize(path: str) -> dict[str, Any]:
    """Streams and overlap in a chrome trace: the compute stream is the one with the most kernel time; collective
    events are GPU events whose name says nccl, or copies on any other stream."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e]
    per_stream: dict[Any, float] = {}
    for e in gpu:
        if e["cat"] == "kernel":
            stream = _stream(e)
            per_stream[stream] = per_stream.get(stream, 0.0) + e["dur"]
    compute = max(per_stream, key=per_stream.get) if per_stream else None
    comm = [e for e in gpu if "nccl" in e["name"].lower() or (e["cat"] == "gpu_memcpy" and _stream(e) != compute)]
    kernels = sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu if e["cat"] == "kernel" and _stream(e) == compute)
    overlap = sum(_overlap(e["ts"], e["ts"] + e["dur"], kernels) for e in comm)
    names: dict[str, int] = {}
    for e in comm:
        names[e["name"][:60]] = names.get(e["name"][:60], 0) + 1
    return {
        "compute_stream": compute,
        "comm_streams": sorted({str(_stream(e)) for e in comm}),
        "comm_events": len(comm),
        "comm_us": sum(e["dur"] for e in comm),
        "overlap_us": overlap,
        "comm_names": dict(sorted(names.items(), key=lambda kv: -kv[1])[:6]),
        "streams": {str(k): round(v) for k, v in per_stream.items()},
    }


def _stream(event: dict) -> Any:
    return event.get("args", {}).get("stream", event.get("tid"))


def _overlap(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    total = 0.0
    for a, b in intervals:
        if a >= end:
            break
        total += max(0.0, min(b, end) - max(a, start))
    return total
