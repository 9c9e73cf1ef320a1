"""Rank program for tests/test_elastic.py: a small deterministic fit with `global_batch_size`, checkpointing every 2
steps and resuming with ckpt_path="last", started by torchrun on one or more "nodes" (agents); it notes the samples
each batch trains, and one node can make itself lost.

torchrun --nnodes MIN:MAX --nproc-per-node 2 ... tests/scripts/elastic_train.py --root DIR --strategy S
    [--lose-node-after STEP]

--lose-node-after STEP: once global step STEP is done, the rank of node 1 with local rank 0 SIGKILLs its whole
process group (its torchrun agent and both ranks), as a machine that is lost; once per DIR (DIR/node_lost).
Writes DIR/trained-<pid> (per batch: the restart count, the global step the batch counts towards, its samples),
DIR/starts.log (per start: world size, global step and checkpoint) and DIR/final.pt (a full checkpoint).
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import signal  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from callbacks import Callback, ModelCheckpoint  # noqa: E402
from strategies import get_strategy  # noqa: E402
from trainer import Trainer, TrainModule, seed_everything  # noqa: E402

SAMPLES, BATCH, GLOBAL_BATCH, STEPS = 96, 2, 16, 12  # 6 steps an epoch: 2 epochs


class Regression(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y, _ = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.02)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 1, generator=g),
                         torch.arange(SAMPLES))
    return DataLoader(data, batch_size=BATCH, shuffle=True)


class Notes(Callback):
    """Notes every batch's samples; loses this node after `lose_after` steps when told to."""

    def __init__(self, root: str, lose_after: int | None) -> None:
        self.root, self.lose_after = root, lose_after
        self.restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")

    def on_train_start(self, trainer, module) -> None:
        if trainer.is_global_zero:
            with open(os.path.join(self.root, "starts.log"), "a") as f:
                f.write(f"{trainer.world_size} {trainer.global_step} {os.path.basename(str(trainer.ckpt_path))}\n")

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        samples = " ".join(str(i) for i in batch[2].tolist())
        with open(os.path.join(self.root, f"trained-{os.getpid()}"), "a") as f:
            f.write(f"{self.restart} {trainer.global_step} {samples}\n")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        marker = os.path.join(self.root, "node_lost")
        node, local_rank = os.environ.get("GROUP_RANK"), os.environ.get("LOCAL_RANK")
        if trainer.global_step == self.lose_after and (node, local_rank) == ("1", "0") and not os.path.exists(marker):
            open(marker, "w").close()
            os.killpg(os.getpgid(0), signal.SIGKILL)  # the agent and both ranks of this node


def train(root: str, strategy: str, lose_after: int | None = None) -> Trainer:
    seed_everything(0)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // local  # torchrun's elastic --nnodes MIN:MAX: as launched
    saver = ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=2)
    trainer = Trainer(strategy=get_strategy(strategy), devices=local, num_nodes=nodes, global_batch_size=GLOBAL_BATCH,
                      max_steps=STEPS, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[Notes(root, lose_after), saver], timeout=20)
    trainer.fit(Regression(), loader(), ckpt_path="last")
    trainer.save_checkpoint(os.path.join(root, "final.pt"), full=True)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--lose-node-after", type=int, default=None)
    args = parser.parse_args()
    trainer = train(args.root, args.strategy, args.lose_node_after)
    print(f"rank {trainer.global_rank} of {trainer.world_size} done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
