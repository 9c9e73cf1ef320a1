"""LoRA with HuggingFace peft, as people fine-tune: a frozen GPT-2 (or Llama) with small trainable adapters, built in
`configure_model` (on the meta device under fsdp).

- The adapters start as peft makes them (lora_B zeros) under every strategy, and train to the same weights as one
  process; the frozen base is untouched.
- Frozen and trainable parameters shard evenly: each rank holds about 1/N of the trainable elements (and so of the
  optimizer state and of the step's work), at 2, 3 and 4 ranks; the memory report says how many.
- The adapter saves as peft users expect: `strategy.full_state_dict(trainable_only=True)` gathers the trainable
  parameters only, peft's `save_pretrained(..., state_dict=...)` writes them from rank 0, and
  `PeftModel.from_pretrained` in one process loads exactly the trained weights; `python -m trainer.checkpoint export
  --trainable-only` writes them from a checkpoint.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from strategies import FSDPStrategy, get_strategy
from strategies.plan.model_bytes import plan_units
from strategies.sharding import FULL_SHARD
from tests.test_checkpoint import keeps_determinism_setting
from trainer import Trainer, TrainModule, seed_everything
from trainer import checkpoint as ckpt_io

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
safetensors = pytest.importorskip("safetensors.torch")

VOCAB, STEPS, GLOBAL_BATCH = 61, 3, 8
GPT2 = dict(
    vocab_size=VOCAB,
    n_positions=16,
    n_embd=16,
    n_layer=2,
    n_head=2,
    bos_token_id=0,
    eos_token_id=0,
    resid_pdrop=0.0,
    embd_pdrop=0.0,
    attn_pdrop=0.0,
)
LLAMA = dict(
    vocab_size=VOCAB,
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
TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}


def base_model(kind: str) -> torch.nn.Module:
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))


def lora(kind: str) -> torch.nn.Module:
    return peft.get_peft_model(base_model(kind), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[kind]))


def block(kind: str) -> type:
    if kind == "gpt2":
        return transformers.models.gpt2.modeling_gpt2.GPT2Block
    return transformers.models.llama.modeling_llama.LlamaDecoderLayer


class LoraLM(TrainModule):
    def __init__(self, kind: str = "gpt2") -> None:
        super().__init__()
        self.kind = kind

    def configure_model(self) -> None:
        self.model = lora(self.kind)

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        return self.model(input_ids=tokens, labels=tokens).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

    def on_fit_start(self) -> None:
        self.initial = self.trainer.strategy.full_state_dict()


def loader(world_size: int) -> DataLoader:
    data = torch.randint(1, VOCAB, (STEPS * GLOBAL_BATCH, 8), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(data), batch_size=GLOBAL_BATCH // world_size)


def make_strategy(name: str, kind: str = "gpt2"):
    return FSDPStrategy(auto_wrap_policy={block(kind)}) if name == "fsdp" else get_strategy(name)


def fit(name: str, world_size: int, root: str) -> tuple[Trainer, LoraLM]:
    seed_everything(0)
    trainer = Trainer(
        strategy=make_strategy(name),
        devices=world_size,
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        deterministic=True,
        default_root_dir=root,
    )
    module = LoraLM()
    trainer.fit(module, loader(world_size))
    return trainer, module


def eager_initial() -> dict[str, torch.Tensor]:
    seed_everything(0)
    module = LoraLM()
    module.configure_model()
    return module.state_dict()


@keeps_determinism_setting
def body_fit_and_save_adapter(name: str, root: str) -> dict:
    trainer, module = fit(name, dist.get_world_size(), root)
    strategy = trainer.strategy
    strategy.engine.stats.reset()
    adapter = strategy.full_state_dict(trainable_only=True, rank_zero_only=True)  # every rank takes part
    gathered = sum(strategy.engine.stats.elements.values())
    folder = os.path.join(root, f"adapter-{name}")
    if trainer.is_global_zero:  # the documented call: peft writes its own format from what rank 0 gathered
        module.model.save_pretrained(folder, state_dict={k.removeprefix("model."): v for k, v in adapter.items()})
    full = strategy.full_state_dict(rank_zero_only=True)
    if name == "fsdp":
        trainer.save_checkpoint(os.path.join(root, "ckpt"))
    trainable = {n: p.numel() for n, p in module.named_parameters() if p.requires_grad}
    padded = sum(u.layout.padded_total for u in strategy.engine.units if any(u.trainable))
    return {
        "initial": module.initial,
        "adapter": adapter,
        "full": full,
        "gathered": gathered,
        "trainable": trainable,
        "trainable_padded": padded,
        "report": strategy.memory_report(),
        "folder": folder,
    }


def test_lora_trains_saves_exports_and_loads_as_peft_users_expect(rank_pool, tmp_path):
    want_initial = eager_initial()
    reference = fit("single", 1, str(tmp_path / "single"))[0].strategy.full_state_dict()
    runs = {name: rank_pool(2).run(body_fit_and_save_adapter, name, str(tmp_path)) for name in ("ddp", "zero2", "fsdp")}
    lora_keys = sorted(k for k in want_initial if "lora_" in k)
    assert len(lora_keys) == 4  # lora_A and lora_B of two blocks' c_attn
    for name, ranks in runs.items():
        rank0 = ranks[0]
        total = sum(rank0["trainable"].values())
        assert sorted(rank0["trainable"]) == lora_keys
        # Built in configure_model (on meta under fsdp): exactly peft's and HuggingFace's initialisation.
        for key, value in want_initial.items():
            assert torch.equal(rank0["initial"][key], value), (name, key)
        assert all(not want_initial[k].any() for k in lora_keys if "lora_B" in k)
        # Trained like one process; the frozen base untouched.
        for key, value in rank0["full"].items():
            if key in lora_keys:
                assert not torch.equal(value, want_initial[key]), (name, key)
                torch.testing.assert_close(value, reference[key], rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(value, want_initial[key]), (name, key)
        # Each rank steps about 1/N of the trainable elements (all of them under ddp, which shards nothing).
        for rank in ranks:
            held = rank["report"]["trainable_elements"]
            assert held == total if name == "ddp" else abs(held - total / 2) <= 0.1 * total / 2, (name, held)
        # The adapter alone: gathered without the frozen base, then written by peft and loaded by peft.
        assert sorted(rank0["adapter"]) == lora_keys and ranks[1]["adapter"] == {}
        assert all(torch.equal(rank0["adapter"][k], rank0["full"][k]) for k in lora_keys)
        assert rank0["gathered"] <= (rank0["trainable_padded"] if name == "fsdp" else 0), name
        torch.manual_seed(1)
        loaded = peft.PeftModel.from_pretrained(base_model("gpt2"), rank0["folder"])
        for key, value in loaded.state_dict().items():
            if "lora_" in key:
                assert torch.equal(value, rank0["full"]["model." + key]), (name, key)
    # The same from the fsdp run's checkpoint, in one process: `export --trainable-only`.
    out = tmp_path / "exported"
    ckpt_io.main(
        [
            "export",
            str(tmp_path / "ckpt"),
            str(out),
            "--format",
            "safetensors",
            "--prefix",
            "model.",
            "--trainable-only",
        ]
    )
    written = safetensors.load_file(str(out / "model.safetensors"))
    want = {k.removeprefix("model."): v for k, v in runs["fsdp"][0]["adapter"].items()}
    assert sorted(written) == sorted(want) and all(torch.equal(written[k], want[k]) for k in want)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_trainable_elements_split_evenly_at_2_3_4_ranks(kind):
    """The engine's own layout code (what set-up builds), for any world size, with no processes."""
    with torch.device("meta"):
        model = lora(kind)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    for world_size in (2, 3, 4):
        units = plan_units(model, FULL_SHARD, world_size, wrap_policy={block(kind)})
        shares = [sum(u.trainable_elements(rank) for u in units) for rank in range(world_size)]
        assert sum(shares) == total
        assert all(abs(share - total / world_size) <= 0.1 * total / world_size for share in shares), (
            kind,
            world_size,
            shares,
        )


