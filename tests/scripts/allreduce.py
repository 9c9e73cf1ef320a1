"""Rank program for tests/test_launcher.py: every rank all-reduces (rank + 1) and prints the sum.

python tests/scripts/allreduce.py --devices N [--num-nodes M] [--fail-rank R] [--pid-dir DIR]
With --fail-rank R, rank R raises ValueError after the all-reduce while the others wait in a barrier.
With --chdir DIR the script changes directory before it starts the ranks (its own path may be relative).
With --pid-dir, each rank writes its pid to DIR/rank<r>.pid, and a failing rank the time to DIR/failed_at.
The process group is left to the launcher to destroy (as a Trainer's user leaves it); each rank says at exit,
after the launcher's exit handlers, whether it was destroyed while the interpreter was still whole.
Without --devices (under torchrun) the environment is read from the variables torchrun sets; under srun, from
SLURM's (trainer/launch/slurm.py), as the Trainer reads them.
"""

import argparse
import atexit
import datetime
import os
import time

import torch
import torch.distributed as dist

from trainer.launch.launcher import detect_environment, from_slurm, init_process_group, launch_local_ranks


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--pid-dir", default=None)
    parser.add_argument("--chdir", default=None)
    args = parser.parse_args()
    if args.chdir:
        os.chdir(args.chdir)

    # registered before init_process_group registers its own handler, so it runs after it (atexit is LIFO)
    atexit.register(lambda: print(f"at exit: process group destroyed {not dist.is_initialized()}", flush=True))
    env = detect_environment() or from_slurm(args.devices, args.num_nodes) or launch_local_ranks(args.devices)
    init_process_group(env, "gloo", datetime.timedelta(seconds=120))
    if args.pid_dir:
        with open(os.path.join(args.pid_dir, f"rank{env.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
    total = torch.tensor([env.rank + 1.0])
    dist.all_reduce(total)
    print(f"rank {env.rank} of {env.world_size} on node {env.node_rank}: sum {total.item():g}", flush=True)
    if env.rank == args.fail_rank:
        if args.pid_dir:
            with open(os.path.join(args.pid_dir, "failed_at"), "w") as f:
                f.write(repr(time.time()))
        raise ValueError(f"boom from rank {env.rank}")
    dist.barrier()


if __name__ == "__main__":
    main()
