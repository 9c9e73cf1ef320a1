"""The plan as a result: bytes per rank by strategy and each one's step-time forecast (forecast.py makes them), the
table and JSON made of them, and the choice they imply."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .sizes import format_bytes

STRATEGY_ORDER = ("ddp", "zero1", "zero2", "hsdp", "fsdp")  # least communication first (hsdp: when planned)
KINDS = ("parameters", "gradients", "optimizer", "units_in_flight", "activations", "temporaries", "optimizer_step")


@dataclass(frozen=True)
class StrategyMemory:
    """Bytes one rank holds under one strategy during a training step, by kind, and their peak (`total`)."""

    parameters: int
    gradients: int
    optimizer: int  # state, and the master copy where a param dtype is given (see model_bytes.py)
    units_in_flight: int  # unsharded buffers that come and go during forward and backward
    activations: int  # what autograd saves for backward
    gradients_between_steps: bool = True  # False for sharded gradients: made in backward, dropped by zero_grad
    temporaries: int = 0  # alive at forward and backward's peak beside the saved activations (gradients being
    # formed, the logits' gradient): the peak of everything alive in the pass minus the saved tensors' peak
    optimizer_step: int = 0  # made and freed by the optimizer's step (foreach: one tensor the size of its state)

    @property
    def model_state(self) -> int:
        return self.parameters + self.gradients + self.optimizer

    @property
    def backward_peak(self) -> int:
        """The peak of forward and backward. Replicated gradient buckets stay between steps, so they add to what
        forward and backward hold (activations, temporaries, units in flight). Sharded gradients (zero2, fsdp)
        grow during backward as activations are freed and are dropped by zero_grad: only the larger counts."""
        transient = self.units_in_flight + self.activations + self.temporaries
        if self.gradients_between_steps:
            return self.model_state + transient
        return self.parameters + self.optimizer + max(self.gradients, transient)

    @property
    def step_peak(self) -> int:
        """The peak of the optimizer's step: every gradient, the state and the step's temporaries."""
        return self.model_state + self.optimizer_step

    @property
    def total(self) -> int:
        """The peak of a training step: forward and backward's, or the optimizer step's."""
        return max(self.backward_peak, self.step_peak)


FORECAST_KEYS = ("step_s", "tokens_per_s_per_rank", "mfu", "exposed_comm_s")


@dataclass(frozen=True)
class StepForecast:
    """One strategy's training step on one rank, in seconds, and what it gives."""

    step_s: float
    tokens_per_s_per_rank: float
    mfu: float  # model FLOPs per second over the hardware's peak in the compute dtype
    exposed_comm_s: float
    compute_s: float  # forward and backward (recomputation included)
    optimizer_s: float
    comm_s: float  # every collective's own time, overlapped or not

    def to_json(self) -> dict[str, float]:
        return asdict(self)


@dataclass
class MemoryPlan:
    """Bytes per rank for ddp, zero1, zero2 and fsdp; `device_memory` (bytes per rank) is what they must fit."""

    strategies: dict[str, StrategyMemory]
    world_size: int
    nodes: int = 1
    device_memory: int | None = None
    description: list[str] = field(default_factory=list)  # lines above the table: the model, batch, options
    forecasts: dict[str, StepForecast] = field(default_factory=dict)  # the step time of each strategy

    @property
    def activations(self) -> int:
        return next(iter(self.strategies.values())).activations

    def to_json(self) -> dict[str, dict[str, float]]:
        return {
            name: {**{kind: getattr(row, kind) for kind in KINDS}, "total": row.total, **self._forecast_json(name)}
            for name, row in self.strategies.items()
        }

    def _forecast_json(self, name: str) -> dict[str, float]:
        forecast = self.forecasts.get(name)
        return {key: getattr(forecast, key) for key in FORECAST_KEYS} if forecast is not None else {}

    def fitting(self, budget: int | None = None) -> list[str]:
        """The strategies whose total fits `budget` (default: the device memory), least communication first."""
        budget = self._budget(budget)
        return [name for name in STRATEGY_ORDER if name in self.strategies and self.strategies[name].total <= budget]

    def choose(self, budget: int | None = None) -> str:
        """The least-communicating strategy that fits, or a ValueError with every strategy's total."""
        fitting = self.fitting(budget)
        if fitting:
            return fitting[0]
        needs = ", ".join(f"{name} {format_bytes(row.total)}" for name, row in self.strategies.items())
        raise ValueError(
            f"no strategy fits {format_bytes(self._budget(budget))} per rank: the plan needs {needs}; more ranks, "
            "a smaller batch, activation checkpointing or a lower-precision param dtype would lower it"
        )

    def explain(self, name: str, budget: int | None = None) -> str:
        """One line: what was chosen and why."""
        budget = self._budget(budget)
        rejected = [
            f"{other} needs {format_bytes(self.strategies[other].total)}"
            for other in STRATEGY_ORDER
            if other in self.strategies and other != name and STRATEGY_ORDER.index(other) < STRATEGY_ORDER.index(name)
        ]
        reason = f" ({', '.join(rejected)})" if rejected else ""
        return (
            f"{name}: the least-communicating strategy whose plan fits {format_bytes(budget)} per rank, with "
            f"{format_bytes(self.strategies[name].total)}{reason}"
        )

    def _budget(self, budget: int | None) -> int:
        budget = self.device_memory if budget is None else budget
        if budget is None:
            raise ValueError("budget: this plan has no device memory; give a budget in bytes")
        return budget

    def _forecast_cells(self, name: str) -> list[str]:
        f = self.forecasts.get(name)
        if f is None:
            return ["-"] * 4 if self.forecasts else []
        return [_seconds(f.step_s), f"{f.tokens_per_s_per_rank:,.0f}", f"{f.mfu:.1%}", _seconds(f.exposed_comm_s)]

    def table(self) -> str:
        headers = (
            "strategy",
            "parameters",
            "gradients",
            "optimizer",
            "units in flight",
            "activations",
            "temporaries",
            "optimizer step",
            "total",
            *(("step", "tokens/s/rank", "MFU", "exposed comm") if self.forecasts else ()),
        )
        rows = [
            [
                name,
                *(format_bytes(getattr(row, kind)) for kind in KINDS),
                format_bytes(row.total),
                *self._forecast_cells(name),
            ]
            for name, row in self.strategies.items()
        ]
        widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
        best = self.fitting()[0] if self.device_memory is not None and self.fitting() else None
        lines = [*self.description, ""]
        lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))))
        for name, cells in zip(self.strategies, rows):
            line = "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
            if self.device_memory is not None:
                line += "  fits" if self.strategies[name].total <= self.device_memory else "  too big"
                line += "  <- least communication that fits" if name == best else ""
            lines.append(line)
        if self.device_memory is not None and best is None:
            lines.append(f"nothing fits {format_bytes(self.device_memory)} per rank")
        return "\n".join(lines)


def _seconds(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 10 else f"{seconds:,.1f} s"
