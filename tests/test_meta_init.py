"""Built on meta = built eagerly (invariant 7): a model made under fsdp's init context (on the meta device, as
`configure_model` is) starts, once set up on 2 ranks, with exactly the parameters and buffers the same code makes
eagerly with the same seed, whoever initialises them: torch's layers, the user's own `nn.init` calls and seeds,
HuggingFace's `post_init` (GPT-2's depth-scaled `c_proj`, Llama), peft's adapters (`lora_B` zeros), timm.
The random generator is left where the eager construction leaves it, so what follows draws the same numbers.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from strategies import FSDPStrategy
from trainer import Trainer, TrainModule, seed_everything

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
timm = pytest.importorskip("timm")

SEED = 0


class UserInit(nn.Module):
    """Initialisation written by hand, none of it in a reset_parameters(): a seed set inside __init__, a
    parameter from torch.randn, nn.init on slices (trunc_normal_ and orthogonal_ skip meta tensors in torch), a
    buffer made from ones, a value read back with .item()."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1234)
        self.embed = nn.Embedding(11, 8, padding_idx=0)
        self.proj = nn.Parameter(torch.randn(8, 8) / math.sqrt(8))
        self.mix = nn.Parameter(torch.empty(8, 12))
        nn.init.trunc_normal_(self.mix[:, :4], std=0.02)
        nn.init.orthogonal_(self.mix[:, 4:])
        scale = torch.linspace(0.5, 1.0, 3)[1].item()
        self.head = nn.Linear(8, 11)
        with torch.no_grad():
            self.head.weight.mul_(scale)
        self.register_buffer("mask", torch.tril(torch.ones(4, 4)))


def gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=61, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
    )


def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=61,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    )


def lora_gpt2() -> nn.Module:
    return peft.get_peft_model(gpt2(), peft.LoraConfig(r=4, target_modules=["c_attn"]))


def vit() -> nn.Module:
    return timm.create_model(
        "vit_tiny_patch16_224",
        pretrained=False,
        img_size=16,
        patch_size=8,
        embed_dim=16,
        depth=2,
        num_heads=2,
        num_classes=5,
        drop_path_rate=0.1,
    )


def transformer() -> nn.Module:
    return nn.Transformer(
        d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=32, batch_first=True
    )


def _units(name: str) -> set[type]:
    from timm.models.vision_transformer import Block
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return {
        "gpt2": {GPT2Block},
        "lora_gpt2": {GPT2Block},
        "llama": {LlamaDecoderLayer},
        "vit": {Block},
        "transformer": {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer},
        "user": {nn.Linear},
    }[name]


MODELS = {
    "gpt2": gpt2,
    "llama": llama,
    "lora_gpt2": lora_gpt2,
    "vit": vit,
    "transformer": transformer,
    "user": UserInit,
}


def built(name: str) -> tuple[nn.Module, torch.Tensor]:
    """The model built eagerly after seeding, and the next numbers the generator gives."""
    torch.manual_seed(SEED)
    model = MODELS[name]()
    return model, torch.rand(4)


def body_built_on_meta(name: str) -> dict:
    torch.manual_seed(SEED)
    strategy = FSDPStrategy(auto_wrap_policy=_units(name))
    with strategy.model_init_context():
        model = MODELS[name]()
    after = torch.rand(4)
    on_meta = all(p.is_meta for p in model.parameters())
    strategy.setup_module(model)
    state = strategy.full_state_dict(rank_zero_only=True)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}  # non-persistent ones too
    units = len(strategy.engine.units)
    strategy.teardown()
    return {
        "state": state if dist.get_rank() == 0 else None,
        "buffers": buffers,
        "after": after,
        "on_meta": on_meta,
        "units": units,
    }


@pytest.mark.parametrize("name", list(MODELS))
def test_a_model_built_on_meta_under_fsdp_starts_exactly_as_built_eagerly(rank_pool, name):
    ranks = rank_pool(2).run(body_built_on_meta, name)
    eager, after = built(name)
    want = eager.state_dict()
    got = ranks[0]["state"]
    assert got.keys() == want.keys()
    different = [key for key, value in want.items() if not torch.equal(got[key], value)]
    assert not different, f"{name}: not the eager values: {different}"
    for rank in ranks:
        assert rank["on_meta"], "the model was not built on the meta device"
        assert rank["units"] > 1, "the wrap policy made no units: nothing was materialized unit by unit"
        for key, value in eager.named_buffers():
            assert torch.equal(rank["buffers"][key], value), (name, key)
        assert torch.equal(rank["after"], after), "the generator is not where the eager construction leaves it"
    if name == "lora_gpt2":  # peft starts the adapted model equal to its base
        lora_b = [v for k, v in got.items() if "lora_B" in k]
        assert lora_b and all(not v.any() for v in lora_b)
    if name == "gpt2":  # the depth-scaled init of the residual projections, applied from the parent module
        assert got["transformer.h.0.attn.c_proj.weight"].std() < 0.75 * got["transformer.h.0.attn.c_attn.weight"].std()


class GPT2Module(TrainModule):
    def configure_model(self) -> None:
        self.model = gpt2()

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_fit_start(self) -> None:
        self.initial = self.trainer.strategy.full_state_dict(rank_zero_only=True)


def body_trainer_bf16_true() -> dict | None:
    seed_everything(SEED)
    module = GPT2Module()
    trainer = Trainer(
        strategy=FSDPStrategy(auto_wrap_policy=_units("gpt2")),
        devices=dist.get_world_size(),
        precision="bf16-true",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    tokens = torch.randint(0, 61, (4, 8), generator=torch.Generator().manual_seed(0))
    trainer.fit(module, DataLoader(TensorDataset(tokens), batch_size=2))
    return module.initial if trainer.is_global_zero else None


def test_the_trainer_builds_configure_model_on_meta_and_converts_it_exactly(rank_pool):
    """The Trainer's route: configure_model under fsdp, then precision="bf16-true"'s conversion, both recorded."""
    got = rank_pool(2).run(body_trainer_bf16_true)[0]
    seed_everything(SEED)
    want = {f"model.{k}": v for k, v in gpt2().to(torch.bfloat16).state_dict().items()}
    assert got.keys() == want.keys()
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], v) for k, v in want.items())
