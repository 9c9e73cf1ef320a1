"""Weights out to and in from safetensors in HuggingFace's layout, with a tiny GPT-2 built from a local config
(nothing is downloaded): `python -m trainer.checkpoint export` writes what `from_pretrained` loads, and
`load_safetensors` starts a sharded run from pretrained weights, each rank reading only its pieces."""

from __future__ import annotations

import collections
import json
import math
import os

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback
from strategies import FSDPStrategy
from strategies.checkpoint.planners import ShardLoadPlanner
from tests.test_checkpoint import assert_states_close, keeps_determinism_setting, rank_zero
from trainer import Trainer, TrainModule, seed_everything
from trainer import checkpoint as ckpt_io

transformers = pytest.importorskip("transformers")

CONFIG = dict(
    vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0
)


def gpt2_config():
    return transformers.GPT2Config(**CONFIG)


class GPT2Module(TrainModule):
    """A HuggingFace GPT-2 under `self.model` (its names start with "model."), built in configure_model (on the
    meta device under fsdp); with `pretrained`, a fresh run starts from those safetensors weights."""

    def __init__(self, pretrained: str | None = None) -> None:
        super().__init__()
        self.pretrained = pretrained

    def configure_model(self) -> None:
        self.model = transformers.GPT2LMHeadModel(gpt2_config())

    def on_fit_start(self) -> None:
        if self.pretrained is not None and self.trainer.ckpt_path is None:
            ckpt_io.load_safetensors(self.trainer, self.pretrained, prefix="model.")

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def tokens(world_size: int) -> DataLoader:
    data = torch.randint(0, CONFIG["vocab_size"], (16, 8), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data), batch_size=8 // world_size)


class WeightsAtStart(Callback):
    def on_train_start(self, trainer, module) -> None:
        self.weights = trainer.strategy.full_state_dict()


def train(root: str, steps: int, pretrained: str | None = None, callbacks: list | None = None) -> Trainer:
    seed_everything(0)
    strategy = FSDPStrategy(auto_wrap_policy={transformers.models.gpt2.modeling_gpt2.GPT2Block})
    trainer = Trainer(
        strategy=strategy,
        devices=2,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        deterministic=True,
        default_root_dir=root,
        callbacks=callbacks or [],
    )
    trainer.fit(GPT2Module(pretrained), tokens(2))
    return trainer


@keeps_determinism_setting
def _export_body(root: str) -> dict | None:
    trainer = train(root, steps=2)
    trainer.save_checkpoint(os.path.join(root, "ckpt"))
    return rank_zero(trainer, trainer.strategy.full_state_dict())


def test_export_writes_safetensors_that_from_pretrained_loads(rank_pool, tmp_path):
    full = rank_pool(2).run(_export_body, str(tmp_path))[0]
    stripped = {k.removeprefix("model."): v for k, v in full.items()}
    batch = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(1))
    reference = transformers.GPT2LMHeadModel(gpt2_config()).eval()
    reference.load_state_dict(stripped)

    one, sharded = tmp_path / "one", tmp_path / "sharded"
    ckpt_io.main(["export", str(tmp_path / "ckpt"), str(one), "--format", "safetensors", "--prefix", "model."])
    ckpt_io.main(
        [
            "export",
            str(tmp_path / "ckpt"),
            str(sharded),
            "--format",
            "safetensors",
            "--prefix",
            "model.",
            "--max-shard-size",
            "12000",
        ]
    )
    assert sorted(os.listdir(one)) == ["model.safetensors"]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 3 and files == sorted(n for n in os.listdir(sharded) if n.endswith(".safetensors"))
    assert files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    # the tied head is stored once, under the embedding's name, as HuggingFace stores it
    assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]

    for folder in (one, sharded):
        gpt2_config().save_pretrained(folder)
        model = transformers.GPT2LMHeadModel.from_pretrained(folder).eval()
        assert_states_close(dict(model.state_dict()), dict(reference.state_dict()), atol=0)
        with torch.no_grad():
            assert torch.equal(model(input_ids=batch).logits, reference(input_ids=batch).logits)


@keeps_determinism_setting
def _import_body(root: str, pretrained: str) -> dict:
    copied = collections.Counter()
    real = ShardLoadPlanner.resolve_tensor

    def resolve_tensor(self, read_item):
        copied[read_item.dest_index.fqn] += math.prod(read_item.lengths)
        return real(self, read_item)

    ShardLoadPlanner.resolve_tensor = resolve_tensor
    start = WeightsAtStart()
    try:
        trainer = train(root, steps=1, pretrained=pretrained, callbacks=[start])
    finally:
        ShardLoadPlanner.resolve_tensor = real
    engine = trainer.strategy.engine
    own = sum(piece.numel for unit in engine.units for piece in unit.pieces)
    return {"weights": start.weights, "copied": sum(copied.values()), "own": own}


def test_a_sharded_run_starts_from_safetensors_weights_each_rank_reading_its_pieces(rank_pool, tmp_path):
    torch.manual_seed(3)
    pretrained = transformers.GPT2LMHeadModel(gpt2_config())
    pretrained.save_pretrained(tmp_path / "gpt2")  # model.safetensors and config.json, as on the Hub
    expected = {f"model.{k}": v for k, v in pretrained.state_dict().items()}

    results = rank_pool(2).run(_import_body, str(tmp_path), str(tmp_path / "gpt2"))
    for result in results:
        assert_states_close(result["weights"], {k: expected[k] for k in result["weights"]}, atol=0)
        assert result["copied"] == result["own"]  # its own pieces of every parameter, nothing else
    assert sum(r["own"] for r in results) == sum(p.numel() for p in pretrained.parameters())


def test_load_safetensors_lists_every_difference(tmp_path):
    torch.manual_seed(3)
    config = transformers.GPT2Config(**{**CONFIG, "n_embd": 8})
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "other")
    seed_everything(0)
    trainer = Trainer(
        strategy="single",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    module = GPT2Module(str(tmp_path / "other"))
    with pytest.raises(ValueError) as error:
        trainer.fit(module, tokens(1))
    lines = [line.strip() for line in str(error.value).splitlines()]
    assert "other" in lines[0] and "prefix='model.'" in lines[0]
    assert "shape of model.transformer.wte.weight: safetensors [40, 8], model [40, 16]" in lines
    with pytest.raises(ValueError, match=r"missing: model\.transformer\.wte\.weight"):
        ckpt_io.load_safetensors(trainer, str(tmp_path / "other"), prefix="")
