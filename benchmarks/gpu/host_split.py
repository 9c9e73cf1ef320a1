"""Where the host's time per step goes, by what calls it: the split the speed part prints for plain torch and for
fsdp's many-GPU path, so that the extra host time per unit can be taken apart class by class.

From a torch profiler run of a few steps (every thread's events), each event's self time (its own, less its
children's) falls in one class by its name:
- collectives: the process group's calls (nccl, gloo, c10d) and everything they call;
- CUDA runtime: kernel launches, copies, events and stream waits (`cuda...`), outside a collective;
- autograd nodes: an autograd node's own time beyond its operators, which is where the Python hooks on tensors
  and parameters run (the engine's gradient hooks are in AccumulateGrad's);
- operators: ATen operators' own time (dispatch, shape checks, CPU kernels);
- Python: the rest of the step's host time, outside every operator (module calls and forward hooks, the
  optimizer's Python, the training loop), with the own time of record_function ranges such as the optimizer's.

Self times are summed over threads: on the GPU the autograd engine runs backward on a thread of its own while
the main thread waits for it, so the sum is still the step's host time, one thread working at a time.
"""

from __future__ import annotations

from typing import Any

CLASSES = ("collectives", "CUDA runtime", "autograd nodes", "operators", "Python")
COLLECTIVE_MARKS = ("nccl", "gloo", "c10d::", "record_param_comms")


def class_of(name: str) -> str:
    """The class of a profiler event by its name. "Python" is also the time outside every event."""
    if any(mark in name for mark in COLLECTIVE_MARKS):
        return "collectives"
    if name.startswith("cuda"):
        return "CUDA runtime"
    if name.startswith("autograd::engine::evaluate_function") or "Backward" in name or "AccumulateGrad" in name:
        return "autograd nodes"
    if "::" in name:  # aten::mm, prim::..., custom operators
        return "operators"
    return "Python"  # a record_function range, such as the optimizer's "Optimizer.step#AdamW.step"


def split_host_time(events: Any, host_seconds: float, steps: int, step_mark: str) -> dict[str, float]:
    """Microseconds per step in each class. `events`: the profiler's events (`prof.events()`); `host_seconds`:
    the host's wall time of the `steps` profiled steps; `step_mark`: the record_function range around each
    step (it and whatever lies outside it are left out). An event inside a collective counts as the collective's."""
    steps_ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name == step_mark]
    totals = dict.fromkeys(CLASSES, 0.0)
    for event in events:
        if event.name == step_mark or not _inside(event, steps_ranges):
            continue
        totals[_class_with_ancestors(event)] += event.self_cpu_time_total  # microseconds
    in_events = sum(totals.values())
    totals["Python"] += max(0.0, host_seconds * 1e6 - in_events)
    return {name: value / steps for name, value in totals.items()}


def _inside(event: Any, ranges: list[tuple[float, float]]) -> bool:
    return any(start <= event.time_range.start <= end for start, end in ranges)


def _class_with_ancestors(event: Any) -> str:
    parent = event.cpu_parent
    while parent is not None:
        if class_of(parent.name) == "collectives":
            return "collectives"
        parent = parent.cpu_parent
    return class_of(event.name)


def per_unit_difference(split: dict[str, float], baseline: dict[str, float], units: int) -> dict[str, float]:
    """(split - baseline) / units, class by class: the extra host microseconds per unit."""
    return {name: (split[name] - baseline[name]) / units for name in CLASSES}
