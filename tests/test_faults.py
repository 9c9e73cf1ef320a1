"""Faults injected for real into real processes (tests/scripts/fault_train.py): torchrun restarting a group whose
rank was killed in training and then in the middle of a checkpoint save, a killed rank and a hanging rank under
the Trainer's own launcher, a lost node under torchrun, and preemption: SIGTERM to the launcher (which forwards
it) or to one rank makes every rank finish its optimizer step, save `<checkpoint dir>/preempted` and exit naming
the signal, and `fit(ckpt_path="last")` resumes from it exactly; SIGINT still ends every rank at once.

Every command is started at once by the module fixture `jobs` (importing torch costs seconds per process here);
each test waits for its own. The run they are compared with is trained on the rank pool meanwhile.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.ranks import ROOT
from tests.scripts import fault_train
from tests.test_launcher import Job, _alive, _free_port
from trainer import checkpoint as ckpt_io

pytestmark = pytest.mark.distributed  # the tests here start processes (nearly all of them)

SCRIPT = os.path.join(ROOT, "tests", "scripts", "fault_train.py")
TIMEOUT = 5  # Trainer(timeout=...) in the jobs that wait for a lost rank
PREEMPTED_CODE = 128 + signal.SIGTERM


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("faults")
    two_nodes = tmp / "two_nodes"
    two_nodes.mkdir()
    node = torchrun(
        "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(_free_port())
    )
    lost_node = [SCRIPT, "--root", str(two_nodes), "--fault", "kill:2:1", "--timeout", str(TIMEOUT)]
    commands = {
        # README's fault-tolerant command line; rank 1 dies after step 5, then rank 0 while saving step 9
        "restarts": [
            *torchrun(
                "--nnodes",
                "1",
                "--nproc-per-node",
                "2",
                "--max-restarts",
                "2",
                "--rdzv-backend",
                "c10d",
                "--rdzv-endpoint",
                f"127.0.0.1:{_free_port()}",
            ),
            SCRIPT,
            "--root",
            str(tmp / "restarts"),
            "--fault",
            "kill:5:1",
            "--fault",
            "save:9:0",
        ],
        "killed": [sys.executable, SCRIPT, "--root", str(tmp / "killed"), "--fault", "kill:2:1"],
        "hangs": [
            sys.executable,
            SCRIPT,
            "--root",
            str(tmp / "hangs"),
            "--fault",
            "hang:2:1",
            "--timeout",
            str(TIMEOUT),
        ],
        # under ddp the first collective of a step is the ranks' agreement after training_step
        "hangs-ddp": [
            sys.executable,
            SCRIPT,
            "--root",
            str(tmp / "hangs-ddp"),
            "--fault",
            "hang:2:1",
            "--timeout",
            str(TIMEOUT),
            "--strategy",
            "ddp",
        ],
        "node0": [*node, "--node-rank", "0", *lost_node],
        "node1": [*node, "--node-rank", "1", *lost_node],
        # rank 0 pauses after step 3 while a thread sends it the signal, as a cluster or Ctrl-C would
        "sigterm": [sys.executable, SCRIPT, "--root", str(tmp / "sigterm"), "--fault", "pause:3:0"],
        "sigint": [sys.executable, SCRIPT, "--root", str(tmp / "sigint"), "--fault", "pause:3:0"],
    }
    started = {name: Job(argv, tmp / name) for name, argv in commands.items()}
    for name, sig in (("sigterm", signal.SIGTERM), ("sigint", signal.SIGINT)):
        threading.Thread(target=_signal_when_paused, args=(tmp / name, sig), daemon=True).start()
    yield started
    for job in started.values():
        job.kill()


def _uninterrupted_body(root: str, faults: tuple[str, ...] = ()) -> None:
    before = torch.are_deterministic_algorithms_enabled()
    try:
        fault_train.train(root, faults=list(faults))
    finally:
        torch.use_deterministic_algorithms(before)


def _signal_when_paused(root: Path, sig: signal.Signals) -> None:
    """Send `sig` to rank 0 once it pauses after step 3 (writing the time to root/signal_at), then let it go on."""
    deadline = time.monotonic() + 240
    while not (root / "paused").exists():
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    os.kill(int((root / "rank0.pid").read_text()), sig)
    (root / "signal_at").write_text(repr(time.time()))
    (root / "resume").touch()


@pytest.fixture(scope="module")
def uninterrupted(jobs, rank_pool, tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of the same training at the same world size, never interrupted."""
    root = tmp_path_factory.mktemp("uninterrupted")
    rank_pool(2).run(_uninterrupted_body, str(root))
    return ckpt_io.load_full_state_dict(root / "final.pt")