class LowRank(torch.nn.Module):
    """LoRA's shape in plain torch: a frozen weight and a trainable rank-2 update B A."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.base = torch.nn.Linear(dim, dim).requires_grad_(False)
        self.a = torch.nn.Parameter(torch.randn(2, dim) / dim)
        self.b = torch.nn.Parameter(torch.zeros(dim, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.t() @ self.b.t()


def adapted() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(50, 24).requires_grad_(False), *[LowRank(24) for _ in range(3)])


def body_trainable_shares() -> int:
    torch.manual_seed(0)
    strategy = FSDPStrategy(auto_wrap_policy={LowRank})
    with strategy.model_init_context():
        model = adapted()
    strategy.setup_module(model)
    held = strategy.memory_report()["trainable_elements"]
    strategy.teardown()
    return held


def test_the_engine_holds_its_planned_trainable_share_at_3_ranks(rank_pool):
    """The engine's report, on real ranks, is the layout the test above checks (adapters in plain torch)."""
    held = rank_pool(3).run(body_trainable_shares)
    with torch.device("meta"):
        model = adapted()
    units = plan_units(model, FULL_SHARD, 3, wrap_policy={LowRank})
    assert held == [sum(u.trainable_elements(rank) for u in units) for rank in range(3)]
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert all(abs(h - total / 3) <= 0.1 * total / 3 for h in held), held
