"""Where the ranks come from: a torchrun environment, srun's (SLURM, slurm.py), or local ranks started by
re-running this command.

`launch_local_ranks` turns a plain `python script.py` into rank 0 of N: it starts ranks 1..N-1 with the
variables torchrun would set and supervises them, so that one failing rank ends the whole job within seconds:
- a child exiting non-zero: rank 0 reports it, stops the other children and exits with code 1;
- rank 0 raising: its excepthook stops the children after printing the traceback;
- rank 0 dying without cleanup (SIGKILL): each child notices that its parent is gone and exits.
A SIGTERM to rank 0 during fit is passed on to the children (preemption.py): every rank then saves a checkpoint
and exits with PREEMPTED_EXIT_CODE, which is not a failure.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

import torch
import torch.distributed as dist

from . import slurm

_PARENT_PID_VAR = "TRAINER_LAUNCHER_PARENT_PID"  # set only for the children that launch_local_ranks starts
_START_DIR = os.getcwd()  # where the command was started: a script that changes directory is re-run from here
_POLL_S = 0.2
_CAUSE_WAIT_S = 1.0  # how long a raising rank 0 looks for a dead child to name as the cause (slow under load)
_JOIN_TIMEOUT = datetime.timedelta(minutes=5)  # for every rank to start, whatever the collective timeout
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM  # a rank that stopped on SIGTERM after saving a checkpoint
_supervisor: _Supervisor | None = None  # in the process that started local ranks


@dataclass
class ClusterEnvironment:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int

    def to_environ(self) -> dict[str, str]:
        """The variables torchrun sets for this rank."""
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "ROLE_RANK": str(self.rank),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def detect_environment() -> ClusterEnvironment | None:
    """The environment set by torchrun (or by `launch_local_ranks`); None when this is a plain process."""
    env = os.environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in env]
    if missing:
        raise ValueError(f"RANK and WORLD_SIZE are set but {', '.join(missing)} not; set all of them or none")
    world_size = int(env["WORLD_SIZE"])
    return ClusterEnvironment(
        rank=int(env["RANK"]),
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        world_size=world_size,
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", world_size)),
        node_rank=int(env.get("GROUP_RANK", 0)),
        master_addr=env["MASTER_ADDR"],
        master_port=int(env["MASTER_PORT"]),
    )


def from_slurm(devices: int, num_nodes: int) -> ClusterEnvironment | None:
    """This task's rank under `srun` (slurm.py): one task per device is one rank; one task per node starts
    its node's `devices` ranks here. None when srun did not start this process."""
    task = slurm.detect()
    if task is None:
        return None
    placed = slurm.place(task, devices, num_nodes)
    if placed.local_ranks > 1:
        return launch_local_ranks(
            placed.local_ranks,
            node_rank=placed.node,
            num_nodes=num_nodes,
            master_addr=placed.master_addr,
            master_port=placed.master_port,
        )
    return ClusterEnvironment(
        placed.first_rank,
        placed.local_rank,
        placed.world_size,
        devices,
        placed.node,
        placed.master_addr,
        placed.master_port,
    )


