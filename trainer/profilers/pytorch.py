"""PyTorchProfiler (Lightning's name): torch.profiler over the optimizer steps its schedule picks, on every rank,
with the engine's collectives, fsdp units and the loop's phases as named ranges, and one chrome trace per rank.

Ranges (`record_function`, only while this profiler is set up, so they cost nothing otherwise):
`shardtrain/<kind> <unit>` around issuing a collective, `shardtrain/wait <kind> <unit>` around waiting for it (the
exposed part), `shardtrain/forward <unit>` around an fsdp unit's forward, and `shardtrain/training_step`,
`shardtrain/backward`, `shardtrain/optimizer_step`, `shardtrain/validation`. The strategy's own collectives (the
Trainer's agreement after each training_step, metrics with sync_dist, self.all_gather) are named `strategy`.

Traces go to `dirpath` (default: the run's log directory) as `rank<r>.<time>.pt.trace.json` (`<filename>-rank<r>...`
with a filename), the names `torch.profiler.tensorboard_trace_handler` gives: `tensorboard --logdir <dirpath>`
shows them in the PyTorch profiler plugin (torch-tb-profiler), and Perfetto (ui.perfetto.dev) or chrome://tracing
open the file itself.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler

from strategies import observe

from .base import Profiler

if TYPE_CHECKING:
    from ..trainer import Trainer


def default_schedule() -> Any:
    """Lightning's default window (skip one step, warm up one, record three), once."""
    return schedule(wait=1, warmup=1, active=3, repeat=1)


class PyTorchProfiler(Profiler):
    """`torch.profiler` over the optimizer steps its schedule picks, on every rank (Lightning's name;
    `Trainer(profiler="pytorch")`).

    The engine's collectives, FSDP units' forwards and the loop's phases appear as named ranges
    (`shardtrain/...`). Traces go to `dirpath` as `rank<r>.<time>.pt.trace.json` (`<filename>-rank<r>...` with a
    filename), which TensorBoard's PyTorch profiler plugin, Perfetto or chrome://tracing open. At the end of fit,
    the table of `key_averages()` is the report.

    Args:
        dirpath: the folder of the report (and traces); `None` for the run's log directory.
        filename: the report goes to `<dirpath>/fit-<filename>.txt`; `None` prints it on rank 0.
        group_by_input_shapes: group the table's rows by input shapes too.
        export_to_chrome: write a chrome trace per rank (unless `on_trace_ready` is given).
        row_limit: rows of the table.
        sort_by_key: the table's sort column; `None` for `"cuda_time_total"` with CUDA events, else
            `"self_cpu_time_total"`.
        record_module_names: name the FSDP units' forward ranges.
        **profiler_kwargs: keyword arguments for `torch.profiler.profile` (`schedule`, `activities`,
            `record_shapes`, `profile_memory`, `with_stack`, ...). The default schedule skips one step, warms up
            one and records three, once.

    Raises:
        ValueError: for `emit_nvtx=True` (run under nsys instead).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike | None = None,
        filename: str | None = None,
        group_by_input_shapes: bool = False,
        export_to_chrome: bool = True,
        row_limit: int = 20,
        sort_by_key: str | None = None,
        record_module_names: bool = True,
        **profiler_kwargs: Any,
    ) -> None:
        super().__init__(dirpath, filename)
        if profiler_kwargs.pop("emit_nvtx", False):
            raise ValueError("PyTorchProfiler(emit_nvtx=True) is not supported; run under nsys with the default")
        self.group_by_input_shapes, self.export_to_chrome = group_by_input_shapes, export_to_chrome
        self.row_limit, self.sort_by_key = row_limit, sort_by_key
        self.record_module_names = record_module_names
        self.profiler_kwargs = profiler_kwargs
        self._profiler: profile | None = None
        self._ranges: _Ranges | None = None

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        kwargs = dict(self.profiler_kwargs)
        cuda = trainer.strategy.root_device.type == "cuda"
        kwargs.setdefault("activities", [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
        kwargs["schedule"] = kwargs.get("schedule") or default_schedule()
        if self.export_to_chrome and kwargs.get("on_trace_ready") is None:
            worker = f"{self.filename}-rank{trainer.global_rank}" if self.filename else f"rank{trainer.global_rank}"
            kwargs["on_trace_ready"] = tensorboard_trace_handler(self.dirpath, worker_name=worker)
        self._profiler = profile(**kwargs)
        self._profiler.start()
        self._ranges = _Ranges(self.record_module_names)
        observe.install(self._ranges)
        trainer.timer.ranges = True

    def step(self, trainer: Trainer) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def teardown(self, trainer: Trainer, success: bool) -> None:
        if self._profiler is None:
            return
        trainer.timer.ranges = False
        observe.remove(self._ranges)
        self._profiler.stop()  # exports a window still recording
        if success:
            self._report(trainer, self._table())
        self._profiler = self._ranges = None

    def _table(self) -> str:
        try:
            averages = self._profiler.key_averages(group_by_input_shape=self.group_by_input_shapes)
        except (AttributeError, RuntimeError, AssertionError):  # the schedule never reached a recording step
            return "PyTorchProfiler: no step was recorded (fit ended before the schedule's active steps)"
        cuda = any(getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA for e in averages)
        sort_by = self.sort_by_key or ("cuda_time_total" if cuda else "self_cpu_time_total")
        return averages.table(sort_by=sort_by, row_limit=self.row_limit)


class _Ranges(observe.Watcher):
    """Named ranges around the engine's collectives and units, for the trace."""

    def __init__(self, units: bool) -> None:
        self.units = units
        self._open_units: list[tuple[str, Any]] = []

    def started(self, call: observe.Call) -> None:
        call.notes[self] = _enter(f"shardtrain/{call.kind} {_label(call)}")

    def issued(self, call: observe.Call) -> None:
        _exit(call.notes.pop(self, None))

    def waiting(self, call: observe.Call) -> None:
        call.notes[self] = _enter(f"shardtrain/wait {call.kind} {_label(call)}")

    def done(self, call: observe.Call) -> None:
        _exit(call.notes.pop(self, None))

    def unit_forward(self, unit: str, entering: bool) -> None:
        if not self.units:
            return
        if entering:
            self._open_units.append((unit, _enter(f"shardtrain/forward {unit or '<root>'}")))
        elif self._open_units and self._open_units[-1][0] == unit:
            _exit(self._open_units.pop()[1])


def _label(call: observe.Call) -> str:
    return "strategy" if call.unit is None else call.unit or "<root>"


def _enter(name: str) -> Any:
    span = record_function(name)
    span.__enter__()
    return span


def _exit(span: Any) -> None:
    if span is not None:
        span.__exit__(None, None, None)
