"""Stateless collective calls on flat buffers, each one counted and reported to whoever watches.

Counts are elements each rank sends, by the textbook ring algorithm: an all-reduce of n elements sends about 2n,
an all-gather producing n elements about n, a reduce-scatter of an n-element input about n. Invariant 3 of the
design is checked against these counts. `unit` names the engine's unit a call is made for (timing, profiler
ranges and divergence checks report it).

Watching collectives (the second half; public as `strategies.observe`): what timing, profiler ranges and
divergence checks see of every collective. The engine's collectives (the first half) and the strategy's own
(strategies/base.py) report each call here, and the engine reports each fsdp unit's forward. Nobody watches unless
watchers are installed (the Trainer installs its step timer during fit, a profiler its ranges, detect_divergence
its check): unwatched, a collective costs one call that reads one global, and no clock is read. Watched, each call
becomes a `Call` that every watcher sees when it is about to be issued (`started`), once it is issued (`issued`),
before it is waited for (`waiting`) and once the wait returned (`done`); the call carries the clock readings at
`started`, `waiting` and `done` (host time).

One process-wide slot, as torch's profiler has: a process trains one model at a time.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist

Work = Any  # torch.distributed.Work, or None for a finished call


class CommStats:
    """Elements sent per collective kind since the last reset; `observer`, when set, hears of each collective
    before it is issued (the engine's `observing`)."""

    def __init__(self) -> None:
        self.elements: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.observer: Callable[[str], None] | None = None

    def add(self, kind: str, elements: int) -> None:
        if self.observer is not None:
            self.observer(kind)
        self.elements[kind] += elements
        self.calls[kind] += 1

    def reset(self) -> None:
        self.elements.clear()
        self.calls.clear()

    def total(self) -> int:
        return sum(self.elements.values())


# gloo's reduce-scatter is a clone, a full all-reduce and a copy, and its all-gather copies more than it must.
# Point-to-point messages do better for both: an all-gather is every rank sending its shard to every other, a
# reduce-scatter every rank sending each other rank that rank's slice and summing what it receives. Measured at
# 2 ranks on a 28 MiB unit: all-gather 20 -> 14 ms (CPU 17 -> 10 ms), reduce-scatter (as an all-reduce keeping
# the local slice) 22 -> 16 ms (CPU 31 -> 21 ms). gloo slows down on single messages above a few MiB and
# collectives above a few tens of MiB, so both go in chunks.
GLOO_CHUNK_BYTES = 16 * 2**20
GLOO_P2P_CHUNK_BYTES = 4 * 2**20
# A message costs tens of microseconds whatever its size, so a reduce-scatter's small parts (a unit's gradients,
# padding, the used flags) travel packed into messages of up to a chunk; a part of at least this size goes as it is
# (no copy). The same elements are summed in the same order either way.
GLOO_PACK_BELOW_BYTES = 2**20


# torch 2.14 renamed the single-tensor collectives (the old names warn there); torch 2.11 has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def describe(backend: str) -> str:
    """How each collective is carried out on `backend` (shown by the benchmarks)."""
    if backend == "gloo":
        return (
            f"all_gather and reduce_scatter as point-to-point messages in {GLOO_P2P_CHUNK_BYTES // 2**20} MiB "
            f"chunks; all_reduce as gloo's own in {GLOO_CHUNK_BYTES // 2**20} MiB chunks"
        )
    return f"torch's all_reduce, {_reduce_scatter_single.__name__} and {_all_gather_single.__name__}"


class Pending:
    """Several in-flight works, what to do once all are done, and the watched call they make up (or None)."""

    def __init__(self, works: list[Any], then: Any = None, call: Call | None = None) -> None:
        self.works, self.then, self.call = works, then, call
        self.abandoned: BaseException | None = None  # a watcher refused the wait (ranks out of step)
        if call is not None:
            call.issued()

    def wait(self) -> None:
        if self.abandoned is not None:
            raise self.abandoned  # never wait for a collective the other ranks will not make
        call, self.call = self.call, None
        if call is not None:
            try:
                call.waiting()
            except BaseException as error:
                self.abandoned = error
                raise
        for work in self.works:
            if work is not None:
                work.wait()
        self.works = []  # (several units' reductions may share one: each waits for it)
        if self.then is not None:
            self.then()
            self.then = None
        if call is not None:
            call.done()


# One rank has nothing to communicate, so it skips the collectives (and fsdp keeps its parameters in place, as
# unit.py says). With this variable set to 1, one rank on nccl runs the collectives and the sharded path anyway,
# as FSDP2 does: to profile on one GPU what many GPUs do (gloo's point-to-point path needs a peer, so not there).
ONE_RANK_COLLECTIVES = "SHARDTRAIN_ONE_RANK_COLLECTIVES"


def one_rank_collectives() -> bool:
    return os.environ.get(ONE_RANK_COLLECTIVES, "0") == "1"


# (size, on gloo) of each live group: asking torch.distributed costs tens of microseconds, per collective.
_GROUP_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _facts(group: Any) -> tuple[int, bool]:
    group = dist.group.WORLD if group is None else group
    facts = _GROUP_FACTS.get(group)
    if facts is None:
        facts = _GROUP_FACTS[group] = (dist.get_world_size(group), dist.get_backend(group) == "gloo")
    return facts


def _alone(group: Any) -> bool:
    """No collective is needed: no process group, or a group of one (see ONE_RANK_COLLECTIVES)."""
    if not dist.is_initialized():
        return True
    size, on_gloo = _facts(group)
    return size == 1 and (on_gloo or not one_rank_collectives())  # (gloo first: the variable is read per call)


def never_communicates(group: Any) -> bool:
    """Whether every collective on `group` is skipped for good: no process group, or one rank on gloo (on nccl
    one rank's collectives follow ONE_RANK_COLLECTIVES, which is read per call)."""
    if not dist.is_initialized():
        return True
    size, on_gloo = _facts(group)
    return size == 1 and on_gloo


def _on_gloo(group: Any) -> bool:
    return _facts(group)[1]


def _chunks(numel: int, element_size: int, chunk_bytes: int | None = None) -> list[tuple[int, int]]:
    step = max(1, (chunk_bytes or GLOO_CHUNK_BYTES) // element_size)
    return [(start, min(start + step, numel)) for start in range(0, numel, step)]


# gloo matches the messages between two ranks that carry the same tag in the order they are posted. All-gathers
# and reduce-scatters use a tag each, so each kind only has to be issued in the same order on every rank (as any
# collective must), not interleaved alike: when a reduction starts can differ between ranks.
ALL_GATHER_TAG, REDUCE_SCATTER_TAG = 1, 2


def _exchange(
    sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]], group: Any, tag: int
) -> list:
    """Post every send (tensor, to group rank) and receive (tensor, from group rank), chunked; returns the works."""
    works = []
    for tensors, post in ((sends, dist.isend), (recvs, dist.irecv)):
        for tensor, peer in tensors:
            for a, b in _chunks(tensor.numel(), tensor.element_size(), GLOO_P2P_CHUNK_BYTES):
                peer_arg = {"group_dst": peer} if post is dist.isend else {"group_src": peer}
                works.append(post(tensor[a:b], group=group, tag=tag, **peer_arg))
    return works


