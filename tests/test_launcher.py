"""Launching ranks with real processes: local ranks, failing ranks, two torchrun nodes, the test rank pool.

Importing torch takes seconds here, so the module fixture `jobs` starts every launcher command at once and
each test waits for its own.
"""

import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.ranks import ROOT, RankFailure
from trainer import Trainer
from trainer.launch import launcher, slurm
from trainer.launch.launcher import ClusterEnvironment, detect_environment, init_process_group

pytestmark = pytest.mark.distributed  # the tests here start processes (nearly all of them)

SCRIPT = os.path.join(ROOT, "tests", "scripts", "allreduce.py")
RANK_VARS = "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT".split()


class Job:
    """A command in its own session with its output in files; the time it ended is recorded."""

    def __init__(self, argv: list[str], workdir: Path, extra_env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        workdir.mkdir()
        env = {k: v for k, v in os.environ.items() if k not in RANK_VARS and not k.startswith("SLURM_")}
        env.update(extra_env or {})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
        with open(workdir / "stdout", "w") as out, open(workdir / "stderr", "w") as err:
            self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)
        self.ended: float | None = None
        self._waiter = threading.Thread(target=self._wait, daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        self.proc.wait()
        self.ended = time.time()

    def result(self, timeout: float = 90) -> tuple[int, str, str]:
        """(exit code, stdout, stderr); the job is killed and the test fails if it runs past `timeout`."""
        self._waiter.join(timeout)
        if self.ended is None:
            self.kill()
            pytest.fail(f"{self.proc.args} still running after {timeout} s:\n{self.read('stderr')}")
        return self.proc.returncode, self.read("stdout"), self.read("stderr")

    def read(self, name: str) -> str:
        return (self.workdir / name).read_text()

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("launcher")
    python, port = sys.executable, _free_port()
    torchrun = [python, "-m", "torch.distributed.run", *"--nnodes 2 --nproc-per-node 1".split()]
    torchrun += ["--master-addr", "127.0.0.1", "--master-port", str(port)]
    commands = {
        "two_ranks": [python, SCRIPT, "--devices", "2"],
        "chdir": [python, os.path.relpath(SCRIPT, ROOT), "--devices", "2", "--chdir", str(tmp)],  # run from ROOT
        "trainer_exit": [python, os.path.join(ROOT, "tests", "scripts", "trainer_exit.py"), "--root", str(tmp / "te")],
        "rank1_raises": [python, "-m", "tests.scripts.allreduce", "--devices", "2", "--fail-rank", "1"],
        "rank0_raises": [python, SCRIPT, "--devices", "2", "--fail-rank", "0"],
        "node0": [*torchrun, "--node-rank", "0", SCRIPT],
        "node1": [*torchrun, "--node-rank", "1", SCRIPT],
    }
    started = {}
    for name, argv in commands.items():
        workdir = tmp / name
        if "--devices" in argv:
            argv = [*argv, "--pid-dir", str(workdir)]
        started[name] = Job(argv, workdir)
    yield started
    for job in started.values():
        job.kill()


@pytest.fixture(scope="module")
def srun_jobs(tmp_path_factory: pytest.TempPathFactory):
    """The tasks `srun` would start, with srun's variables, on this machine: 2 tasks of a Trainer(devices=2) on one
    node (one task per device), and 2 "nodes" of one task each starting its 2 local ranks (one task per node).
    Started when the first test asks, after the jobs above (2 cores: more processes at once only wait longer)."""
    tmp, python = tmp_path_factory.mktemp("srun"), sys.executable
    jobs = _srun_jobs(tmp, python)
    yield jobs
    for job in jobs.values():
        job.kill()


def _srun_jobs(tmp: Path, python: str) -> dict[str, Job]:
    job_id, port = _job_id_with_a_free_port()
    common = {"SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "train.py", "SLURM_JOB_NODELIST": "localhost"}
    jobs = {}
    for task in (0, 1):
        per_device = {
            **common,
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "2",
            "SLURM_PROCID": str(task),
            "SLURM_LOCALID": str(task),
            "SLURM_NODEID": "0",
        }
        argv = [
            python,
            os.path.join(ROOT, "tests", "scripts", "trainer_ranks.py"),
            "--devices",
            "2",
            "--root",
            str(tmp / "srun_trainer"),
        ]
        jobs[f"srun_per_device{task}"] = Job(argv, tmp / f"srun_per_device{task}", per_device)
    job_id2, _ = _job_id_with_a_free_port(avoid=port)
    for node in (0, 1):
        per_node = {
            **common,
            "SLURM_JOB_ID": job_id2,
            "SLURM_NTASKS": "2",
            "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_PROCID": str(node),
            "SLURM_LOCALID": "0",
            "SLURM_NODEID": str(node),
            "SLURM_NNODES": "2",
        }
        argv = [python, SCRIPT, "--devices", "2", "--num-nodes", "2"]
        jobs[f"srun_per_node{node}"] = Job(argv, tmp / f"srun_per_node{node}", per_node)
    return jobs


def _job_id_with_a_free_port(avoid: int = 0) -> tuple[str, int]:
    """A SLURM job id whose port (15000 + its last 4 digits, Lightning's rule) is free here."""
    for offset in range(os.getpid() % 5000, 10000):
        port = 15000 + offset
        if port == avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return f"77{offset:04d}", port
    raise RuntimeError("no free port for the SLURM job")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _assert_no_survivors(job: Job, ranks: int) -> None:
    pids = [int((job.workdir / f"rank{r}.pid").read_text()) for r in range(ranks)]
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], "rank processes survived the job"


def test_plain_command_starts_local_ranks(jobs):
    code, out, err = jobs["two_ranks"].result()
    assert code == 0, err
    assert "rank 0 of 2 on node 0: sum 3" in out and "rank 1 of 2 on node 0: sum 3" in out
    # every rank destroys the group it created before the interpreter shuts down: a gloo group left to
    # interpreter finalization can abort the process (SIGABRT, "terminate called without an active exception")
    assert out.count("at exit: process group destroyed True") == 2, out
    _assert_no_survivors(jobs["two_ranks"], 2)


def test_a_script_that_changes_directory_before_starting_ranks(jobs):
    code, out, err = jobs["chdir"].result()
    assert code == 0, err
    assert "rank 0 of 2 on node 0: sum 3" in out and "rank 1 of 2 on node 0: sum 3" in out


def test_a_trainer_script_leaves_no_gloo_thread_running_into_interpreter_shutdown(jobs):
    code, out, err = jobs["trainer_exit"].result()
    assert code == 0, err
    before = [int(n) for n in re.findall(r"gloo threads before exit (\d+)", out)]
    assert len(before) == 2 and min(before) > 0, out  # the groups were running
    assert out.count("at exit: gloo threads 0") == 2, out


@pytest.mark.parametrize("failing", [1, 0])
def test_a_raising_rank_ends_every_rank(jobs, failing):
    job = jobs[f"rank{failing}_raises"]
    code, out, err = job.result()
    assert code != 0
    assert "sum 3" in out  # both ranks were up before the failure
    assert f"ValueError: boom from rank {failing}" in err
    failed_at = float(job.read("failed_at"))
    assert job.ended - failed_at < 15, "the other rank was not stopped promptly"
    _assert_no_survivors(job, 2)


def test_two_torchrun_nodes(jobs):
    for node in (0, 1):
        code, out, err = jobs[f"node{node}"].result()
        assert code == 0, err
        assert f"rank {node} of 2 on node {node}: sum 3" in out
        assert "at exit: process group destroyed True" in out, out


def test_srun_one_task_per_device_makes_each_task_one_rank(srun_jobs):
    outputs = [srun_jobs[f"srun_per_device{task}"].result() for task in (0, 1)]
    for code, _, err in outputs:
        assert code == 0, err
    lines = sorted(line for _, out, _ in outputs for line in out.splitlines() if line.startswith("rank "))
    assert [line.split(":")[0] for line in lines] == ["rank 0 of 2, local rank 0", "rank 1 of 2, local rank 1"]
    assert len({line.split("weights")[1] for line in lines}) == 1  # one job: the same weights on both ranks


def test_srun_one_task_per_node_starts_each_nodes_ranks(srun_jobs):
    outputs = [srun_jobs[f"srun_per_node{node}"].result() for node in (0, 1)]
    for code, _, err in outputs:
        assert code == 0, err
    for node, (_, out, _) in enumerate(outputs):
        for rank in (2 * node, 2 * node + 1):
            assert f"rank {rank} of 4 on node {node}: sum 10" in out, out


@pytest.mark.parametrize("tasks, per_node, devices, num_nodes", [(3, "3", 2, 1), (4, "2(x2)", 2, 1), (2, "1", 4, 1)])
def test_an_srun_task_count_that_does_not_fit_is_refused(monkeypatch, tasks, per_node, devices, num_nodes):
    for name in RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    slurm_env = dict(
        SLURM_NTASKS=str(tasks),
        SLURM_NTASKS_PER_NODE=per_node,
        SLURM_PROCID="0",
        SLURM_LOCALID="0",
        SLURM_NODEID="0",
        SLURM_JOB_NODELIST="node[01-02]",
        SLURM_NNODES="1",
        SLURM_JOB_ID="4321",
    )
    for name, value in slurm_env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(launcher, "launch_local_ranks", lambda *a, **k: pytest.fail("ranks were started"))
    with pytest.raises(ValueError, match=rf"SLURM_NTASKS={tasks}.*devices={devices} x num_nodes={num_nodes}"):
        Trainer(devices=devices, num_nodes=num_nodes, logger=False, enable_checkpointing=False)


def test_srun_environment_and_node_lists():
    assert slurm.expand_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert slurm.expand_nodelist("r[1-2]-n[08-09]") == ["r1-n08", "r1-n09", "r2-n08", "r2-n09"]
    env = dict(
        SLURM_NTASKS="8",
        SLURM_NTASKS_PER_NODE="4(x2)",
        SLURM_PROCID="5",
        SLURM_LOCALID="1",
        SLURM_NODEID="1",
        SLURM_JOB_NODELIST="gpu[07-08]",
        SLURM_JOB_ID="123456",
    )
    task = slurm.detect(env)
    assert (task.task, task.tasks, task.local_task, task.node, task.nodes, task.tasks_per_node) == (5, 8, 1, 1, 2, 4)
    assert (task.master_addr, task.master_port) == ("gpu07", 15000 + 3456)
    assert slurm.place(task, devices=4, num_nodes=2) == slurm.Placement(5, 1, 1, 8, 1, "gpu07", 18456)
    per_node = slurm.detect(
        {**env, "SLURM_NTASKS": "2", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}
    )
    assert slurm.place(per_node, devices=4, num_nodes=2) == slurm.Placement(4, 0, 4, 8, 1, "gpu07", 18456)
    assert slurm.detect({**env, "SLURM_JOB_NAME": "bash"}) is None  # salloc, then python in the shell
    assert slurm.detect({}) is None


def test_detect_environment(monkeypatch):
    for name in RANK_VARS:
        monkeypatch.delenv(name, raising=False)
    assert detect_environment() is None
    values = dict(RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", GROUP_RANK="1")
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT"):
        detect_environment()
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1234")
    assert detect_environment() == ClusterEnvironment(3, 1, 4, 2, 1, "10.0.0.1", 1234)


# ------------------------------------------------------------------- the rank pool (tests/ranks.py)


def body_all_reduce(offset: float) -> tuple[float, bool]:
    """Sum of (rank + offset) over ranks, and whether init_process_group created a group (it must not)."""
    owned = init_process_group(detect_environment(), "gloo", datetime.timedelta(seconds=10))
    total = torch.tensor([dist.get_rank() + offset])
    dist.all_reduce(total)
    return total.item(), owned


def body_raise_on(rank: int, others: str) -> None:
    if dist.get_rank() == rank:
        raise ValueError(f"boom on rank {rank}")
    if others == "barrier":
        dist.barrier()  # the raising rank never gets here
    elif others == "sleep":
        time.sleep(60)


def test_pool_runs_a_body_on_every_rank(rank_pool):
    assert rank_pool(2).run(body_all_reduce, 1.0) == [(3.0, False), (3.0, False)]


@pytest.mark.parametrize("others", ["return", "barrier"])
def test_pool_names_the_failing_rank_and_keeps_working(rank_pool, others):
    pool = rank_pool(2)
    with pytest.raises(RankFailure, match=r"failed on rank") as info:
        pool.run(body_raise_on, 1, others)
    assert "ValueError: boom on rank 1" in str(info.value)
    assert isinstance(info.value.exceptions[1], ValueError)
    if others == "return":
        assert sorted(info.value.tracebacks) == [1]
    else:  # rank 0 waited for rank 1 in a barrier: that failed too, as soon as rank 1 gave up its group
        assert "by peer" in info.value.tracebacks[0]  # gloo: "Connection closed/reset by peer"
    assert pool.run(body_all_reduce, 0.0) == [(1.0, False), (1.0, False)]


def test_pool_restarts_when_ranks_are_stuck(rank_pool):
    pool = rank_pool(2)
    pool.straggler_timeout = 1.0
    try:
        with pytest.raises(RankFailure, match=r"rank\(s\) \[0\] did not answer"):
            pool.run(body_raise_on, 1, "sleep")
    finally:
        pool.straggler_timeout = 20.0
    assert pool.run(body_all_reduce, 0.0) == [(1.0, False), (1.0, False)]
