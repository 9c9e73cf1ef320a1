"""The MNIST recipe of examples/mnist.py on the LightningCLI-style command line: everything is configured by
examples/cli_mnist.yaml and dotted flags, and the run's resolved config is saved beside its logs and in every
checkpoint.

    python -m examples.cli_mnist fit --config examples/cli_mnist.yaml
    python -m examples.cli_mnist fit --config examples/cli_mnist.yaml --trainer.devices 2 --trainer.strategy fsdp
    python -m examples.cli_mnist fit --config examples/cli_mnist.yaml --model.lr 0.5 --data.batch_size 32
    python -m examples.cli_mnist fit --config examples/cli_mnist.yaml --ckpt_path last   # resume, same config
    python -m examples.cli_mnist test --config examples/cli_mnist.yaml --ckpt_path last
    python -m examples.cli_mnist fit --help                                              # every argument

Precedence: defaults < config files in the order given < command line flags.
"""

from __future__ import annotations

from examples.mnist import Classifier, mnist_loaders
from trainer import DataModule
from trainer.cli import CLI


class MNISTData(DataModule):
    """MNIST, normalized as the PyTorch recipe does.

    Args:
        data_dir: where MNIST is (or is downloaded to): `<data_dir>/MNIST/raw/`.
        batch_size: training samples per batch, per rank.
        test_batch_size: validation and test samples per batch.
        download: fetch MNIST when it is not in `data_dir` (false: the files must be there).
    """

    def __init__(
        self, data_dir: str = "data", batch_size: int = 64, test_batch_size: int = 1000, download: bool = True
    ) -> None:
        super().__init__()
        self.save_hyperparameters()

    def prepare_data(self) -> None:
        """Download once per machine, before any rank reads."""
        self._loaders()

    def setup(self, stage: str) -> None:
        self.train_loader, self.test_loader = self._loaders()

    def _loaders(self):
        h = self.hparams
        return mnist_loaders(h.data_dir, h.batch_size, h.test_batch_size, download=h.download)

    def train_dataloader(self):
        return self.train_loader

    def val_dataloader(self):
        return self.test_loader

    def test_dataloader(self):
        return self.test_loader


def main(args: list[str] | None = None) -> CLI:
    return CLI(Classifier, MNISTData, args=args)


if __name__ == "__main__":
    main()
