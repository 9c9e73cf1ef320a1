"""Byte counts in and out: "80GiB" or 2**30 from the user, "1.83 GiB" in tables."""

from __future__ import annotations

import os
import re
from typing import Any

import torch

UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_bytes(value: Any, name: str) -> int:
    """A positive byte count from an int or a string such as "80GiB" or "1.5 GB"; `name` is the argument's."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    match = _SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is not None and match.group(2).lower() in UNITS:
        size = int(float(match.group(1)) * UNITS[match.group(2).lower()])
        if size > 0:
            return size
    raise ValueError(
        f"{name}={value!r} is not a size; use a positive number of bytes (an int) or a string such as '80GiB' "
        f"or '1.5 GB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    )


def format_bytes(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.2f} {unit}" if unit == "GiB" else f"{size / scale:.1f} {unit}"
    return f"{size} B"


def device_memory_per_rank(ranks_per_node: int) -> tuple[int, str]:
    """Free memory of GPU 0, or on CPU this machine's memory shared by the ranks of one node; and where from."""
    if torch.cuda.is_available():
        return torch.cuda.mem_get_info(0)[0], "free on GPU 0"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total // ranks_per_node, f"this machine's {format_bytes(total)} shared by {ranks_per_node} rank(s)"
