"""Rank program for tests/test_launcher.py: a Trainer with `--devices` and `--num-nodes` fits a small model under
ddp, then each rank prints where it was placed and a checksum of its weights (equal on every rank of one job).

python tests/scripts/trainer_ranks.py --devices N [--num-nodes M] --root DIR
"""

import argparse

import torch
from torch.utils.data import DataLoader, TensorDataset

from trainer import Trainer, TrainModule


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 2)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--num-nodes", type=int, default=1)
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    trainer = Trainer(
        strategy="ddp",
        devices=args.devices,
        num_nodes=args.num_nodes,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=args.root,
    )
    module = Net()
    trainer.fit(
        module, DataLoader(TensorDataset(torch.randn(32, 4, generator=torch.Generator().manual_seed(1))), batch_size=4)
    )
    checksum = sum(float(p.sum()) for p in module.parameters())
    print(
        f"rank {trainer.global_rank} of {trainer.world_size}, local rank {trainer.local_rank}: weights {checksum:.6f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
