"""Preemption: clusters send SIGTERM some time before they take a machine away (SLURM, Kubernetes).

During fit a SIGTERM does not end the process at once: the handler only notes it (and, in the process that started
the local ranks, passes it on to them). The ranks tell each other in the all-reduce after each training_step
(trainer/loop/agreement.py), so they stop together even when one rank alone got the signal: each finishes the
optimizer step it is in, saves `<checkpoint dir>/preempted` like any other checkpoint, and leaves fit with
`Preempted`, which ends the process with code 128 + the signal's number unless caught. `fit(ckpt_path="last")`
resumes from it.
SIGINT (Ctrl-C) is left alone: it ends the process at once, as always.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

from . import launcher


class Preempted(SystemExit):
    """fit stopped on a signal after saving a checkpoint. A SystemExit: uncaught, it ends the process quietly with
    code 128 + the signal's number (the message is printed before it is raised)."""

    def __init__(self, message: str, signum: int) -> None:
        super().__init__(128 + signum)
        self.message, self.signum = message, signum

    def __str__(self) -> str:
        return self.message


class SignalWatch:
    """Within `with watch:` a SIGTERM is remembered in `received` instead of ending the process (main thread
    only: Python runs signal handlers there). The previous handler comes back when the block ends, unless it
    ends with an error (not Preempted): then SIGTERM stays noted for the rest of the process."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: Any = None
        self._pid = 0

    def __enter__(self) -> SignalWatch:
        self.received = None
        if threading.current_thread() is threading.main_thread():
            self._pid = os.getpid()
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: Any) -> None:
        if exc_type is not None and not issubclass(exc_type, Preempted):
            # fit failed and the process is likely on its way out, with its traceback yet to print: torchrun sends
            # SIGTERM to the surviving ranks of a failed group, and it must not cut that traceback short.
            return
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            return  # a forked DataLoader worker: the rank it works for stops it
        self.received = signum
        launcher.forward_signal(signum)


def stop(rank: int, signum: int, step: int, path: str) -> Preempted:
    """The exception that ends fit after the checkpoint at `path` was saved; its message is printed now."""
    message = (
        f"rank {rank}: {signal.Signals(signum).name} received; stopped after global step {step} and saved "
        f"{path}. Resume with trainer.fit(..., ckpt_path='last')."
    )
    print(f"[trainer] {message}", file=sys.stderr, flush=True)
    return Preempted(message, signum)
