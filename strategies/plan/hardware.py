"""Hardware profiles for the step-time forecast: how fast a device computes and how fast its links move bytes.

Every number is a rate the device achieves, not its data-sheet peak, except `peak_flops`, which is what MFU is
measured against. Where a profile's number comes from is said beside it; "assumed" marks a number no measurement
or publication here backs. `python -m strategies.plan ... --measure` replaces the profile by what it measures on
the machine it runs on (strategies/plan/measure.py).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace

import torch

TFLOPS = 1e12
GBPS = 1e9


@dataclass(frozen=True)
class Link:
    """A link as NCCL (or gloo) uses it: bytes per second each rank moves, and the latency of one ring step."""

    bandwidth: float  # bytes/s per rank, as a collective's bus bandwidth
    latency: float  # seconds per ring step (a tree step costs the same)


@dataclass(frozen=True)
class Hardware:
    """One device and the links between devices, as the forecast uses them."""

    name: str
    matmul_flops: dict[str, float]  # achieved FLOP/s of a large matmul, by dtype name ("bfloat16", ...)
    peak_flops: dict[str, float]  # the data sheet's dense peak by dtype: what MFU divides by
    memory_bandwidth: float  # bytes/s a memory-bound kernel achieves
    attention_fraction: float  # a fused attention kernel's rate as a share of matmul_flops
    op_overhead: float  # seconds every op costs at least (kernel launch, or a CPU op's dispatch)
    intra_node: Link
    inter_node: Link
    sources: list[str] = field(default_factory=list)
    # False where collectives run on the cores that compute (gloo on CPU): they add to the step instead of hiding
    comm_overlaps_compute: bool = True
    # tensor parallel's collectives (DTensor's, on the compute stream) over what the link model gives them: 1 unless
    # --measure --tensor-parallel N timed a step of N tensor-parallel ranks here (gloo's functional collectives and
    # the ranks waiting for each other cost more than the engine's collectives the link was fitted to)
    tensor_parallel_slowdown: float = 1.0

    def matmul_rate(self, dtype: torch.dtype) -> float:
        name = str(dtype).removeprefix("torch.")
        return self.matmul_flops.get(name, self.matmul_flops["float32"])

    def peak(self, dtype: torch.dtype) -> float:
        name = str(dtype).removeprefix("torch.")
        return self.peak_flops.get(name, self.peak_flops["float32"])

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Hardware:
        links = {key: Link(**data[key]) for key in ("intra_node", "inter_node")}
        return cls(**{**data, **links})


_H100_SOURCES = [
    "peak: NVIDIA H100 SXM data sheet (989.4 dense bf16/fp16 TFLOP/s, 66.9 fp32, 3.35 TB/s HBM3, NVLink 900 GB/s "
    "both directions)",
    "matmul_flops bf16/fp16: 794.5 TFLOP/s, the Maximum Achievable Matmul FLOPS measured on an H100 SXM with torch "
    "2.7.0+cu126 (S. Bekman, ml-engineering, compute/accelerator README, MAMF table); fp32: 80% of peak (assumed)",
    "attention_fraction 0.35: FlashAttention-2 reaches ~35% of H100's peak (Shah et al. 2024, FlashAttention-3 "
    "paper), taken as a share of the achieved matmul rate (assumed)",
    "memory_bandwidth: 80% of the HBM peak (assumed); op_overhead 4 us (assumed: kernel launch)",
    "intra_node: NCCL bus bandwidth 80% of NVLink's 450 GB/s per direction (assumed), 2 us per ring step (assumed)",
    "inter_node: 400 Gb/s per GPU (one NIC per GPU) at 90% (assumed), 5 us per ring step (assumed)",
]


def _gpu(
    name: str,
    peak_bf16: float,
    peak_fp32: float,
    mamf_bf16: float,
    hbm: float,
    nvlink_one_way: float,
    nic_gbit: float,
    attention_fraction: float,
    sources: list[str],
) -> Hardware:
    return Hardware(
        name=name,
        matmul_flops={"bfloat16": mamf_bf16, "float16": mamf_bf16, "float32": 0.8 * peak_fp32},
        peak_flops={"bfloat16": peak_bf16, "float16": peak_bf16, "float32": peak_fp32},
        memory_bandwidth=0.8 * hbm,
        attention_fraction=attention_fraction,
        op_overhead=4e-6,
        intra_node=Link(0.8 * nvlink_one_way, 2e-6),
        inter_node=Link(0.9 * nic_gbit * GBPS / 8, 5e-6),
        sources=sources,
    )


HARDWARE: dict[str, Hardware] = {
    "h100": _gpu("h100", 989.4 * TFLOPS, 66.9 * TFLOPS, 794.5 * TFLOPS, 3.35e12, 450 * GBPS, 400, 0.35, _H100_SOURCES),
    "h200": _gpu(
        "h200",
        989.4 * TFLOPS,
        66.9 * TFLOPS,
        794.5 * TFLOPS,
        4.8e12,
        450 * GBPS,
        400,
        0.35,
        [
            "the H100's compute (same GH100 die and clocks at 700 W; H200 data sheet: 989.4 dense bf16 TFLOP/s), "
            "with the H200's 4.8 TB/s HBM3e; every other number as for h100:",
            *_H100_SOURCES[1:],
        ],
    ),
    "a100": _gpu(
        "a100",
        312 * TFLOPS,
        19.5 * TFLOPS,
        271.2 * TFLOPS,
        2.039e12,
        300 * GBPS,
        200,
        0.6,
        [
            "peak: NVIDIA A100 SXM 80GB data sheet (312 dense bf16 TFLOP/s, 19.5 fp32, 2.039 TB/s, NVLink 600 GB/s "
            "both directions)",
            "matmul_flops bf16: 271.2 TFLOP/s, MAMF measured on an A100 SXM with torch 2.6.0+cu126 (ml-engineering, "
            "MAMF table); fp32: 80% of peak (assumed)",
            "attention_fraction 0.6: FlashAttention-2 reaches 50-73% of A100's peak (Dao 2023) (assumed within that)",
            "memory_bandwidth 80% of peak, op_overhead 4 us, links at 80% (NVLink) / 90% (200 Gb/s HDR NIC per GPU), "
            "2 / 5 us per ring step: assumed",
        ],
    ),
    # A rough CPU of this project's CI machines (2 cores; measured 2026-11-27 with --measure, rounded); a run that
    # matters calibrates its own machine with --measure.
    "cpu": Hardware(
        name="cpu",
        matmul_flops={"bfloat16": 10e9, "float16": 5e9, "float32": 60e9},
        peak_flops={"bfloat16": 10e9, "float16": 5e9, "float32": 60e9},
        memory_bandwidth=5e9,
        attention_fraction=0.5,
        op_overhead=10e-6,
        intra_node=Link(1.5e9, 60e-6),
        inter_node=Link(1e9, 100e-6),
        sources=[
            "rough figures of a 2-core CI machine, one core per rank (assumed); calibrate with --measure",
            "gloo's collectives use the same cores as compute: nothing overlaps",
        ],
        comm_overlaps_compute=False,
    ),
}


def get_hardware(name: str | Hardware) -> Hardware:
    """A profile by name (see HARDWARE), or a JSON file that --measure wrote."""
    if isinstance(name, Hardware):
        return name
    if name in HARDWARE:
        return HARDWARE[name]
    if os.path.isfile(name):
        with open(name) as f:
            return Hardware.from_json(json.load(f))
    raise ValueError(
        f"hardware={name!r} is not known; choose one of {sorted(HARDWARE)} or give the JSON file "
        "that --measure --save-hardware wrote"
    )


def default_hardware() -> Hardware:
    """The profile of this machine's GPU 0 when it is one of the known kinds, else `cpu`."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name(0).lower()
        for name in ("h200", "h100", "a100"):
            if name in device:
                return HARDWARE[name]
    return HARDWARE["cpu"]


def with_changes(hardware: Hardware, **changes: float | str) -> Hardware:
    """A copy of a profile with some numbers changed, e.g. a slower HBM: with_changes(h100, memory_bandwidth=...)."""
    return replace(hardware, **changes)