def launch_local_ranks(
    num_ranks: int,
    node_rank: int = 0,
    num_nodes: int = 1,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
) -> ClusterEnvironment:
    """Start this node's ranks 1..num_ranks-1 by re-running this command; return local rank 0's environment. The
    node is `node_rank` of `num_nodes` of `num_ranks` ranks each (one node, unless a SLURM task per node starts its
    node's ranks), meeting at `master_addr`:`master_port` (a free port here when not given).

    The children run `sys.executable` with this process's original arguments (`python script.py ...` and
    `python -m pkg ...` both work) in the directory the command was started in (before any `os.chdir`).
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be at least 1, got {num_ranks}")
    if detect_environment() is not None or dist.is_initialized():
        raise RuntimeError("launch_local_ranks was called inside an already launched rank")
    if not sys.argv or sys.argv[0] == "":
        raise RuntimeError("cannot start ranks from an interactive session: run a script, or use torchrun")
    if "_pytest" in sys.modules and "pytest" in sys.argv[0]:
        raise RuntimeError("starting ranks would re-run pytest: send the test body to the rank pool instead")
    port = master_port or _free_port()
    first, world_size = node_rank * num_ranks, num_ranks * num_nodes
    envs = [
        ClusterEnvironment(first + r, r, world_size, num_ranks, node_rank, master_addr, port) for r in range(num_ranks)
    ]
    os.environ.update(envs[0].to_environ())
    if "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, _cpu_count() // num_ranks)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    command = [sys.executable, *sys.orig_argv[1:]]
    children = {}
    for env in envs[1:]:
        child_env = {**os.environ, **env.to_environ(), _PARENT_PID_VAR: str(os.getpid())}
        children[env.rank] = subprocess.Popen(command, env=child_env, cwd=_START_DIR, start_new_session=True)
    global _supervisor
    _supervisor = _Supervisor(children)
    _supervisor.start()
    _report_fatal_signals()
    return envs[0]


def forward_signal(signum: int) -> None:
    """In the process that started local ranks: send `signum` to each rank still running (not to their
    DataLoader workers, which their rank stops). Safe in a signal handler."""
    if _supervisor is not None:
        for p in _supervisor.children.values():
            if p.returncode is None:
                try:
                    os.kill(p.pid, signum)
                except ProcessLookupError:
                    pass


def _report_fatal_signals() -> None:
    """A rank ended by a fatal signal (an abort inside a communication library as a peer vanishes, say) prints
    every thread's Python stack first instead of disappearing silently."""
    if not faulthandler.is_enabled():
        faulthandler.enable(all_threads=True)


def init_process_group(env: ClusterEnvironment, backend: str, timeout: datetime.timedelta) -> bool:
    """Join the default process group described by `env`.

    Returns True when this call created it, False when it already existed (a test pool, or the user's own),
    in which case the caller must not destroy it.
    """
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (env.rank, env.world_size):
            raise RuntimeError(
                f"torch.distributed is already initialized as rank {dist.get_rank()} of"
                f" {dist.get_world_size()}, but the environment says rank {env.rank} of {env.world_size}"
            )
        return False
    host = f"[{env.master_addr}]" if ":" in env.master_addr else env.master_addr
    url = f"tcp://{host}:{env.master_port}"
    join_timeout = max(timeout, _JOIN_TIMEOUT)
    store, _, _ = next(dist.rendezvous(url, env.rank, env.world_size, timeout=join_timeout))
    # torchrun keeps its store when it restarts the workers (--max-restarts): without a prefix per attempt the
    # new group would read the dead group's addresses and fail to connect, as torch's own env:// init does.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"attempt{attempt}", store)
    # Ranks start seconds apart (importing torch); wait for all of them first, so that a short `timeout`
    # applies to collectives and not to the start.
    store.set(f"joined{env.rank}", "1")
    store.wait([f"joined{r}" for r in range(env.world_size)], join_timeout)
    dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
    # Destroyed at exit while the interpreter is whole: a gloo group left to finalization can abort the process
    # (SIGABRT, "terminate called without an active exception") after a run that succeeded.
    atexit.register(destroy_process_group_if_owned, True)
    return True


def destroy_process_group_if_owned(owned: bool) -> None:
    """Destroy the process groups if `init_process_group` created the default one. A group's gloo worker threads
    stop only when the last reference to it goes (the project holds groups weakly), so collect right away. Not
    when the process is ending on an uncaught error: a worker may then still wait on a stuck peer, and joining it
    would hold the exit until the collective's timeout."""
    failing = getattr(sys, "last_value", None) is not None  # set by the interpreter for an uncaught exception
    if owned and dist.is_initialized() and not failing:
        dist.destroy_process_group()
        gc.collect()


