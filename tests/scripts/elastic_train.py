"""Rank program for tests/test_elastic.py: a small deterministic fit with `global_batch_size`, checkpointing every 2
steps and resuming with ckpt_path="last", started by torchrun on one or more "nodes" (agents); it notes the samples
each batch trains, and one node can make itself lost.

torchrun --nnodes MIN:MAX --nproc-per-node 2 ... tests/scripts/elastic_train.py --root DIR --strategy S
    [--lose-node-after STEP | --lose-node-in-save STEP]

Given to one agent, --lose-node-after STEP: once global step STEP is done, that agent's rank with local rank 0
SIGKILLs the agent and every rank it started, itself too, as a machine that is lost; --lose-node-in-save STEP: the
same in the checkpoint save of step STEP, once that rank has written its own file. Once per DIR (DIR/node_lost).
Writes DIR/trained-<pid> (per batch: the restart count, the global step the batch counts towards, its samples),
DIR/starts.log (per start: world size, global step and checkpoint) and DIR/final.pt (a full checkpoint).
"""

from __future__ import annotations

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback, ModelCheckpoint
from strategies import get_strategy
from strategies.checkpoint import format as ckpt_format
from trainer import Trainer, TrainModule, seed_everything

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
    data = TensorDataset(
        torch.randn(SAMPLES, 6, generator=g), torch.randn(SAMPLES, 1, generator=g), torch.arange(SAMPLES)
    )
    return DataLoader(data, batch_size=BATCH, shuffle=True)


class Notes(Callback):
    """Notes every batch's samples; loses this node after step `after`, or in the save of step `in_save`."""

    def __init__(self, root: str, after: int | None, in_save: int | None) -> None:
        self.root, self.after, self.in_save = root, after, in_save
        self.restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.trainer: Trainer | None = None
        if in_save is not None:
            self._lose_in_saves()

    def setup(self, trainer, module, stage) -> None:
        self.trainer = trainer

    def on_train_start(self, trainer, module) -> None:
        if trainer.is_global_zero:
            with open(os.path.join(self.root, "starts.log"), "a") as f:
                f.write(f"{trainer.world_size} {trainer.global_step} {os.path.basename(str(trainer.ckpt_path))}\n")

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        samples = " ".join(str(i) for i in batch[2].tolist())
        with open(os.path.join(self.root, f"trained-{os.getpid()}"), "a") as f:
            f.write(f"{self.restart} {trainer.global_step} {samples}\n")

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.after:
            self._lose_node()

    def _lose_in_saves(self) -> None:
        real_integrity = ckpt_format.file_integrity

        def integrity_then_lose(directory, name, *args):  # the way into the middle of a checkpoint save
            info = real_integrity(directory, name, *args)
            if name.startswith(f"__{self.trainer.global_rank}_") and self.trainer.global_step == self.in_save:
                self._lose_node()
            return info

        ckpt_format.file_integrity = integrity_then_lose

    def _lose_node(self) -> None:
        marker = os.path.join(self.root, "node_lost")
        if os.environ.get("LOCAL_RANK") != "0" or os.path.exists(marker):
            return
        open(marker, "w").close()
        agent = os.getppid()  # torchrun's agent; each rank it starts is in a session of its own
        ranks = [int(pid) for pid in open(f"/proc/{agent}/task/{agent}/children").read().split()]
        for pid in [agent, *sorted(ranks, key=lambda pid: pid == os.getpid())]:  # this process last
            os.kill(pid, signal.SIGKILL)


def train(root: str, strategy: str, lose_after: int | None = None, lose_in_save: int | None = None) -> Trainer:
    seed_everything(0)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = int(os.environ.get("WORLD_SIZE", "1")) // local  # torchrun's elastic --nnodes MIN:MAX: as launched
    saver = ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=2)
    trainer = Trainer(
        strategy=get_strategy(strategy),
        devices=local,
        num_nodes=nodes,
        global_batch_size=GLOBAL_BATCH,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Notes(root, lose_after, lose_in_save), saver],
        timeout=20,
    )
    trainer.fit(Regression(), loader(), ckpt_path="last")
    trainer.save_checkpoint(os.path.join(root, "final.pt"), full=True)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--lose-node-after", type=int, default=None)
    parser.add_argument("--lose-node-in-save", type=int, default=None)
    args = parser.parse_args()
    trainer = train(args.root, args.strategy, args.lose_node_after, args.lose_node_in_save)
    print(f"rank {trainer.global_rank} of {trainer.world_size} done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
