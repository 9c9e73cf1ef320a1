"""Rank program for tests/test_launcher.py: a Trainer fits with hybrid sharding (a default group, shard and
replica subgroups) and saves a checkpoint (its own checkpoint group), then exits without tearing anything down, as
a user's script does. At exit, after the launcher's handlers, each rank prints how many of gloo's threads are
left: a group alive into interpreter shutdown can abort the process there (SIGABRT, "terminate called without an
active exception") when a worker thread releases a finished collective's tensors.

python tests/scripts/trainer_exit.py --root DIR
"""

import argparse
import atexit
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

from strategies import FSDPStrategy
from trainer import Trainer, TrainModule


def gloo_threads() -> int:
    names = [open(f"/proc/self/task/{t}/comm").read() for t in os.listdir("/proc/self/task")]
    return sum(name.startswith(("pt_gloo", "gloo")) for name in names)


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    # registered before the Trainer starts the process group, so it runs after the launcher's handler (LIFO)
    atexit.register(lambda: print(f"at exit: gloo threads {gloo_threads()}", flush=True))
    strategy = FSDPStrategy(auto_wrap_policy={torch.nn.Linear}, hybrid_shard=1)
    trainer = Trainer(
        strategy=strategy,
        devices=2,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.root,
    )
    trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4))
    trainer.save_checkpoint(os.path.join(args.root, "ckpt"))
    print(f"rank {trainer.global_rank}: gloo threads before exit {gloo_threads()}", flush=True)


if __name__ == "__main__":
    main()