def _peers(group: Any) -> tuple[int, int, list[int]]:
    """This rank, the world size, and the other ranks starting after this one (so that not every rank sends
    to rank 0 first)."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    return rank, size, [(rank + k) % size for k in range(1, size)]


def all_reduce_sum(buffer: torch.Tensor, group: Any, stats: CommStats, async_op: bool, unit: str = "") -> Work:
    """Sum `buffer` across ranks in place (callers divide by the world size)."""
    if _alone(group):
        return None
    call = start("all_reduce", unit, buffer.numel(), group)
    stats.add("all_reduce", 2 * buffer.numel())
    pieces = _chunks(buffer.numel(), buffer.element_size()) if _on_gloo(group) else [(0, buffer.numel())]
    works = [dist.all_reduce(buffer[a:b], group=group, async_op=True) for a, b in pieces]
    pending = Pending(works, call=call)
    if not async_op:
        pending.wait()
    return pending


def reduce_scatter_sum(
    shard: torch.Tensor, full: torch.Tensor, group: Any, stats: CommStats, async_op: bool, unit: str = ""
) -> Work:
    """Sum `full` across ranks and leave this rank's slice in `shard`."""
    n = shard.numel()
    return reduce_scatter_parts(
        shard, [[full[r * n : (r + 1) * n]] for r in range(full.numel() // n)], group, stats, async_op, unit
    )


def reduce_scatter_parts(
    shard: torch.Tensor,
    parts: list[list[torch.Tensor]],
    group: Any,
    stats: CommStats,
    async_op: bool,
    unit: str = "",
) -> Work:
    """A reduce-scatter whose input is given in parts: `parts[r]` are tensors that, flattened and concatenated,
    make rank r's slice (as long as `shard`). On gloo each part is sent as it is, so a unit's gradients need not
    be copied into one flat buffer first; elsewhere they are concatenated for the backend's reduce-scatter."""
    if _alone(group):
        torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in parts[0]], out=shard)
        return None
    n = shard.numel()
    on_gloo = _on_gloo(group)
    channel = "reduce_scatter" if on_gloo else ORDERED  # gloo: tagged messages, in order among their kind
    call = start("reduce_scatter", unit, n * len(parts), group, channel)
    stats.add("reduce_scatter", n * len(parts))
    if not on_gloo:
        full = torch.cat([t.reshape(-1) for rank_parts in parts for t in rank_parts])
        pending = Pending([_reduce_scatter_single(shard, full, group=group, async_op=True)], call=call)
    elif shard.device.type == "cpu":
        pending = _gloo_reduce_scatter(shard, parts, group, call)
    else:
        host_parts = [[t.cpu() for t in rank_parts] for rank_parts in parts]
        pending = _through_host(shard, lambda host: _gloo_reduce_scatter(host, host_parts, group, call))
    if not async_op:
        pending.wait()
    return pending


