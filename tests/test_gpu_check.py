"""benchmarks/gpu_check.py, the one command that checks the CUDA/nccl path. Its CUDA run needs a GPU (skipped
here without one); on CPU the same code runs at tiny sizes, so a change that breaks the check shows up in CI and
not first on a GPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.distributed  # the tests here start processes (nearly all of them)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_check(*args: str, timeout: int) -> tuple[int, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    return done.returncode, done.stdout + done.stderr


def test_the_gpu_check_runs_on_cpu_and_every_check_holds():
    """Parts that cover the engine on both one-rank paths, two ranks sharing a device (every strategy, tensor
    parallel, a checkpoint of two ranks resumed on one), checkpoints and the trace reader, at tiny sizes."""
    parts = "two_ranks,strategies_alone,checkpoint,streams"
    code, out = run_check("--device", "cpu", "--tiny", "--parts", parts, "--jobs", "2", timeout=300)
    holding = re.search(r"gpu: (\d+)/(\d+) checks hold", out)
    assert holding is not None, out[-3000:]
    assert holding.group(1) == holding.group(2) == "23" and code == 0, out[-3000:]
    assert "trainer fsdp fp32 [one rank: no collectives]" in out
    assert "tensor parallel 2 on one CPU fsdp fp32" in out and "a checkpoint of two ranks resumes on one" in out


def test_the_round_part_runs_on_cpu():
    """Whole-tensor optimizers (Adafactor; Muon with AdamW) under fsdp and context parallel 2 on two ranks sharing
    one device, against plain torch on it."""
    code, out = run_check("--device", "cpu", "--tiny", "--parts", "round", timeout=180)
    assert "gpu: 3/3 checks hold" in out and code == 0, out[-3000:]


def test_an_unknown_part_is_refused_by_name():
    code, out = run_check("--device", "cpu", "--parts", "strategies,warp", timeout=60)
    assert code == 2 and "--parts: unknown ['warp']" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_every_gpu_check_holds_on_this_gpu():
    code, out = run_check("--budget-s", "420", timeout=480)
    holding = re.search(r"gpu: (\d+)/(\d+) checks hold", out)
    assert holding is not None and holding.group(1) == holding.group(2) and code == 0, out[-4000:]


def test_the_speed_part_counts_only_the_waits_inside_its_steps():
    """torch 2.11's profiler synchronizes once more when it stops (seen on an H100, 2026-11-27: plain torch and
    fsdp each showed one wait per 3 steps, both after the last step): waits are counted by time, inside the steps."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.gpu.speed import STEP_MARK, waits_inside_steps

    a = torch.randn(32, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        a @ a  # before the steps
        for _ in range(3):
            with record_function(STEP_MARK):
                a @ a
                a @ a
        a @ a  # after them, as the profiler's own synchronization is
    assert waits_inside_steps(prof.events(), ("aten::mm",)) == {"aten::mm": 6}
    assert waits_inside_steps(prof.events(), ("aten::addmm",)) == {}


def test_the_host_split_counts_operators_and_python_inside_the_steps_only():
    """The split the speed part prints (gpu/host_split.py): ATen operators' own time, the Python around them (a busy
    loop here) and nothing from outside the steps; collectives and CUDA calls by their names."""
    import time

    from torch.profiler import ProfilerActivity, profile, record_function

    from benchmarks.gpu.host_split import class_of, split_host_time
    from benchmarks.gpu.speed import STEP_MARK

    a = torch.randn(256, 256)
    host = 0.0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(200):
            a @ a  # outside the steps: not counted
        for _ in range(2):
            began = time.perf_counter()
            with record_function(STEP_MARK):
                a @ a
                busy = time.perf_counter()
                while time.perf_counter() - busy < 0.02:  # 20 ms of Python
                    pass
            host += time.perf_counter() - began
    split = split_host_time(prof.events(), host, 2, STEP_MARK)
    assert split["Python"] >= 19_000, split
    assert 0 < split["operators"] < 19_000 and split["collectives"] == split["CUDA runtime"] == 0, split
    assert abs(sum(split.values()) - host / 2 * 1e6) < 1_000, split
    assert [class_of(n) for n in ("nccl:all_gather", "c10d::allgather_", "cudaLaunchKernel")] == [
        "collectives",
        "collectives",
        "CUDA runtime",
    ]
    assert class_of("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad") == "autograd nodes"
    assert class_of("Optimizer.step#AdamW.step") == "Python"
