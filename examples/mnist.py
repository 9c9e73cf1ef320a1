"""The PyTorch FSDP tutorial's MNIST recipe, where switching strategy is one flag.

    python -m examples.mnist --devices 2 --strategy ddp
    python -m examples.mnist --devices 2 --strategy fsdp
    python -m examples.mnist --devices 2 --strategy fsdp --auto-wrap-min-params 20000

Each run prints its training time and the strategy's per-rank memory report, which makes the tutorial's
comparison (DDP, FSDP as one unit, FSDP with a size-based auto-wrap policy) three commands.
MNIST is downloaded to --data-dir on first use; with --no-download the files must already be in
<data-dir>/MNIST/raw/. Under torchrun, download once first (e.g. a --devices 1 run) so ranks do not race.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader
from torchvision import datasets, transforms

from callbacks import LearningRateMonitor
from trainer import Trainer, TrainModule, seed_everything


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


class Classifier(TrainModule):
    """The recipe's network, trained with Adadelta and a learning rate that decays every epoch.

    Args:
        lr: Adadelta's learning rate.
        gamma: the learning rate's decay per epoch.
    """

    def __init__(self, lr: float = 1.0, gamma: float = 0.7) -> None:
        super().__init__()
        self.net = Net()
        self.lr, self.gamma = lr, gamma
        self.save_hyperparameters(lr=lr, gamma=gamma)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.nll_loss(self.net(x), y)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        out = self.net(x)
        self.log("val/loss", F.nll_loss(out, y), prog_bar=True, sync_dist=True)
        self.log("val/acc", (out.argmax(1) == y).float().mean(), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.Adadelta(self.parameters(), lr=self.lr)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=self.gamma)


def mnist_loaders(
    data_dir: str, batch_size: int, test_batch_size: int, download: bool = True
) -> tuple[DataLoader, DataLoader]:
    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    try:
        train = datasets.MNIST(data_dir, train=True, download=download, transform=transform)
        test = datasets.MNIST(data_dir, train=False, download=download, transform=transform)
    except RuntimeError as error:
        if download or "not found" not in str(error):
            raise
        raw = os.path.join(data_dir, "MNIST", "raw")
        raise RuntimeError(
            f"Dataset not found: with --no-download the four MNIST files (train-images-idx3-ubyte, "
            f"train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte, or their .gz) "
            f"must be in {raw}; run once without --no-download to fetch them"
        ) from error
    return (
        DataLoader(train, batch_size=batch_size, shuffle=True),
        DataLoader(test, batch_size=test_batch_size, shuffle=False),
    )


def make_strategy(name: str, auto_wrap_min_params: int | None):
    if auto_wrap_min_params is None:
        return name
    if name != "fsdp":
        raise ValueError(f"--auto-wrap-min-params applies to --strategy fsdp only, got --strategy {name}")
    from strategies import FSDPStrategy

    return FSDPStrategy(auto_wrap_policy=auto_wrap_min_params)


def format_memory_report(report: dict) -> str:
    def fmt(value) -> str:
        if isinstance(value, int) and not isinstance(value, bool):
            return f"{value / 2**20:10.2f} MiB"
        return str(value)

    return "\n".join(f"  {key:<28} {fmt(value)}" for key, value in report.items())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--strategy", default="auto", choices=["auto", "ddp", "zero1", "zero2", "fsdp"])
    p.add_argument("--devices", type=int, default=1)
    p.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--test-batch-size", type=int, default=1000)
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--gamma", type=float, default=0.7, help="learning-rate decay per epoch")
    p.add_argument("--data-dir", default="data")
    p.add_argument("--no-download", action="store_true", help="use the files already in --data-dir")
    p.add_argument("--precision", default="32", choices=["32", "bf16-mixed", "16-mixed", "bf16-true"])
    p.add_argument("--limit-train-batches", type=int, default=None, help="batches per epoch (default: all)")
    p.add_argument(
        "--auto-wrap-min-params",
        type=int,
        default=None,
        help="fsdp: make every module with at least this many parameters its own unit",
    )
    p.add_argument("--root-dir", default="runs", help="TensorBoard logs and checkpoints go here")
    p.add_argument("--seed", type=int, default=1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    seed_everything(args.seed)
    strategy = make_strategy(args.strategy, args.auto_wrap_min_params)
    # before the Trainer starts the other ranks, so only this process downloads
    train_loader, test_loader = mnist_loaders(
        args.data_dir, args.batch_size, args.test_batch_size, download=not args.no_download
    )
    trainer = Trainer(
        strategy=strategy,
        devices=args.devices,
        accelerator=args.accelerator,
        precision=args.precision,
        max_epochs=args.epochs,
        limit_train_batches=args.limit_train_batches,
        default_root_dir=args.root_dir,
        callbacks=[LearningRateMonitor()],
    )
    start = time.perf_counter()
    trainer.fit(Classifier(args.lr, args.gamma), train_loader, test_loader)
    elapsed = time.perf_counter() - start

    report = getattr(trainer.strategy, "memory_report", None)
    report = report() if callable(report) else None  # on every rank, in case it communicates
    if trainer.is_global_zero:
        acc = trainer.callback_metrics.get("val/acc")
        print(
            f"\nstrategy {args.strategy} on {trainer.world_size} rank(s): training time {elapsed:.2f} s"
            + (f", val/acc {float(acc):.4f}" if acc is not None else "")
        )
        if report is not None:
            print(f"memory report (rank 0):\n{format_memory_report(report)}")
        print(f"TensorBoard logs: {trainer.logger.log_dir}  (tensorboard --logdir {args.root_dir})")


if __name__ == "__main__":
    main()
