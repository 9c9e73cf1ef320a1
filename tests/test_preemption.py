"""Preemption with real signals (tests/scripts/fault_train.py): SIGTERM to the launcher (which forwards it) or to
one rank makes every rank finish the current optimizer step, save `<checkpoint dir>/preempted` and exit naming the
signal; `fit(ckpt_path="last")` then resumes from it and ends with the weights of a run never interrupted. SIGINT
(Ctrl-C) still ends every rank at once, without a checkpoint.

The launched jobs start at once in the module fixture `jobs` (importing torch costs seconds per process here);
rank 0 pauses after step 3 until the test has sent its signal.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.ranks import ROOT
from tests.scripts import fault_train
from tests.test_faults import _assert_no_survivors, _starts
from tests.test_launcher import Job
from trainer import checkpoint as ckpt_io

SCRIPT = os.path.join(ROOT, "tests", "scripts", "fault_train.py")
PREEMPTED_CODE = 128 + signal.SIGTERM


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("preemption")
    started = {name: Job([sys.executable, SCRIPT, "--root", str(tmp / name), "--fault", "pause:3:0"], tmp / name)
               for name in ("sigterm", "sigint")}
    yield started
    for job in started.values():
        job.kill()


def _train_body(root: str, faults: tuple[str, ...] = ()) -> None:
    before = torch.are_deterministic_algorithms_enabled()
    try:
        fault_train.train(root, faults=list(faults))
    finally:
        torch.use_deterministic_algorithms(before)


@pytest.fixture(scope="module")
def uninterrupted(jobs, rank_pool, tmp_path_factory) -> dict[str, torch.Tensor]:
    root = tmp_path_factory.mktemp("uninterrupted")
    rank_pool(2).run(_train_body, str(root))
    return ckpt_io.load_full_state_dict(root / "final.pt")


def _signal_when_paused(root: Path, sig: signal.Signals, rank: int = 0) -> float:
    """Send `sig` to rank `rank` while rank 0 waits after step 3, then let it go on; returns the time sent."""
    deadline = time.monotonic() + 120
    while not (root / "paused").exists():
        assert time.monotonic() < deadline, "the job never reached step 3"
        time.sleep(0.05)
    os.kill(int((root / f"rank{rank}.pid").read_text()), sig)
    sent = time.time()
    (root / "resume").touch()
    return sent


def _assert_resumes_exactly(rank_pool, root: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    rank_pool(2).run(_train_body, str(root))  # fit(ckpt_path="last") picks the newest: preempted
    assert _starts(root)[-1] == (4, "preempted")
    final = ckpt_io.load_full_state_dict(root / "final.pt")
    for name, tensor in uninterrupted.items():
        assert torch.equal(final[name], tensor), name


def test_sigterm_to_the_launcher_saves_on_every_rank_and_the_run_resumes_exactly(jobs, rank_pool, uninterrupted):
    root = jobs["sigterm"].workdir
    _signal_when_paused(root, signal.SIGTERM)
    code, _, err = jobs["sigterm"].result(timeout=120)
    assert code == PREEMPTED_CODE, err[-3000:]
    for rank in (0, 1):
        assert f"rank {rank}: SIGTERM received; stopped after global step 4" in err, err[-3000:]
    assert "Traceback" not in err and "[launcher]" not in err, err[-3000:]  # no rank failed
    assert ckpt_io.read_meta(str(root / "ckpts" / "preempted"))["global_step"] == 4
    _assert_no_survivors(root)
    _assert_resumes_exactly(rank_pool, root, uninterrupted)


def _sigterm_to_rank_1_body(root: str) -> tuple[int, str] | None:
    """Rank 1 alone receives SIGTERM after step 3 (torchrun ranks each get their own)."""
    try:
        _train_body(root, faults=("term:3:1",))
    except SystemExit as stop:  # trainer.preemption.Preempted
        return stop.code, str(stop)
    return None


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(rank_pool, tmp_path, uninterrupted):
    results = rank_pool(2).run(_sigterm_to_rank_1_body, str(tmp_path))
    for code, message in results:
        assert code == PREEMPTED_CODE
        assert "SIGTERM received; stopped after global step 4" in message and "ckpt_path='last'" in message
    assert ckpt_io.read_meta(str(tmp_path / "ckpts" / "preempted"))["global_step"] == 4
    _assert_resumes_exactly(rank_pool, tmp_path, uninterrupted)


def test_sigint_to_the_launcher_still_ends_every_rank_at_once(jobs):
    root = jobs["sigint"].workdir
    sent = _signal_when_paused(root, signal.SIGINT)
    code, _, err = jobs["sigint"].result(timeout=120)
    assert code != 0 and "KeyboardInterrupt" in err, err[-3000:]
    assert jobs["sigint"].ended - sent < 10
    assert not (root / "ckpts" / "preempted").exists()
    _assert_no_survivors(root)
