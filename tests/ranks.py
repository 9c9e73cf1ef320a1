"""A pool of rank processes joined in a gloo process group, started once per test session.

Starting a process that imports torch costs seconds, so tests do not start ranks: they send a module-level
function (a test body) to the pool, every rank calls it, and `RankPool.run` returns the results by rank.

    results = rank_pool(2).run(body, tmp_path, steps=3)   # body(tmp_path, steps=3) on ranks 0 and 1

The workers set the torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, ...), so a Trainer built in a body
finds the environment and the already initialized process group and reuses both. After a failed call the
process group is rebuilt: a failing rank destroys its group at once, so that ranks waiting for it in a
collective fail too instead of hanging, and then every rank joins a new group. Ranks that still do not
answer `straggler_timeout` seconds after the first failure are killed, and the pool restarts at its next call.

Worker side: `python -m tests.ranks RANK WORLD_SIZE STORE_PORT CONN_FD PARENT_PID`.
"""

from __future__ import annotations

import atexit
import datetime
import importlib
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GROUP_TIMEOUT = datetime.timedelta(seconds=60)
# Eight workers importing torch on two busy cores can take minutes; a group joins only once all of them have.
_START_TIMEOUT = 300.0


class RankFailure(RuntimeError):
    """A call failed on some ranks. `tracebacks` and `exceptions` (None where not picklable) are by rank."""

    def __init__(self, message: str, tracebacks: dict[int, str], exceptions: dict[int, BaseException | None]):
        super().__init__(message)
        self.tracebacks = tracebacks
        self.exceptions = exceptions


