"""Fine-tune a pretrained causal language model with LoRA adapters (HuggingFace peft) under fsdp.

    python -m examples.finetune_lora --devices 2

As people fine-tune, with nothing downloaded:
1. A stand-in for a download from the Hub: a small Llama (transformers) is built from a config and saved with
   `save_pretrained` (config.json and model.safetensors) in `--pretrained`, once, if that folder is not there.
2. The TrainModule builds the model from that config in `configure_model` (under fsdp on the meta device: no
   memory, each rank then materializes its own shards), adds LoRA adapters with peft's `get_peft_model`, and at
   the start of a fresh run loads the pretrained weights with `load_safetensors`, each rank reading only its own
   pieces. The adapters are new: the files do not hold them, so they keep peft's initialisation (lora_B zeros).
3. It trains the adapters (the base stays frozen) on the quickstart's data, the standard library's source as bytes.
4. At the end `strategy.full_state_dict(trainable_only=True)` gathers the adapter alone (not the frozen base), rank
   0 writes it with peft's `save_pretrained` to `--adapter-dir`, and the adapter is loaded back in this one process
   with `PeftModel.from_pretrained`, as its users will, and scored on the validation windows.

The pretrained weights here are random (a real run starts from a trained model), so the adapters learn the bytes'
statistics from scratch; validation loss goes down from about 5.5 (a uniform guess over 256 byte values).
peft and transformers are not dependencies of the project: `pip install -e ".[dev]"` installs them.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import time

import peft
import torch
import torch.nn.functional as F
import transformers
from torch.utils.data import DataLoader

from examples.gpt import PrintValLoss, build_datasets
from strategies import FSDPStrategy
from trainer import Trainer, TrainModule, seed_everything
from trainer.checkpoint import load_safetensors

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # every linear layer


def llama_config(args: argparse.Namespace) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=args.hidden_size,
        intermediate_size=args.hidden_size * 8 // 3,
        num_hidden_layers=args.n_layer,
        num_attention_heads=args.n_head,
        num_key_value_heads=max(1, args.n_head // 2),
        max_position_embeddings=args.block_size,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )


def write_pretrained(folder: str, config: transformers.LlamaConfig, seed: int) -> None:
    """The stand-in for a downloaded model: written aside, then renamed into place."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    staging = f"{folder}.tmp-{os.getpid()}"
    model.save_pretrained(staging)
    os.replace(staging, folder)


class LoraFineTune(TrainModule):
    def __init__(self, pretrained: str, rank: int = 8, lr: float = 2e-3) -> None:
        super().__init__()
        self.pretrained, self.rank, self.lr = pretrained, rank, lr

    def configure_model(self) -> None:
        config = transformers.AutoConfig.from_pretrained(self.pretrained)
        base = transformers.AutoModelForCausalLM.from_config(config)  # on the meta device under fsdp
        lora = peft.LoraConfig(r=self.rank, lora_alpha=2 * self.rank, lora_dropout=0.0, target_modules=LORA_TARGETS)
        self.model = peft.get_peft_model(base, lora)

    def on_fit_start(self) -> None:
        if self.trainer.ckpt_path is not None:
            return  # resumed: the checkpoint holds the weights
        # peft keeps each adapted layer's pretrained weight as `base_layer.weight`; the adapters are not in the
        # files (strict=False), and only they may be missing.
        missing = load_safetensors(
            self.trainer,
            self.pretrained,
            prefix="model.base_model.model.",
            key_mapping={r"\.base_layer\.": "."},
            strict=False,
        )
        if any("lora_" not in name for name in missing):
            raise ValueError(f"{self.pretrained} lacks pretrained weights: {[n for n in missing if 'lora_' not in n]}")

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1), y.flatten())

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self.log("val/loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr, weight_decay=0.0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--strategy", default="fsdp", choices=["ddp", "zero1", "zero2", "fsdp"])
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--val-check-interval", type=int, default=50, help="training batches between validations")
    p.add_argument("--val-windows", type=int, default=256, help="validation windows, spread over the text")
    p.add_argument("--data-bytes", type=int, default=1_500_000, help="bytes of stdlib source to use")
    p.add_argument("--pretrained", default="runs/lora/pretrained", help="the base model's folder (made if missing)")
    p.add_argument("--adapter-dir", default="runs/lora/adapter", help="where the trained adapter is saved")
    p.add_argument("--root-dir", default="runs/lora", help="TensorBoard logs go here")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args(argv)


def reload_and_score(args: argparse.Namespace, loader: DataLoader) -> float:
    """In this one process, as a peft user would: the pretrained base, the saved adapter on top, one score."""
    base = transformers.AutoModelForCausalLM.from_pretrained(args.pretrained)
    model = peft.PeftModel.from_pretrained(base, args.adapter_dir).eval()
    with torch.no_grad():
        losses = [(F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()), len(x)) for x, y in loader]
    return sum(loss.item() * n for loss, n in losses) / sum(n for _, n in losses)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    seed_everything(args.seed)
    train_set, val_set = build_datasets(args.block_size, args.data_bytes, args.val_windows)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)
    strategy = (
        FSDPStrategy(auto_wrap_policy={transformers.models.llama.modeling_llama.LlamaDecoderLayer})
        if args.strategy == "fsdp"
        else args.strategy
    )
    trainer = Trainer(
        strategy=strategy,
        devices=args.devices,
        accelerator=args.accelerator,
        max_steps=args.max_steps,
        max_epochs=1000,
        val_check_interval=args.val_check_interval,
        log_every_n_steps=10,
        default_root_dir=args.root_dir,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        callbacks=[PrintValLoss()],
    )
    if trainer.is_global_zero and not os.path.isdir(args.pretrained):
        write_pretrained(args.pretrained, llama_config(args), args.seed)
    trainer.strategy.barrier()
    module = LoraFineTune(args.pretrained, rank=args.lora_rank, lr=args.lr)
    start = time.perf_counter()
    trainer.fit(module, train_loader, val_loader)
    report = trainer.strategy.memory_report()
    held = trainer.strategy.all_gather_object(report["trainable_elements"])
    adapter = trainer.strategy.full_state_dict(trainable_only=True, rank_zero_only=True)  # every rank takes part
    if not trainer.is_global_zero:
        return
    trainable = sum(v.numel() for v in adapter.values())
    total = sum(p.numel() for p in module.parameters())
    print(
        f"training took {time.perf_counter() - start:.1f} s for {trainer.global_step} steps; trained "
        f"{trainable:,} adapter parameters of {total:,} ({100 * trainable / total:.1f}%), on {trainer.world_size} "
        f"rank(s) with {args.strategy}; trainable elements held per rank: {held}"
    )
    shutil.rmtree(args.adapter_dir, ignore_errors=True)
    module.model.save_pretrained(args.adapter_dir, state_dict={k.removeprefix("model."): v for k, v in adapter.items()})
    print(f"adapter saved by peft in {args.adapter_dir}: {', '.join(sorted(os.listdir(args.adapter_dir)))}")
    score = reload_and_score(args, val_loader)
    print(
        f"reloaded in one process (PeftModel.from_pretrained on {args.pretrained}): val/loss {score:.4f} "
        f"(a uniform guess: {math.log(256):.2f})"
    )


if __name__ == "__main__":
    main()