def _gloo_reduce_scatter(shard: torch.Tensor, parts: list[list[torch.Tensor]], group: Any, call: Any) -> Pending:
    """The first peer's slice is received straight into `shard`, the others' into a buffer; the own parts are
    added once everything has arrived (a fixed order on every rank: first peer, own, other peers by rank)."""
    rank, _, peers = _peers(group)
    # Every rank splits rank r's slice into the same parts, so it packs them alike and the messages pair up.
    packs = [_packs([t.numel() for t in rank_parts], shard.element_size()) for rank_parts in parts]
    own = _packed(parts[rank], packs[rank])
    pack_sizes = [t.numel() for t in own]
    others = torch.empty((len(peers) - 1, shard.numel()), dtype=shard.dtype, device=shard.device)
    targets = [shard, *others]
    sends = [(t, p) for p in peers for t in _packed(parts[p], packs[p])]
    recvs = [(piece, p) for target, p in zip(targets, sorted(peers)) for piece in torch.split(target, pack_sizes)]

    def add_received() -> None:
        for t, out in zip(own, torch.split(shard, pack_sizes)):
            out.add_(t)
        for other in others:
            shard.add_(other)

    return Pending(_exchange(sends, recvs, group, REDUCE_SCATTER_TAG), add_received, call)


def _packs(sizes: list[int], element_size: int) -> list[tuple[int, int]]:
    """Consecutive parts [a, b) that travel as one message: small ones packed up to a chunk, large ones alone."""
    packs: list[tuple[int, int]] = []
    start, filled = 0, 0
    for i, n in enumerate(sizes):
        nbytes = n * element_size
        if i > start and (nbytes >= GLOO_PACK_BELOW_BYTES or filled + nbytes > GLOO_P2P_CHUNK_BYTES):
            packs.append((start, i))
            start, filled = i, 0
        filled += nbytes
        if nbytes >= GLOO_PACK_BELOW_BYTES:
            packs.append((start, i + 1))
            start, filled = i + 1, 0
    if start < len(sizes):
        packs.append((start, len(sizes)))
    return packs