class RankPool:
    """`world_size` worker processes in one gloo process group; `run` calls a function on all of them."""

    def __init__(self, world_size: int, call_timeout: float = 300.0, straggler_timeout: float = 20.0) -> None:
        self.world_size = world_size
        self.call_timeout = call_timeout
        self.straggler_timeout = straggler_timeout
        self._procs: list[subprocess.Popen] = []
        self._conns: list[Connection] = []
        self._store = None
        self._generation = 0
        atexit.register(self.close)

    def run(self, fn: Callable, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank; return the results in rank order or raise RankFailure."""
        if "<locals>" in fn.__qualname__ or fn.__module__ == "__main__":
            raise ValueError(f"{fn.__qualname__} must be a module-level function of an importable module")
        if not self._procs or any(proc.poll() is not None for proc in self._procs):
            self._kill()
            self._start()
        for conn in self._conns:
            conn.send(("call", (fn.__module__, fn.__qualname__, args, kwargs)))
        replies = self._collect(self.call_timeout)
        if all(reply[0] == "ok" for reply in replies.values()) and len(replies) == self.world_size:
            return [replies[rank][1] for rank in range(self.world_size)]
        raise self._failure(fn, replies)

    def close(self) -> None:
        """Stop the workers (they hold nothing worth a clean exit, and killing them is instant)."""
        self._kill()

    def _start(self) -> None:
        import torch.distributed as dist

        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=_GROUP_TIMEOUT)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
        for rank in range(self.world_size):
            parent_end, child_end = _socket_pair()
            args = (rank, self.world_size, self._store.port, child_end.fileno(), os.getpid())
            proc = subprocess.Popen(
                [sys.executable, "-m", "tests.ranks", *map(str, args)],
                cwd=ROOT,
                env=env,
                pass_fds=[child_end.fileno()],
                start_new_session=True,
            )
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
        imported = self._collect(_START_TIMEOUT)
        self._generation = -1  # the first group is generation 0
        if len(imported) < self.world_size or any(reply[0] != "ok" for reply in imported.values()):
            self._kill()
            raise RuntimeError(f"the rank pool of {self.world_size} did not import torch: {imported}")
        if not self._reset_group():
            self._kill()
            raise RuntimeError(f"the rank pool of {self.world_size} did not join a process group")

    def _collect(self, timeout: float) -> dict[int, tuple]:
        """Replies by rank; stop waiting `straggler_timeout` seconds after the first failure."""
        replies: dict[int, tuple] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        while pending:
            ready = wait(list(pending.values()), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            for rank in [r for r, conn in pending.items() if conn in ready]:
                try:
                    replies[rank] = pending.pop(rank).recv()
                except (EOFError, OSError):
                    code = self._procs[rank].wait()
                    replies[rank] = ("died", f"the worker process exited with code {code}\n", None)
                if replies[rank][0] != "ok":
                    deadline = min(deadline, time.monotonic() + self.straggler_timeout)
        return replies

    def _failure(self, fn: Callable, replies: dict[int, tuple]) -> RankFailure:
        tracebacks = {rank: reply[1] for rank, reply in replies.items() if reply[0] != "ok"}
        exceptions = {rank: _unpickle(replies[rank][2]) for rank in tracebacks}
        silent = [rank for rank in range(self.world_size) if rank not in replies]
        lines = [f"{fn.__module__}.{fn.__qualname__} failed on rank(s) {sorted(tracebacks)}"]
        lines += [f"--- rank {rank} ---\n{text}" for rank, text in sorted(tracebacks.items())]
        if silent or any(reply[0] == "died" for reply in replies.values()):
            if silent:
                lines.append(f"rank(s) {silent} did not answer within {self.straggler_timeout} s; restarting")
            self._kill()
        elif not self._reset_group():
            self._kill()
        return RankFailure("\n".join(lines), tracebacks, exceptions)

    def _reset_group(self) -> bool:
        """Rebuild the process group on all ranks; False if that did not work."""
        self._generation += 1
        for conn in self._conns:
            conn.send(("reset", self._generation))
        replies = self._collect(_GROUP_TIMEOUT.total_seconds())
        return len(replies) == self.world_size and all(reply[0] == "ok" for reply in replies.values())

    def _kill(self) -> None:
        for proc in self._procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()
        for conn in self._conns:
            conn.close()
        self._procs, self._conns, self._store = [], [], None


def _socket_pair() -> tuple[Connection, Connection]:
    import socket

    a, b = socket.socketpair()
    return Connection(a.detach()), Connection(b.detach())


def _unpickle(data: bytes | None) -> BaseException | None:
    try:
        return pickle.loads(data) if data is not None else None
    except Exception:
        return None


# ---------------------------------------------------------------- worker side


def _init_group(store, rank: int, world_size: int, generation: int) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    prefixed = dist.PrefixStore(f"generation{generation}", store)
    dist.init_process_group("gloo", store=prefixed, rank=rank, world_size=world_size, timeout=_GROUP_TIMEOUT)


def _call(module: str, qualname: str, args: tuple, kwargs: dict) -> tuple:
    environment = dict(os.environ)  # as the next body finds it, whatever this one's libraries set (Lightning's)
    try:
        fn: Any = importlib.import_module(module)
        for name in qualname.split("."):
            fn = getattr(fn, name)
        return ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # a body's SystemExit or KeyboardInterrupt is a failure too
        try:
            exc_bytes = pickle.dumps(exc)
        except Exception:
            exc_bytes = None
        text = traceback.format_exc()
        _abandon_group()
        return ("error", text, exc_bytes)
    finally:
        os.chdir(ROOT)
        restore_environment(environment)


def restore_environment(environment: dict[str, str]) -> None:
    """Put back what changed since `environment` was taken, touching only those variables: the process has other
    threads (gloo's), and a C-level getenv racing a wholesale clear of the environment can crash."""
    for name in set(os.environ) - set(environment):
        del os.environ[name]
    for name, value in environment.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _abandon_group() -> None:
    """Destroy the group: ranks still waiting for this one in a collective then fail at once, not hang."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _worker(rank: int, world_size: int, store_port: int, conn_fd: int, parent_pid: int) -> None:
    _exit_with_parent(parent_pid)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store_port),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    conn = Connection(conn_fd)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=_GROUP_TIMEOUT)
    conn.send(("ok", None))  # imported; the pool sends the first "reset" once every rank has
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:
            return  # the pool closed the connection
        if kind == "reset":
            _init_group(store, rank, world_size, payload)
            conn.send(("ok", None))
        else:
            _send_reply(conn, _call(*payload))


def _send_reply(conn: Connection, reply: tuple) -> None:
    try:
        # Plain pickle, not Connection.send: torch registers reducers with multiprocessing's pickler that
        # pass tensors as shared-memory file descriptors, which an unrelated process cannot receive.
        conn.send_bytes(pickle.dumps(reply))  # pickles the whole reply before writing anything
    except Exception:
        conn.send(("error", f"the result could not be sent back:\n{traceback.format_exc()}", None))


if __name__ == "__main__":
    _worker(*(int(a) for a in sys.argv[1:6]))
