"""detect_divergence: ranks out of step are named, not waited on.

Before each collective of the engine and the strategy (strategies/sharding/collectives.py), every rank publishes what it
is about to make (kind, unit, size, its number in its channel, and the line of user code that led there) in a
key-value store beside the process group: torch's TCPStore at MASTER_ADDR:MASTER_PORT, which torchrun, the Trainer's
launcher and the test pool all serve. Before waiting for that collective, a rank reads what the other ranks of its
group published under the same number:
- the same everywhere: the collective goes on;
- different: every rank of the group raises DivergenceError naming each rank's collective and line;
- not there yet: it waits; when every rank waits for a collective that some other rank has not made (so none can
  go on), each raises DivergenceError naming what every rank waits in. A rank that fails otherwise says so in the
  store, and ranks waiting for it stop too; a wait longer than the Trainer's timeout fails naming who is missing.

Channels: collectives must come in the same order on every rank among those of a group that share a channel: on
nccl all of a group's; on gloo those in the group's own order apart from the engine's all-gathers and reduce-scatters,
which gloo carries as tagged point-to-point messages, in order only among their kind (collectives.py). The check is
made before a rank waits, not when it issues, so channels may interleave differently on different ranks (a reduction
starts later on a rank that did not use some parameters) without a false alarm.

Cost per collective: one store write when it is issued, two store reads before its wait, and a walk up the stack.
"""

from __future__ import annotations

import datetime
import json
import linecache
import os
import sys
import sysconfig
import time
import uuid
import weakref
from typing import Any

import torch
import torch.distributed as dist

from strategies import observe

ENV = "SHARDTRAIN_DETECT_DIVERGENCE"  # "1": as Trainer(detect_divergence=True)
RING = 4096  # a rank's published collectives are kept in this many slots per channel
PUBLISH_WAIT_AFTER = 0.02  # seconds of waiting before a rank says in the store that it waits
SCAN_EVERY = 0.2  # seconds between looks at what every rank waits for
GRACE = 0.5  # seconds every rank must stay stuck in the same waits before it counts as a hang

# Frames skipped on the way from a collective to the user's code: torch, the strategies, the standard library (not
# what is installed beside it); frames of the Trainer and the callbacks are reported as the Trainer's.
_PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
_SKIPPED = (os.path.dirname(os.path.abspath(torch.__file__)) + os.sep, os.path.join(_PROJECT, "strategies") + os.sep)
_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep
_TRAINER = tuple(os.path.join(_PROJECT, package) + os.sep for package in ("trainer", "callbacks"))


class DivergenceError(dist.DistError):
    """Ranks are about to make different collectives, or all wait for collectives others are not making."""


def enabled_by_env() -> bool:
    return os.environ.get(ENV, "0") == "1"