def _packed(parts: list[torch.Tensor], packs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """One flat tensor per pack: the part itself when alone, else the parts concatenated."""
    flat = [t if t.dim() == 1 else t.reshape(-1) for t in parts]
    return [flat[a] if b - a == 1 else torch.cat(flat[a:b]) for a, b in packs]


def all_gather(
    full: torch.Tensor, shard: torch.Tensor, group: Any, stats: CommStats, async_op: bool, unit: str = ""
) -> Work:
    """Concatenate every rank's `shard` into `full`. `shard` may be this rank's own place in `full`."""
    if _alone(group):
        if shard.data_ptr() != full.data_ptr():
            full.copy_(shard)
        return None
    on_gloo = _on_gloo(group)
    call = start("all_gather", unit, full.numel(), group, "all_gather" if on_gloo else ORDERED)
    stats.add("all_gather", full.numel())
    if on_gloo and full.device.type == "cpu":
        pending = _gloo_all_gather(full, shard, group, call)
    elif on_gloo:
        host_shard = shard.cpu()
        pending = _through_host(full, lambda host: _gloo_all_gather(host, host_shard, group, call))
    else:
        # `shard` may be `own` itself: nccl gathers in place when the input is the output's own slice.
        pending = Pending([_all_gather_single(full, shard, group=group, async_op=True)], call=call)
    if not async_op:
        pending.wait()
    return pending


def all_to_all(
    sends: list[torch.Tensor], receive_sizes: list[int], group: Any, stats: CommStats, unit: str = ""
) -> list[torch.Tensor]:
    """Send `sends[r]` (flat) to group rank r and return what each rank sent this one (`receive_sizes[r]`
    elements from rank r), of uneven sizes. Blocking."""
    if _alone(group):
        return [sends[0]]
    rank = dist.get_rank(group)
    call = start("all_to_all", unit, sum(receive_sizes), group)
    stats.add("all_to_all", sum(t.numel() for r, t in enumerate(sends) if r != rank))
    flat = torch.cat(sends)
    received = flat.new_empty(sum(receive_sizes))
    send_sizes = [t.numel() for t in sends]
    if _on_gloo(group) and flat.device.type != "cpu":  # gloo carries host memory
        host = received.cpu()
        work = dist.all_to_all_single(host, flat.cpu(), receive_sizes, send_sizes, group=group, async_op=True)
        Pending([work], lambda: received.copy_(host), call).wait()
    else:
        work = dist.all_to_all_single(received, flat, receive_sizes, send_sizes, group=group, async_op=True)
        Pending([work], call=call).wait()
    return list(torch.split(received, receive_sizes))


def _gloo_all_gather(full: torch.Tensor, shard: torch.Tensor, group: Any, call: Any) -> Pending:
    """Each rank's shard lands straight in its place in `full`."""
    n = shard.numel()
    rank, _, peers = _peers(group)
    own = full[rank * n : (rank + 1) * n]
    if shard.data_ptr() != own.data_ptr():
        own.copy_(shard)
    sends, recvs = [(own, p) for p in peers], [(full[p * n : (p + 1) * n], p) for p in peers]
    return Pending(_exchange(sends, recvs, group, ALL_GATHER_TAG), call=call)


def _through_host(out: torch.Tensor, exchange: Callable[[torch.Tensor], Pending]) -> Pending:
    """gloo's point-to-point messages carry host memory only (its all_reduce and broadcast take CUDA tensors,
    its send and recv do not): `exchange` fills a host copy of `out` (the caller copied its inputs to the host),
    which is copied into `out` once it is done. Two ranks sharing one GPU run this way (nccl refuses them)."""
    host = torch.empty(out.shape, dtype=out.dtype)
    pending = exchange(host)
    then = pending.then

    def copy_back() -> None:
        if then is not None:
            then()
        out.copy_(host)

    pending.then = copy_back
    return pending


def wait(work: Work) -> None:
    if work is not None:
        work.wait()


# ---- watching collectives: who sees each call, and when ----------------------------------------------------
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
