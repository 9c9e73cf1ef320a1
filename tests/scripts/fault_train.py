"""Rank program for tests/test_faults.py: a tiny deterministic fit that checkpoints every 3 steps, resumes with
ckpt_path="last", and can hurt itself on purpose.

python tests/scripts/fault_train.py --root DIR --devices 2 [--fault KIND:STEP:RANK ...] [--timeout S] [--strategy S]
  kill   rank RANK SIGKILLs itself once global step STEP is done
  save   rank RANK SIGKILLs itself in the checkpoint save at step STEP, after writing its own file (before
         meta.json, which makes a checkpoint complete)
  hang   rank RANK sleeps before computing global step STEP
  term   rank RANK sends SIGTERM to itself once global step STEP is done
  pause  rank RANK, once global step STEP is done, writes DIR/paused and waits until DIR/resume exists (the test
         signals a process meanwhile)
Each fault fires once per DIR (a marker file DIR/fault<i> remembers it), so a restarted group runs past it.
Writes DIR/rank<r>.pid, DIR/fault_at (time of the fault), DIR/staging_at_fault (the files in the staging
folder when a "save" fault fires), DIR/failed_at.rank<r> (time a rank raised),
DIR/starts.log (per start: the global step and checkpoint training started from) and DIR/final.pt (a full
checkpoint at the end). Under torchrun the environment is read from the variables torchrun sets.
"""

import argparse
import os
import signal
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback, ModelCheckpoint
from strategies.checkpoint import format as ckpt_format
from trainer import Trainer, TrainModule, seed_everything


class Net(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.1), nn.Linear(16, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)


def loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 8, generator=g), torch.randint(0, 4, (48,), generator=g))
    return DataLoader(data, batch_size=4, shuffle=True)  # 6 steps per epoch at 2 ranks


class Faults(Callback):
    def __init__(self, root: str, faults: list[str]) -> None:
        self.root = root
        self.faults = [
            (i, kind, int(step), int(rank)) for i, (kind, step, rank) in enumerate(f.split(":") for f in faults)
        ]
        self.trainer: Trainer | None = None
        if any(kind == "save" for _, kind, _, _ in self.faults):
            self._die_in_saves()

    def _die_in_saves(self) -> None:
        real_integrity = ckpt_format.file_integrity

        def integrity_then_die(directory, name, *args):  # the test's way into the middle of a checkpoint save
            info = real_integrity(directory, name, *args)
            if name.startswith(f"__{self.trainer.global_rank}_") and self._due("save"):
                with open(os.path.join(self.root, "staging_at_fault"), "w") as f:
                    f.write("\n".join(sorted(os.listdir(directory))))
                self._fire("save", self.trainer.global_step)
            return info

        ckpt_format.file_integrity = integrity_then_die

    def setup(self, trainer, module, stage) -> None:
        self.trainer = trainer
        with open(os.path.join(self.root, f"rank{trainer.global_rank}.pid"), "w") as f:
            f.write(str(os.getpid()))

    def on_train_start(self, trainer, module) -> None:
        if trainer.is_global_zero:
            with open(os.path.join(self.root, "starts.log"), "a") as f:
                f.write(f"{trainer.global_step} {trainer.ckpt_path}\n")

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self._fire("hang", trainer.global_step)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        for kind in ("kill", "term", "pause"):
            self._fire(kind, trainer.global_step)

    def _due(self, kind: str) -> bool:
        step = self.trainer.global_step
        return any(self._fires(i, fault, (kind, step, self.trainer.global_rank)) for i, *fault in self.faults)

    def _fires(self, i: int, fault: list, now: tuple) -> bool:
        return tuple(fault) == now and not os.path.exists(os.path.join(self.root, f"fault{i}"))

    def _fire(self, kind: str, step: int) -> None:
        for i, fault_kind, fault_step, rank in self.faults:
            marker = os.path.join(self.root, f"fault{i}")
            if not self._fires(i, [fault_kind, fault_step, rank], (kind, step, self.trainer.global_rank)):
                continue
            open(marker, "w").close()
            with open(os.path.join(self.root, "fault_at"), "w") as f:
                f.write(repr(time.time()))
            if kind == "hang":
                time.sleep(600)
            elif kind == "pause":
                self._pause()
                continue
            os.kill(os.getpid(), signal.SIGTERM if kind == "term" else signal.SIGKILL)

    def _pause(self) -> None:
        open(os.path.join(self.root, "paused"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(self.root, "resume")) and time.monotonic() < deadline:
            time.sleep(0.05)


def train(
    root: str, devices: int = 2, faults: list[str] | None = None, timeout: float = 60, strategy: str = "fsdp"
) -> Trainer:
    seed_everything(0)
    saver = ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=3)
    trainer = Trainer(
        strategy=strategy,
        devices=devices,
        max_steps=10,
        deterministic=True,
        logger=False,
        enable_progress_bar=False,
        callbacks=[Faults(root, faults or []), saver],
        timeout=timeout,
    )
    try:
        trainer.fit(Net(), loader(), ckpt_path="last")
    except BaseException:
        with open(os.path.join(root, f"failed_at.rank{trainer.global_rank}"), "w") as f:
            f.write(repr(time.time()))
        raise
    trainer.save_checkpoint(os.path.join(root, "final.pt"), full=True)
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--fault", action="append", default=[])
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--strategy", default="fsdp")
    args = parser.parse_args()
    trainer = train(args.root, args.devices, args.fault, args.timeout, args.strategy)
    print(f"rank {trainer.global_rank} done at step {trainer.global_step}", flush=True)


if __name__ == "__main__":
    main()