class DivergenceCheck(observe.Watcher):
    def __init__(self, store: Any, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout = timeout.total_seconds()
        self._sequence: dict[str, int] = {}
        self._ranks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._waits = 0
        self._state(["running"])
        store.wait([f"s/{r}" for r in range(world_size)], timeout)

    @classmethod
    def connect(cls, timeout: datetime.timedelta) -> DivergenceCheck:
        """Every rank's check on the default process group, under keys of a run rank 0 draws. Collective."""
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not host or not port:
            raise ValueError(
                "detect_divergence needs MASTER_ADDR and MASTER_PORT (torchrun and the Trainer's "
                "launcher set them) to reach the store the process group was made with"
            )
        box = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(f"shardtrain/divergence/{box[0]}", store)
        return cls(store, dist.get_rank(), dist.get_world_size(), timeout)

    # ---- what this rank publishes -------------------------------------------------------------------
    def started(self, call: observe.Call) -> None:
        channel, ranks = self._channel(call)
        seq = self._sequence.get(channel, 0)
        self._sequence[channel] = seq + 1
        entry = [seq, call.kind, call.unit, call.numel, call.where, _site()]
        self.store.set(f"c/{channel}/{seq % RING}/{self.rank}", json.dumps(entry))
        call.notes[self] = (channel, ranks, entry)

    def _channel(self, call: observe.Call) -> tuple[str, list[int]]:
        group = call.group if call.group is not None else dist.group.WORLD
        ranks = self._ranks.get(group)
        if ranks is None:
            ranks = self._ranks[group] = dist.get_process_group_ranks(group)
        return f"{','.join(map(str, ranks))}:{call.channel}", ranks

    def failed(self, error: BaseException) -> None:
        """This rank's fit failed: ranks waiting for it stop too."""
        try:
            self._state(["failed", f"{type(error).__name__}: {error}"])
        except Exception:  # the store may be gone with the failure; the collective timeout still applies
            pass

    def _state(self, state: list[Any]) -> None:
        self.store.set(f"s/{self.rank}", json.dumps(state))

    # ---- the check before a wait --------------------------------------------------------------------
    def waiting(self, call: observe.Call) -> None:
        channel, ranks, entry = call.notes.pop(self)
        keys = [f"c/{channel}/{entry[0] % RING}/{r}" for r in ranks]
        start = last_scan = time.monotonic()
        pause, announced, stuck = 0.0002, False, None
        while (entries := self._published(keys, entry[0])) is None:
            now = time.monotonic()
            if not announced and now - start > PUBLISH_WAIT_AFTER:
                self._waits += 1
                self._state(["waiting", self._waits, channel, ranks, entry])
                announced = True
            if announced and now - last_scan > SCAN_EVERY:
                last_scan = now
                stuck = self._scan(stuck, now, channel, entry)
            if now - start > self.timeout:
                raise DivergenceError(self._timed_out(ranks, keys, entry, now - start))
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        if announced:
            self._state(["running"])
        if any(other[1:4] != entry[1:4] for other in entries):
            raise DivergenceError(_different(channel, dict(zip(ranks, entries))))

    def _published(self, keys: list[str], seq: int) -> list[list[Any]] | None:
        """Every rank's entry for collective `seq` of the channel, or None while some rank has not made it."""
        if not self.store.check(keys):
            return None
        entries = [json.loads(value) for value in self.store.multi_get(keys)]
        return entries if all(e[0] == seq for e in entries) else None

    def _scan(self, stuck: Any, now: float, channel: str, entry: list[Any]) -> Any:
        """Raise if some rank failed, or if every rank has been stuck in the same waits for GRACE seconds."""
        states = [json.loads(v) for v in self.store.multi_get([f"s/{r}" for r in range(self.world_size)])]
        for rank, state in enumerate(states):
            if state[0] == "failed":
                raise DivergenceError(
                    f"rank {rank} failed, so rank {self.rank} stops waiting in {_say(entry)}: {state[1]}"
                )
        if not all(s[0] == "waiting" for s in states) or any(self._can_go_on(s) for s in states):
            return None
        if stuck is None or stuck[1] != states:
            return now, states
        if now - stuck[0] < GRACE:
            return stuck
        raise DivergenceError(_stuck(states))

    def _can_go_on(self, state: list[Any]) -> bool:
        _, _, channel, ranks, entry = state
        return self._published([f"c/{channel}/{entry[0] % RING}/{r}" for r in ranks], entry[0]) is not None

    def _timed_out(self, ranks: list[int], keys: list[str], entry: list[Any], waited: float) -> str:
        missing = [r for r, key in zip(ranks, keys) if self._published([key], entry[0]) is None]
        return (
            f"rank {self.rank} waited {waited:.0f} s (the timeout) in {_say(entry)} for rank(s) {missing}, "
            "which have not made it (detect_divergence)"
        )


# ---- messages -----------------------------------------------------------------------------------------
def _say(entry: list[Any]) -> str:
    seq, kind, _, numel, where, _ = entry
    size = "" if numel is None else f" of {numel} element{'s' * (numel != 1)}"
    return f"{kind} #{seq}{size}, {where}"


def _different(channel: str, entries: dict[int, list[Any]]) -> str:
    order = "in their group's own order" if channel.endswith(":ordered") else f"among their {channel.split(':')[1]}s"
    lines = [
        f"ranks are about to make different collectives (detect_divergence), number {entries[min(entries)][0]} {order}:"
    ]
    lines += [f"  rank {rank}: {_say(entry)}; {entry[5]}" for rank, entry in sorted(entries.items())]
    return "\n".join(lines)


def _stuck(states: list[list[Any]]) -> str:
    lines = [
        "ranks are out of step (detect_divergence): every rank waits in a collective that another rank is not making"
    ]
    lines += [f"  rank {rank}: waits in {_say(state[4])}; {state[4][5]}" for rank, state in enumerate(states)]
    return "\n".join(lines)


# ---- where the user's code led to a collective --------------------------------------------------------
def _site() -> str:
    """Where the user's code led to this collective: the innermost frame of user code, the outermost of the user's
    frames the Trainer called (the training_step, say) when not the same, and the Trainer's frame that made the call
    if one did (the agreement after training_step, self.all_gather, backward)."""
    frame, via, inner, outer = sys._getframe(2), None, None, None
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_TRAINER):
            if inner is not None:
                break  # the Trainer called the user's code that led here
            via = via or frame
        elif not _skipped(filename):
            inner, outer = inner or frame, frame
            if via is not None:
                break  # the Trainer made the call: the user's frame that called the Trainer is enough
        frame = frame.f_back
    if inner is None:
        return f"via {_describe(via)}" if via else "from no Python frame (autograd's thread)"
    text = f"from {_describe(inner)}" + (f", in {_describe(outer)}" if outer is not inner else "")
    return text + (f", via {_describe(via)}" if via is not None else "")


def _skipped(filename: str) -> bool:
    stdlib = filename.startswith(_STDLIB) and "-packages" not in filename
    return filename.startswith(_SKIPPED) or stdlib or filename.startswith("<")


def _describe(frame: Any) -> str:
    path = frame.f_code.co_filename
    shown = os.path.relpath(path) if path.startswith(os.getcwd() + os.sep) else path
    code = linecache.getline(path, frame.f_lineno).strip()
    return f"{shown}:{frame.f_lineno} in {frame.f_code.co_name}: {code}"
