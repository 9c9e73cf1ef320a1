"""A LightningCLI script: a regression model and its DataModule, configured by cli_regression.yaml. The same file
runs under Lightning with only the imports changed (CLI_BACKEND=lightning picks Lightning's), which
tests/test_cli.py checks.

python tests/scripts/cli_regression.py fit --config tests/scripts/cli_regression.yaml
"""

import os

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

if os.environ.get("CLI_BACKEND") == "lightning":
    from lightning.pytorch import LightningDataModule as DataModule
    from lightning.pytorch import LightningModule as TrainModule
    from lightning.pytorch.cli import LightningCLI as CLI
else:
    from trainer import DataModule, TrainModule
    from trainer.cli import CLI


class Regressor(TrainModule):
    """A two-layer regression network.

    Args:
        hidden: width of the hidden layer.
        lr: the SGD learning rate (when the config gives no optimizer).
    """

    def __init__(self, hidden: int = 8, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val/loss", F.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class RegressionData(DataModule):
    """Noisy samples of a fixed linear function, the same on every run.

    Args:
        batch_size: samples per batch.
        num_samples: size of the training set.
    """

    def __init__(self, batch_size: int = 8, num_samples: int = 64) -> None:
        super().__init__()
        self.batch_size, self.num_samples = batch_size, num_samples

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.num_samples + 16, 4, generator=g)
        y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(len(x), 1, generator=g)
        self.train_set = TensorDataset(x[: self.num_samples], y[: self.num_samples])
        self.val_set = TensorDataset(x[self.num_samples :], y[self.num_samples :])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=False)

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=self.batch_size)


if __name__ == "__main__":
    CLI(Regressor, RegressionData)
