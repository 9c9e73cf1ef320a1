"""A HuggingFace model trained under fsdp: built on the meta device (its Conv1D layers have no reset_parameters;
the model's own `_init_weights` initialises them), and after fit `generate()` gives the tokens of a plain copy."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

from strategies import FSDPStrategy
from trainer import Trainer, TrainModule

CONFIG = dict(vocab_size=61, n_positions=32, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)


class TinyGPT2(TrainModule):
    def configure_model(self) -> None:
        self.model = GPT2LMHeadModel(GPT2Config(**CONFIG))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def tokens() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (16, 12), generator=torch.Generator().manual_seed(0))


def body_generate_after_fit() -> dict:
    torch.manual_seed(0)
    module = TinyGPT2()
    trainer = Trainer(
        strategy=FSDPStrategy(auto_wrap_policy={GPT2Block}),
        devices=dist.get_world_size(),
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(module, DataLoader(TensorDataset(tokens()), batch_size=2))
    prompt = tokens()[:2, :4]
    module.eval()  # no dropout
    generated = module.model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    state = trainer.strategy.full_state_dict()
    return {"generated": generated, "state": {k.removeprefix("model."): v for k, v in state.items()}}


def test_generate_after_fsdp_fit_matches_a_plain_copy(rank_pool):
    ranks = rank_pool(2).run(body_generate_after_fit)
    plain = GPT2LMHeadModel(GPT2Config(**CONFIG))
    plain.load_state_dict(ranks[0]["state"])
    plain.eval()
    conv = plain.transformer.h[0].attn.c_attn.weight
    assert 0.005 < conv.std() < 0.05, "Conv1D was not initialised by the model's _init_weights"
    expected = plain.generate(tokens()[:2, :4], max_new_tokens=6, do_sample=False, pad_token_id=0)
    for rank in ranks:
        assert torch.equal(rank["generated"], expected)
