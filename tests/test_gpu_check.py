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
    """Parts that cover the engine on both one-rank paths, checkpoints and the trace reader, at tiny sizes."""
    code, out = run_check(
        "--device", "cpu", "--tiny", "--parts", "strategies_alone,checkpoint,streams", "--jobs", "2", timeout=300
    )
    holding = re.search(r"gpu: (\d+)/(\d+) checks hold", out)
    assert holding is not None, out[-3000:]
    assert holding.group(1) == holding.group(2) == "14" and code == 0, out[-3000:]
    assert "trainer fsdp fp32 [one rank: no collectives]" in out


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