def _starts(root: Path) -> list[tuple[int, str]]:
    """(global step, checkpoint) each attempt started training from."""
    lines = (root / "starts.log").read_text().splitlines()
    return [(int(step), os.path.basename(path)) for step, path in (line.split(" ", 1) for line in lines)]


def _assert_no_survivors(root: Path) -> None:
    pids = [int((root / f"rank{r}.pid").read_text()) for r in range(2)]
    assert not [pid for pid in pids if _alive(pid)], "rank processes survived the job"


def _seconds(root: Path, since: str, until: str) -> float:
    return float((root / until).read_text()) - float((root / since).read_text())


# -- torchrun --max-restarts ----------------------------------------------------------------------------------
def test_torchrun_restarts_a_killed_group_and_training_ends_with_the_uninterrupted_weights(jobs, uninterrupted):
    code, _, err = jobs["restarts"].result(timeout=300)
    assert code == 0, err[-5000:]
    root = jobs["restarts"].workdir
    assert _starts(root) == [(0, "None"), (3, "epoch=0-step=3"), (6, "epoch=0-step=6")]
    assert "rank 0 failed at global step 5, epoch 0, batch 5" in err  # the survivor, before torchrun restarted

    final = torch.load(root / "final.pt")  # a full checkpoint: one plain file
    assert final["trainer"]["state"]["global_step"] == 10 and final["meta"]["world_size"] == 2
    assert list(final["model"]) == list(uninterrupted)
    for name, tensor in uninterrupted.items():
        assert torch.equal(final["model"][name], tensor), name


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_which_is_resumed(jobs):
    code, _, err = jobs["restarts"].result(timeout=300)
    assert code == 0, err[-5000:]
    ckpts = jobs["restarts"].workdir / "ckpts"
    staging = (jobs["restarts"].workdir / "staging_at_fault").read_text().split()  # what the killed save left
    assert "__0_0.distcp" in staging and "meta.json" not in staging
    # The previous one was intact: the restart resumed from it (a resume verifies every file's checksum).
    assert _starts(jobs["restarts"].workdir)[-1] == (6, "epoch=0-step=6")
    assert ckpt_io.find_last(str(ckpts)) == str(ckpts / "epoch=1-step=9")  # saved again after the restart
    # save_top_k=1 across restarts: the checkpoints resumed from and the killed save's staging folder are gone
    assert os.listdir(ckpts) == ["epoch=1-step=9"]


# -- the Trainer's own launcher -------------------------------------------------------------------------------
def test_a_killed_rank_ends_every_rank_within_seconds(jobs):
    job = jobs["killed"]
    code, _, err = job.result(timeout=150)
    assert code != 0
    # Rank 0 names the dead rank when it exits by itself; once under heavy load it was instead ended by a signal
    # inside gloo (code < 0) as its peer vanished: still a fast exit, checked below, and since then the launcher's
    # fault handler prints where a fatal signal struck.
    if code > 0:
        assert re.search(r"\[launcher\] .*rank 1 was killed by SIGKILL", err), err[-3000:]
    elif -code in (signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL):
        assert "Fatal Python error" in err, err[-3000:]
    assert job.ended - float((job.workdir / "fault_at").read_text()) < 10
    _assert_no_survivors(job.workdir)


