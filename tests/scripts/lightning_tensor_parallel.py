"""The tiny Llama example split by tensor parallel and sharded by FSDP2 under Lightning's own
ModelParallelStrategy (dp 2 x tp 2 on CPU gloo ranks), written as its users write it: parallelize_module and
fully_shard in configure_model on self.device_mesh. Rank 0 saves the full weights after three SGD steps (the
loader shuffled: Lightning shuffles a split training loader in any case).

    python tests/scripts/lightning_tensor_parallel.py OUT.pt
"""

from __future__ import annotations

import sys

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from examples.llama import LLAMA_PRESETS, Llama, tensor_parallel
from tests.test_tensor_parallel import PER_RANK_BATCH, STEPS, tokens

CONFIG = LLAMA_PRESETS["tiny"]


class Llama2D(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = None

    def configure_model(self) -> None:
        torch.manual_seed(0)
        self.model = tensor_parallel(Llama(CONFIG), self.device_mesh["tensor_parallel"])
        for block in self.model.layers:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        (tokens_,) = batch
        logits = self.model(tokens_[:, :-1])
        return F.cross_entropy(logits.reshape(-1, CONFIG.vocab_size), tokens_[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    trainer = L.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2),
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    module = Llama2D()
    trainer.fit(module, DataLoader(tokens(), batch_size=PER_RANK_BATCH, shuffle=True))
    weights = {f"model.{name}": p.full_tensor().detach() for name, p in module.model.named_parameters()}
    if trainer.is_global_zero:
        torch.save(weights, sys.argv[1])


if __name__ == "__main__":
    main()
