"""The collectives of one evaluation step, so that a rank without a batch can take part in the others' step without
running it (as torch's Join shadows DDP's all-reduces for a rank that has run out).

A step makes collectives the Trainer does not see from outside: under fsdp each unit's forward all-gathers its
parameters, and `self.log(..., sync_dist=True, on_step=True)` all-reduces. Every rank must make them in the same
order, so each step is traced: the all-gathers of units (by index), the strategy's all-reduces (op, shape, dtype),
and any other collective (the user's `all_gather`, an engine collective outside a unit's forward), which cannot be
repeated. A rank without a batch repeats a trace: it all-gathers the same units (giving its own shards) and
all-reduces the identity of each op, which adds nothing to sums, maxima and minima. A rank with a batch checks, one
collective at a time and before issuing it, that its step makes exactly the collectives being repeated, and raises
`StepMismatch` instead of waiting for a peer that never comes or mixing up data.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

UNIT = "unit"  # the all-gather of one unit's parameters (fsdp), detail (unit index, unit name)
ALL_REDUCE = "all_reduce"  # detail (op, shape, dtype)
REPEATABLE_OPS = ("sum", "max", "min")  # a "mean" divides by the world size, so a rank adding 0 would change it


class StepMismatch(RuntimeError):
    """A step's collective differs from the one the ranks without a batch repeat."""


@dataclass(frozen=True)
class Collective:
    kind: str
    detail: tuple = ()

    @property
    def repeatable(self) -> bool:
        return self.kind == UNIT or (self.kind == ALL_REDUCE and self.detail[0] in REPEATABLE_OPS)

    def describe(self) -> str:
        if self.kind == UNIT:
            return f"the all-gather of unit {self.detail[1] or '<root>'!r}"
        if self.kind == ALL_REDUCE:
            op, shape, dtype = self.detail
            return f"an all_reduce (op={op!r}) of a {dtype} tensor of shape {shape}"
        return f"a call of {self.kind}"


class StepTrace:
    """The collectives of one step, in order; with `expected`, each must be the next of `expected`."""

    def __init__(self, expected: list[Collective] | None = None) -> None:
        self.collectives: list[Collective] = []
        self.expected = expected
        self._unit_announced = False

    def add(self, collective: Collective) -> None:
        """Called before the collective is issued."""
        if self.expected is not None:
            position = len(self.collectives)
            want = self.expected[position] if position < len(self.expected) else None
            if collective != want:
                repeated = f"repeat {want.describe()} there" if want else "have no more collectives in this step"
                raise StepMismatch(
                    f"its collective {position + 1} is {collective.describe()}, but the ranks "
                    f"without a batch {repeated}"
                )
        self.collectives.append(collective)

    def unit_gather(self, index: int, name: str) -> None:
        self.add(Collective(UNIT, (index, name)))
        self._unit_announced = True

    def engine_collective(self, kind: str) -> None:
        """Every collective of the engine; a unit's all-gather was announced just before it."""
        if self._unit_announced:
            self._unit_announced = False
            return
        self.add(Collective(f"engine {kind}"))

    def finish(self) -> None:
        if self.expected is not None and len(self.collectives) < len(self.expected):
            missing = self.expected[len(self.collectives)]
            raise StepMismatch(
                f"it made {len(self.collectives)} collectives, but the ranks without a batch repeat "
                f"{len(self.expected)} (the next: {missing.describe()})"
            )


def first_unrepeatable(collectives: list[Collective]) -> Collective | None:
    return next((c for c in collectives if not c.repeatable), None)


def identity(collective: Collective, device: torch.device) -> torch.Tensor:
    """What a rank without a batch contributes to a repeated all-reduce: nothing (0, or the lowest / highest)."""
    op, shape, dtype = collective.detail
    dtype = getattr(torch, dtype.removeprefix("torch."))
    if op == "sum":
        return torch.zeros(shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        extreme = -float("inf") if op == "max" else float("inf")
    else:
        extreme = torch.iinfo(dtype).min if op == "max" else torch.iinfo(dtype).max
    return torch.full(shape, extreme, dtype=dtype, device=device)