class _Supervisor:
    """Runs in rank 0: stops every child when any rank fails, and waits for the children at exit."""

    def __init__(self, children: dict[int, subprocess.Popen]) -> None:
        self.children = children
        self._lock = threading.Lock()
        self._stopped = False
        self._main_failing = False  # rank 0's own error is being reported: its excepthook stops the children

    def start(self) -> None:
        threading.Thread(target=self._watch, name="launcher-watchdog", daemon=True).start()
        atexit.register(self._wait_at_exit)
        previous_hook = sys.excepthook

        def excepthook(*exc_info) -> None:
            self._main_failing = True
            previous_hook(*exc_info)
            # rank 0 often raises because a peer died under it: name that rank as the cause
            failed = self._failed_children(_CAUSE_WAIT_S)
            causes = "".join(f" after rank {r} {_exit_reason(c)}" for r, c in failed.items())
            _log(f"rank 0 raised{causes}; stopping all ranks")
            self.stop()

        sys.excepthook = excepthook

    def stop(self) -> None:
        """Kill the children still running and reap them. SIGKILL, not SIGTERM: during fit a rank takes SIGTERM
        as preemption and would first try to finish its step with ranks that are failing."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            for p in self.children.values():
                if p.poll() is None:
                    _signal_group(p, signal.SIGKILL)
                    p.wait()

    def _failed_children(self, within: float) -> dict[int, int]:
        """Exit codes of the children that failed, waiting up to `within` seconds for one to show up."""
        deadline = time.monotonic() + within
        while True:
            failed = {rank: code for rank, p in self.children.items() if _failed(code := p.poll())}
            if failed or time.monotonic() >= deadline:
                return failed
            time.sleep(0.02)

    def _fail(self, rank: int, code: int) -> None:
        """A child failed while rank 0 was not failing itself: say so, stop the others, end rank 0 now."""
        if self._stopped or self._main_failing:
            return  # the codes of children we stopped ourselves are not news; rank 0's excepthook reports its own
        # The process's real stderr: while an exception is being reported, torch's excepthook has swapped
        # sys.stderr for a buffer that os._exit would discard (the run would end with code 1 and no message).
        _log(f"rank {rank} {_exit_reason(code)}; stopping all ranks", sys.__stderr__)
        self.stop()
        sys.stdout.flush()
        sys.__stderr__.flush()
        os._exit(1)

    def _watch(self) -> None:
        while not self._stopped:
            for rank, p in self.children.items():
                code = p.poll()
                if _failed(code):
                    self._fail(rank, code)
            time.sleep(_POLL_S)

    def _wait_at_exit(self) -> None:
        if self._stopped:
            return
        if dist.is_initialized():
            dist.destroy_process_group()  # a child still waiting for rank 0 in a collective fails, not hangs
        for p in self.children.values():
            p.wait()
        for rank, p in self.children.items():
            if _failed(p.returncode):
                self._fail(rank, p.returncode)


def _watch_parent() -> None:
    """In a child of `launch_local_ranks`: exit as soon as rank 0 (the parent process) is gone."""
    parent_pid = int(os.environ.pop(_PARENT_PID_VAR))  # popped so that our own subprocesses do not watch

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_POLL_S)
        _log(f"rank 0 (pid {parent_pid}) is gone; rank {os.environ.get('RANK')} exits")
        os._exit(1)

    threading.Thread(target=watch, name="launcher-parent-watch", daemon=True).start()


def _failed(code: int | None) -> bool:
    return code not in (None, 0, PREEMPTED_EXIT_CODE)


def _exit_reason(code: int) -> str:
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)  # the child leads its own group: this reaches its subprocesses too
    except (ProcessLookupError, PermissionError):
        pass


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _log(message: str, stream: TextIO | None = None) -> None:
    print(f"[launcher] {message}", file=stream or sys.stderr, flush=True)


if _PARENT_PID_VAR in os.environ:
    _watch_parent()
    _report_fatal_signals()
