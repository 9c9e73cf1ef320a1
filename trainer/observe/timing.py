"""The step timer behind every fit: where each optimizer step's time goes, on this rank.

Phases, exclusive (a phase inside another, such as backward inside a manual training_step, counts only once):
forward (training_step), backward, optimizer (unscaling, clipping, optimizer.step, zero_grad) and validation; and
per optimizer step its wall time, validation left out (data loading, hooks and checkpoints are in it).
Collectives, per kind and unit (strategies/sharding/collectives.py): calls, the time in flight (from issuing it to the
end of its wait) and the exposed part (the time spent inside its wait: what compute did not hide). A phase's time
includes the exposed communication inside it.

All of it is host time (time.perf_counter). On a GPU the host runs ahead of the device: a phase measures the time
to queue its work, unless something in it waits for the device; and nccl's wait only makes the compute stream wait,
so exposed communication reads near zero there. For device time use `profiler="pytorch"` (its trace has the CUDA
kernels and nccl's stream).

Cost: three clock reads and a few dict updates per collective, six clock reads per step.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from strategies import observe

RANGE_NAMES = {
    "forward": "training_step",
    "backward": "backward",
    "optimizer": "optimizer_step",
    "validation": "validation",
}
STEP_PHASES = ("forward", "backward", "optimizer")


class StepTimer(observe.Watcher):
    def __init__(self) -> None:
        self.ranges = False  # record_function around each phase (set while a PyTorchProfiler records)
        self.totals: Counter[str] = Counter()  # phase -> seconds, over the whole fit
        self.calls: Counter[str] = Counter()  # phase -> times entered
        self.comm: dict[tuple[str, str | None], list[float]] = {}  # (kind, unit) -> [calls, in flight, exposed]
        self.window: Counter[str] = Counter()  # phase -> seconds since the last window_metrics()
        self.window_comm: dict[str, list[float]] = {}  # kind -> [in flight, exposed] since then
        self.steps = self.window_steps = 0
        self._stack: list[tuple[str, Any]] = []
        self._since = self._step_start = self._started = time.perf_counter()
        self._excluded = 0.0  # validation time since the last step ended

    # ---- phases -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Training starts now (the first step's wall time counts from here)."""
        self._since = self._step_start = self._started = time.perf_counter()

    def push(self, phase: str) -> None:
        now = time.perf_counter()
        if self._stack:
            self._charge(self._stack[-1][0], now)
        span = None
        if self.ranges:
            span = torch.profiler.record_function(f"shardtrain/{RANGE_NAMES[phase]}")
            span.__enter__()
        self._stack.append((phase, span))
        self.calls[phase] += 1
        self._since = now

    def pop(self, phase: str) -> None:
        """End `phase` (and any phase left open inside it by an error)."""
        now = time.perf_counter()
        while self._stack:
            name, span = self._stack.pop()
            self._charge(name, now)
            if span is not None:
                span.__exit__(None, None, None)
            if name == phase:
                break
        self._since = now

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self.push(name)
        try:
            yield
        finally:
            self.pop(name)

    def _charge(self, phase: str, now: float) -> None:
        seconds = now - self._since
        self.totals[phase] += seconds
        self.window[phase] += seconds
        if phase == "validation":
            self._excluded += seconds

    # ---- collectives --------------------------------------------------------------------------------
    def done(self, call: observe.Call) -> None:
        in_flight, exposed = call.done_at - call.started_at, call.done_at - call.waiting_at
        entry = self.comm.get((call.kind, call.unit))
        if entry is None:
            entry = self.comm[call.kind, call.unit] = [0, 0.0, 0.0]
        entry[0] += 1
        entry[1] += in_flight
        entry[2] += exposed
        window = self.window_comm.get(call.kind)
        if window is None:
            window = self.window_comm[call.kind] = [0.0, 0.0]
        window[0] += in_flight
        window[1] += exposed

    # ---- steps --------------------------------------------------------------------------------------
    def end_step(self) -> None:
        """An optimizer step ended."""
        now = time.perf_counter()
        wall = now - self._step_start - self._excluded
        self.totals["step"] += wall
        self.calls["step"] += 1
        self.window["step"] += wall
        self.steps += 1
        self.window_steps += 1
        self._step_start, self._excluded = now, 0.0

    def window_metrics(self) -> dict[str, float]:
        """`time/<name>`: seconds per optimizer step, averaged over the steps since the last call."""
        if not self.window_steps:
            return {}
        steps = self.window_steps
        names = [*STEP_PHASES, "step", *(n for n in self.window if n not in (*STEP_PHASES, "step"))]
        metrics = {f"time/{name}": self.window[name] / steps for name in names}
        for kind, (in_flight, exposed) in self.window_comm.items():
            metrics.update({f"time/{kind}": in_flight / steps, f"time/{kind}_exposed": exposed / steps})
        self.window.clear()
        self.window_comm.clear()
        self.window_steps = 0
        return metrics

    def summary(self) -> dict[str, Any]:
        """Totals over the fit, as plain values (gathered from every rank for the profiler's table)."""
        return {
            "seconds": time.perf_counter() - self._started,
            "steps": self.steps,
            "phases": {name: (self.calls[name], self.totals[name]) for name in self.totals},
            "comm": {(kind, observe.where(unit)): tuple(value) for (kind, unit), value in self.comm.items()},
        }
