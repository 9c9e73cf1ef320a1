"""Checking the Trainer's arguments before anything starts: every mistake is a clear error."""

from __future__ import annotations

import datetime
import re
from typing import Any

import torch

ACCELERATORS = ("auto", "cpu", "cuda", "gpu")  # "gpu" is Lightning's name for cuda
CLIP_ALGORITHMS = ("norm", "value")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_accelerator(accelerator: str) -> str:
    if accelerator not in ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r} is not supported; choose one of {list(ACCELERATORS)}")
    if accelerator == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if accelerator in ("cuda", "gpu") and not torch.cuda.is_available():
        raise ValueError(
            f"accelerator={accelerator!r} but no CUDA device is available; use accelerator='cpu' or 'auto'"
        )
    return "cuda" if accelerator == "gpu" else accelerator


def check_devices(devices: Any, accelerator: str) -> tuple[int, list[int] | None]:
    """Ranks per node and, for a list (Lightning's `devices=[0, 2]`), the CUDA device of each local rank.
    "auto" and -1: every GPU, or 1 process on CPU."""
    if devices == "auto" or devices == -1:
        return (torch.cuda.device_count() if accelerator == "cuda" else 1), None
    if isinstance(devices, (list, tuple)):
        if not devices or not all(_is_int(d) and d >= 0 for d in devices) or len(set(devices)) < len(devices):
            raise ValueError(f"devices={devices!r} is not valid; a list names distinct device indices, e.g. [0, 1]")
        if accelerator == "cuda" and max(devices) >= torch.cuda.device_count():
            raise ValueError(f"devices={devices} but only {torch.cuda.device_count()} CUDA devices are available")
        return len(devices), list(devices)
    if not _is_int(devices) or devices < 1:
        raise ValueError(
            f"devices={devices!r} is not valid; use a positive int (ranks per node), a list of "
            "device indices, -1 or 'auto'"
        )
    if accelerator == "cuda" and devices > torch.cuda.device_count():
        raise ValueError(f"devices={devices} but only {torch.cuda.device_count()} CUDA devices are available")
    return devices, None


def check_fast_dev_run(value: Any) -> int:
    """Batches of a fast_dev_run: 0 (off), 1 for True, or n."""
    if value is False or value is None:
        return 0
    if value is True:
        return 1
    if _is_int(value) and value >= 0:
        return value
    raise ValueError(f"fast_dev_run={value!r} is not valid; use False, True (1 batch) or a number of batches")


def check_choice(name: str, value: Any, choices: tuple) -> Any:
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")
    return value


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True or False")
    return value


def check_sanity_steps(value: Any) -> int:
    if _is_int(value) and value >= -1:
        return value
    raise ValueError(f"num_sanity_val_steps={value!r} is not valid; use an int >= 0 (batches), or -1 for all")


def check_positive_int(name: str, value: Any, allow_none: bool = False, allow: tuple = ()) -> None:
    if value in allow or (allow_none and value is None):
        return
    if not _is_int(value) or value < 1:
        raise ValueError(f"{name}={value!r} is not valid; use a positive int")


def check_fraction_or_count(name: str, value: Any, allow_zero: bool = True) -> None:
    """Batches per epoch: a float in (0, 1] (a fraction) or an int count (>= 0, or >= 1 without `allow_zero`)."""
    if isinstance(value, float) and 0.0 < value <= 1.0:
        return
    if _is_int(value) and value >= (0 if allow_zero else 1):
        return
    count = "an int count" if allow_zero else "a positive int count"
    raise ValueError(f"{name}={value!r} is not valid; use a float in (0, 1] (fraction of the epoch) or {count}")


def check_timeout(timeout: Any) -> datetime.timedelta:
    if timeout is None:
        return datetime.timedelta(minutes=3)
    if isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0:
        return datetime.timedelta(seconds=timeout)
    raise ValueError(f"timeout={timeout!r} is not valid; use seconds (a positive number) or a datetime.timedelta")


def check_clip(value: Any) -> None:
    if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
        raise ValueError(f"gradient_clip_val={value!r} is not valid; use None or a positive number")


def check_profiler(profiler: Any) -> Any:
    """None, a Profiler, or the name of one ("simple", "pytorch"), as Lightning takes it."""
    from .profilers import PROFILERS, Profiler

    if profiler is None or isinstance(profiler, Profiler):
        return profiler
    if isinstance(profiler, str):
        if profiler not in PROFILERS:
            raise ValueError(
                f"profiler={profiler!r} is not valid; choose one of {list(PROFILERS)} or a trainer.profilers.Profiler"
            )
        return PROFILERS[profiler]()
    raise TypeError(f"profiler={profiler!r} must be None, a name ({list(PROFILERS)}) or a trainer.profilers.Profiler")


_DURATION = re.compile(r"(\d+):(\d\d):(\d\d):(\d\d)")


def check_max_time(value: Any) -> datetime.timedelta | None:
    """Lightning's forms: "DD:HH:MM:SS", a timedelta, or a dict of timedelta's arguments ({"hours": 1})."""
    duration = None
    if isinstance(value, datetime.timedelta):
        duration = value
    elif isinstance(value, str) and (match := _DURATION.fullmatch(value.strip())):
        days, hours, minutes, seconds = map(int, match.groups())
        duration = datetime.timedelta(days=days, hours=hours, minutes=minutes, seconds=seconds)
    elif isinstance(value, dict):
        try:
            duration = datetime.timedelta(**value)
        except TypeError:
            duration = None
    elif value is None:
        return None
    if duration is None or duration <= datetime.timedelta(0):
        raise ValueError(
            f"max_time={value!r} is not valid; use a string 'DD:HH:MM:SS' (e.g. '00:12:00:00'), a "
            "positive datetime.timedelta, or a dict of its arguments (e.g. {'hours': 12})"
        )
    return duration
