"""Watching collectives: what timing, profiler ranges and divergence checks see of every collective.

The engine's collectives (collectives.py) and the strategy's own (strategies/base.py) report each call here, and
the engine reports each fsdp unit's forward. Nobody watches unless watchers are installed (the Trainer installs its
step timer during fit, a profiler its ranges, detect_divergence its check): unwatched, a collective costs one call
that reads one global, and no clock is read. Watched, each call becomes a `Call` that every watcher sees when it
is about to be issued (`started`), once it is issued (`issued`), before it is waited for (`waiting`) and once the
wait returned (`done`); the call carries the clock readings at `started`, `waiting` and `done` (host time).

One process-wide slot, as torch's profiler has: a process trains one model at a time.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

ORDERED = "ordered"  # a collective that takes its turn in its group's own order (everything but gloo's tagged p2p)


class Call:
    """One collective: `kind` ("all_gather", "reduce_scatter", "all_reduce", "broadcast", ...), `unit` (the
    engine's unit name, "" for the root, "<what>" for the engine's other collectives, or None for the strategy's
    own collectives), `numel` (elements, or None
    for objects whose size may differ between ranks), `group` (None: every rank) and `channel` (ORDERED, or the
    kind when gloo carries it as tagged point-to-point messages that need only be in order among their kind)."""

    __slots__ = ("kind", "unit", "numel", "group", "channel", "started_at", "waiting_at", "done_at", "notes")

    def __init__(self, kind: str, unit: str | None, numel: int | None, group: Any, channel: str) -> None:
        self.kind, self.unit, self.numel, self.group, self.channel = kind, unit, numel, group, channel
        self.waiting_at = self.done_at = 0.0
        self.notes: dict[Any, Any] = {}  # each watcher's own, keyed by the watcher
        self.started_at = time.perf_counter()
        for watcher in _watchers:
            watcher.started(self)

    @property
    def where(self) -> str:
        return where(self.unit)

    def describe(self) -> str:
        size = "" if self.numel is None else f" of {self.numel} element{'s' * (self.numel != 1)}"
        return f"{self.kind}{size}, {self.where}"

    def issued(self) -> None:
        for watcher in _watchers:
            watcher.issued(self)

    def waiting(self) -> None:
        self.waiting_at = time.perf_counter()
        for watcher in _watchers:
            watcher.waiting(self)

    def done(self) -> None:
        self.done_at = time.perf_counter()
        for watcher in _watchers:
            watcher.done(self)


def where(unit: str | None) -> str:
    """How a call's `unit` reads in reports: "strategy", "unit 'h.0'", "unit '<root>'" or "<buffers>"."""
    if unit is None:
        return "strategy"
    return unit if unit.startswith("<") else f"unit {unit or '<root>'!r}"


class Watcher:
    """Sees collectives and unit forwards while installed (`install` or `watched_by`). Subclass it and override
    the methods you need; every method is a no-op here."""

    def started(self, call: Call) -> None:
        """`call` is about to be issued."""

    def issued(self, call: Call) -> None:
        """`call` was issued."""

    def waiting(self, call: Call) -> None:
        """`call` is about to be waited for."""

    def done(self, call: Call) -> None:
        """The wait for `call` returned."""

    def unit_forward(self, unit: str, entering: bool) -> None:
        """An FSDP unit's forward starts (`entering=True`) or ends."""


_watchers: tuple[Watcher, ...] = ()


def start(kind: str, unit: str | None, numel: int | None, group: Any, channel: str = ORDERED) -> Call | None:
    """A collective is about to be issued: its Call, or None when nobody watches (the hot path: one read)."""
    if not _watchers:
        return None
    return Call(kind, unit, numel, group, channel)


@contextmanager
def _sync(kind: str, unit: str | None, numel: int | None, group: Any) -> Iterator[None]:
    call = Call(kind, unit, numel, group, ORDERED)
    call.issued()
    call.waiting()
    yield
    call.done()


def collective(kind: str, unit: str | None, numel: int | None, group: Any = None) -> Any:
    """`with collective(...):` around a blocking collective call (issued and waited for at once)."""
    return _sync(kind, unit, numel, group) if _watchers else nullcontext()


def unit_forward(unit: str, entering: bool) -> None:
    """An fsdp unit's forward starts (`entering`) or ends."""
    for watcher in _watchers:
        watcher.unit_forward(unit, entering)


def watching() -> bool:
    """Whether any watcher is installed."""
    return bool(_watchers)


def install(watcher: Watcher) -> None:
    """Let `watcher` see every collective from now on, after the watchers already installed.

    Args:
        watcher: the watcher.
    """
    global _watchers
    _watchers = (*_watchers, watcher)


def remove(watcher: Watcher) -> None:
    """Stop `watcher` from seeing collectives (nothing happens if it is not installed).

    Args:
        watcher: the watcher.
    """
    global _watchers
    _watchers = tuple(w for w in _watchers if w is not watcher)


@contextmanager
def watched_by(*watchers: Watcher | None) -> Iterator[None]:
    """A context in which `watchers` are installed.

    Args:
        *watchers: the watchers; `None` entries are left out.
    """
    added = [w for w in watchers if w is not None]
    for watcher in added:
        install(watcher)
    try:
        yield
    finally:
        for watcher in added:
            remove(watcher)