def test_a_hanging_rank_makes_the_others_fail_at_the_timeout_naming_the_step_and_unit(jobs):
    job = jobs["hangs"]
    code, _, err = job.result(timeout=150)
    assert code != 0
    assert "rank 0 failed at global step 2, epoch 0, batch 2: " in err and "Timed out" in err, err[-3000:]
    assert re.search(r"batch 2: all-gather of the parameters of unit '[^']+': ", err), err[-3000:]  # the unit
    assert TIMEOUT - 0.5 < _seconds(job.workdir, "fault_at", "failed_at.rank0") < TIMEOUT + 5
    _assert_no_survivors(job.workdir)


def test_a_timeout_in_the_ranks_agreement_after_training_step_names_it(jobs):
    code, _, err = jobs["hangs-ddp"].result(timeout=150)
    assert code != 0
    assert re.search(
        r"rank 0 failed at global step 2, epoch 0, batch 2: all-reduce of the ranks' agreement after "
        r"training_step \(.*\): .*Timed out",
        err,
    ), err[-3000:]


# -- a lost node under torchrun -------------------------------------------------------------------------------
def test_when_a_node_is_lost_the_other_fails_within_the_timeout_naming_the_step(jobs):
    node0, node1 = jobs["node0"].result(timeout=150), jobs["node1"].result(timeout=150)
    assert node1[0] != 0 and node0[0] != 0
    assert "rank 0 failed at global step 2, epoch 0, batch 2: " in node0[2], node0[2][-3000:]
    assert _seconds(jobs["node0"].workdir.parent / "two_nodes", "fault_at", "failed_at.rank0") < TIMEOUT


# -- preemption -----------------------------------------------------------------------------------------------
def _assert_resumes_exactly(rank_pool, root: Path, uninterrupted: dict[str, torch.Tensor]) -> None:
    rank_pool(2).run(_uninterrupted_body, str(root))  # fit(ckpt_path="last") picks the newest: preempted
    assert _starts(root)[-1] == (4, "preempted")
    final = ckpt_io.load_full_state_dict(root / "final.pt")
    for name, tensor in uninterrupted.items():
        assert torch.equal(final[name], tensor), name


def test_sigterm_to_the_launcher_saves_on_every_rank_and_the_run_resumes_exactly(jobs, rank_pool, uninterrupted):
    code, _, err = jobs["sigterm"].result(timeout=150)
    root = jobs["sigterm"].workdir
    assert code == PREEMPTED_CODE, err[-3000:]
    for rank in (0, 1):  # rank 0 was paused after step 3 when the signal came, so both finished step 4
        assert f"rank {rank}: SIGTERM received; stopped after global step 4" in err, err[-3000:]
    assert "Traceback" not in err and "[launcher]" not in err, err[-3000:]  # no rank failed
    assert ckpt_io.read_meta(str(root / "ckpts" / "preempted"))["global_step"] == 4
    _assert_no_survivors(root)
    _assert_resumes_exactly(rank_pool, root, uninterrupted)


def _sigterm_to_rank_1_body(root: str) -> tuple[int, str] | None:
    """Rank 1 alone receives SIGTERM after step 3 (under torchrun each rank gets its own)."""
    try:
        _uninterrupted_body(root, faults=("term:3:1",))
    except SystemExit as stop:  # trainer.launch.preemption.Preempted
        return stop.code, str(stop)
    return None


def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step(rank_pool, tmp_path, uninterrupted):
    for code, message in rank_pool(2).run(_sigterm_to_rank_1_body, str(tmp_path)):
        assert code == PREEMPTED_CODE
        assert "SIGTERM received; stopped after global step 4" in message and "ckpt_path='last'" in message
    assert ckpt_io.read_meta(str(tmp_path / "ckpts" / "preempted"))["global_step"] == 4
    _assert_resumes_exactly(rank_pool, tmp_path, uninterrupted)


def test_sigint_to_the_launcher_still_ends_every_rank_at_once(jobs):
    code, _, err = jobs["sigint"].result(timeout=150)
    root = jobs["sigint"].workdir
    assert code != 0 and "KeyboardInterrupt" in err, err[-3000:]
    assert jobs["sigint"].ended - float((root / "signal_at").read_text()) < 10
    assert not (root / "ckpts" / "preempted").exists()
    _assert_no_survivors(root)
