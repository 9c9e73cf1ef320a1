"""SLURM: the tasks `srun` starts join one job, as Lightning's SLURMEnvironment has them do.

srun gives each task SLURM_PROCID (its number in the job), SLURM_NTASKS, SLURM_LOCALID (its number on its node),
SLURM_NODEID, SLURM_JOB_NODELIST (a compressed host list such as `node[01-03,07]`), SLURM_NTASKS_PER_NODE and
SLURM_JOB_ID. A job of `devices` ranks on each of `num_nodes` nodes is laid out one of two ways:
- one task per device (`srun --ntasks-per-node=<devices>`): each task is one rank;
- one task per node (`srun --ntasks-per-node=1`): each task starts its node's `devices` ranks itself, as a
  plain `python script.py` does on one machine.
The ranks meet at the job's first node (MASTER_ADDR, if set, wins), on a port made from the job id (MASTER_PORT,
if set, wins). Any other task count is an error naming SLURM_NTASKS, `devices` and `num_nodes`.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PORT = 12910  # without a job id, as Lightning


@dataclass(frozen=True)
class SlurmTask:
    """What srun told this task."""

    task: int
    tasks: int
    local_task: int
    node: int
    nodes: int
    tasks_per_node: int | None
    master_addr: str
    master_port: int


@dataclass(frozen=True)
class Placement:
    """Where this task's ranks go: the ranks `first_rank ..` + `local_ranks` of `world_size` on node `node`.
    `local_ranks` > 1 means this task starts the others of its node itself."""

    first_rank: int
    local_rank: int
    local_ranks: int
    world_size: int
    node: int
    master_addr: str
    master_port: int


def detect(env: Mapping[str, str] = os.environ) -> SlurmTask | None:
    """This task under `srun`, or None. As Lightning: SLURM_NTASKS says srun started us, except in an interactive
    allocation (`salloc` then a shell: the job is named "bash" or "interactive")."""
    if "SLURM_NTASKS" not in env or env.get("SLURM_JOB_NAME") in ("bash", "interactive"):
        return None
    nodes = expand_nodelist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "127.0.0.1")))
    job_id = env.get("SLURM_JOB_ID")
    port = int(job_id[-4:]) + 15000 if job_id and job_id[-4:].isdigit() else DEFAULT_PORT  # Lightning's rule
    return SlurmTask(
        task=int(env.get("SLURM_PROCID", 0)),
        tasks=int(env["SLURM_NTASKS"]),
        local_task=int(env.get("SLURM_LOCALID", 0)),
        node=int(env.get("SLURM_NODEID", 0)),
        nodes=int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", len(nodes)))),
        tasks_per_node=_first_count(env.get("SLURM_NTASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE"))),
        master_addr=env.get("MASTER_ADDR", nodes[0]),
        master_port=int(env.get("MASTER_PORT", port)),
    )


def place(task: SlurmTask, devices: int, num_nodes: int) -> Placement:
    """Where this task's ranks go for `devices` ranks on each of `num_nodes` nodes (see the module docstring)."""
    world_size = devices * num_nodes
    if task.nodes != num_nodes:
        raise ValueError(
            f"num_nodes={num_nodes}, but srun started this job on {task.nodes} node(s) "
            f"(SLURM_NNODES); set num_nodes={task.nodes} or srun --nodes={num_nodes}"
        )
    if task.tasks == world_size and task.tasks_per_node in (None, devices):  # one task per device
        return Placement(task.task, task.local_task, 1, world_size, task.node, task.master_addr, task.master_port)
    if task.tasks == num_nodes and devices > 1:  # one task per node: it starts its node's ranks
        return Placement(task.node * devices, 0, devices, world_size, task.node, task.master_addr, task.master_port)
    per_node = f" ({task.tasks_per_node} per node, SLURM_NTASKS_PER_NODE)" if task.tasks_per_node else ""
    raise ValueError(
        f"srun started SLURM_NTASKS={task.tasks} task(s){per_node}, which does not fit devices={devices} x "
        f"num_nodes={num_nodes}: run one task per device (srun --nodes={num_nodes} --ntasks-per-node={devices}) "
        f"or one per node (srun --nodes={num_nodes} --ntasks-per-node=1), or change devices / num_nodes"
    )


def warn_if_srun_unused(ranks: int) -> None:
    """As Lightning: on a SLURM cluster (srun exists) a job of several ranks started without srun is probably a
    mistake (the ranks then run on the node of the batch script only)."""
    if ranks > 1 and shutil.which("srun") is not None:
        warnings.warn(
            f"this job of {ranks} ranks was not started with srun although srun is available: the Trainer "
            "starts the ranks on this machine only. On SLURM, prepend srun: srun python script.py",
            stacklevel=3,
        )


def expand_nodelist(nodelist: str) -> list[str]:
    """The host names of a SLURM host list: `node[01-03,07],gpu5` -> node01 node02 node03 node07 gpu5 (ranges
    keep their zero padding; several bracket groups in one name expand in order)."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip()):
        hosts += _expand_name(item)
    if not hosts:
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_name(name: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", name)
    if match is None:
        return [name]
    prefix, rest = name[: match.start()], name[match.end() :]
    out = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        numbers = range(int(low), int(high or low) + 1)
        out += [f"{prefix}{str(n).zfill(len(low))}{suffix}" for n in numbers for suffix in _expand_name(rest)]
    return out


def _first_count(value: str | None) -> int | None:
    """SLURM_NTASKS_PER_NODE as "2", "2(x3)" or "2,1": the count on the first node."""
    match = re.match(r"\d+", value or "")
    return int(match.group()) if match else None
