"""SimpleProfiler (Lightning's name): at the end of fit, a table of where the time went, from the step timer that
measures every fit (trainer/observe/timing.py): per phase and, per collective kind and unit, the time in flight and the
exposed part; mean and total on rank 0, and the slowest rank of each row (all ranks' figures are gathered)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from .base import Profiler

if TYPE_CHECKING:
    from ..trainer import Trainer

PHASE_ROWS = (
    ("optimizer step (wall)", "step"),
    ("  forward (training_step)", "forward"),
    ("  backward", "backward"),
    ("  optimizer", "optimizer"),
    ("validation", "validation"),
)
HEADER = ("Action", "Calls", "Mean (ms)", "Total (s)", "% of fit", "slowest rank: mean (ms)")


class SimpleProfiler(Profiler):
    """At the end of fit, a table of where the time went (Lightning's name; `Trainer(profiler="simple")`).

    The figures come from the step timer that measures every fit: per phase (forward, backward, optimizer,
    validation) and, per collective kind and unit, the time in flight and the exposed part; mean and total on
    this rank, and the slowest rank of each row (all ranks' figures are gathered).

    Args:
        dirpath: the folder of the report (and traces); `None` for the run's log directory.
        filename: the report goes to `<dirpath>/fit-<filename>.txt`; `None` prints it on rank 0.
        extended: a row per unit under each collective kind (Lightning's argument: more detail).
    """

    def __init__(
        self, dirpath: str | os.PathLike | None = None, filename: str | None = None, extended: bool = True
    ) -> None:
        super().__init__(dirpath, filename)
        self.extended = extended

    def teardown(self, trainer: Trainer, success: bool) -> None:
        if success:
            summaries = trainer.strategy.all_gather_object(trainer.timer.summary())
            self._report(trainer, report(summaries, trainer.global_rank, self.extended))


def report(summaries: list[dict[str, Any]], rank: int = 0, extended: bool = True) -> str:
    """The table for this rank's figures (`summaries` by rank)."""
    ours = summaries[rank]
    rows = [
        _row(label, summaries, rank, lambda s, key=key: s["phases"].get(key, (0, 0.0)))
        for label, key in PHASE_ROWS
        if key in ours["phases"]
    ]
    comm_rows = []
    for kind in sorted({kind for kind, _ in ours["comm"]}):
        keys = sorted(where for k, where in ours["comm"] if k == kind) if extended else []
        for part, index in (("in flight", 1), ("exposed", 2)):
            comm_rows.append(_row(f"{kind}, {part}", summaries, rank, lambda s, k=kind, i=index: _total(s, k, i)))
            for where in keys:
                comm_rows.append(
                    _row(f"  {where}", summaries, rank, lambda s, k=(kind, where), i=index: _entry(s, k, i))
                )
    title = (
        f"Profiler report: fit on rank {rank} of {len(summaries)}, {ours['steps']} optimizer steps in "
        f"{ours['seconds']:.2f} s (host time; a phase includes the exposed communication inside it)"
    )
    return _table(title, rows, comm_rows)


def _entry(summary: dict[str, Any], key: tuple[str, str], index: int) -> tuple[int, float]:
    entry = summary["comm"].get(key)
    return (0, 0.0) if entry is None else (int(entry[0]), entry[index])


def _total(summary: dict[str, Any], kind: str, index: int) -> tuple[int, float]:
    entries = [value for (k, _), value in summary["comm"].items() if k == kind]
    return int(sum(e[0] for e in entries)), sum(e[index] for e in entries)


def _row(label: str, summaries: list[dict[str, Any]], rank: int, figures: Any) -> tuple[str, ...]:
    calls, total = figures(summaries[rank])
    mean = lambda c, t: 1000 * t / c if c else 0.0  # noqa: E731
    slowest = max(range(len(summaries)), key=lambda r: figures(summaries[r])[1])
    slow_calls, slow_total = figures(summaries[slowest])
    share = 100 * total / summaries[rank]["seconds"] if summaries[rank]["seconds"] else 0.0
    return (
        label,
        str(calls),
        f"{mean(calls, total):.3f}",
        f"{total:.4f}",
        f"{share:.1f}",
        f"{mean(slow_calls, slow_total):.3f} (rank {slowest})",
    )


def _table(title: str, rows: list[tuple[str, ...]], comm_rows: list[tuple[str, ...]]) -> str:
    every = [HEADER, *rows, *comm_rows]
    widths = [max(len(row[i]) for row in every) for i in range(len(HEADER))]

    def line(row: tuple[str, ...]) -> str:
        cells = (cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        return "| " + " | ".join(cells) + " |"

    rule = "-" * len(line(HEADER))
    out = [title, rule, line(HEADER), rule, *map(line, rows)]
    if comm_rows:
        note = "| collectives: in flight = from issuing to the end of its wait; exposed = the time inside the wait"
        out += [rule, note, rule, *map(line, comm_rows)]
    return "\n".join([*out, rule])
