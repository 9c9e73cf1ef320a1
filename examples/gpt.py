"""A small GPT that learns to write Python, byte by byte, from the standard library's own source.

The README quickstart: it needs no download, so it runs anywhere Python does.

    python -m examples.gpt --devices 2                    # two CPU ranks, DDP, a few minutes
    python -m examples.gpt --devices 2 --strategy fsdp    # the same run, fully sharded
    tensorboard --logdir runs

The model, data and module are importable (`GPTConfig`, `GPT`, `GPTModule`, `build_datasets`,
`GPT_PRESETS`) so tests and benchmarks train the same thing at other sizes.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from strategies import FSDPStrategy, sequence_positions
from trainer import Trainer, TrainModule, seed_everything

# ----------------------------------------------------------------------------------------------- data


def stdlib_source_files(max_bytes: int = 1_500_000) -> list[str]:
    """The standard library's top-level .py files in sorted order, whole files, until `max_bytes` is reached.

    Private modules (leading underscore) are left out: some of them are generated per machine.
    """
    root = os.path.dirname(os.__file__)
    names = sorted(n for n in os.listdir(root) if n.endswith(".py") and not n.startswith("_"))
    files, total = [], 0
    for name in names:
        if total >= max_bytes:
            break
        path = os.path.join(root, name)
        files.append(path)
        total += os.path.getsize(path)
    return files


def load_corpus(max_bytes: int = 1_500_000, val_every: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """Train and validation bytes as uint8 tensors; every `val_every`-th file (at least one) is validation."""
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2, got {val_every}")
    files = stdlib_source_files(max_bytes)
    if len(files) < 2:
        raise ValueError(f"max_bytes={max_bytes} selects {len(files)} file(s); at least 2 are needed")
    train, val = [], []
    for i, path in enumerate(files):
        is_val = i % val_every == val_every - 1 or (len(files) < val_every and i == len(files) - 1)
        with open(path, "rb") as f:
            (val if is_val else train).append(f.read())
    to_tensor = lambda chunks: torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)  # noqa: E731
    return to_tensor(train), to_tensor(val)


class TextWindows(Dataset):
    """Window i is the `block_size` bytes starting at i * stride, with the next bytes as targets."""

    def __init__(self, data: torch.Tensor, block_size: int, stride: int | None = None) -> None:
        if len(data) < block_size + 1:
            raise ValueError(f"text of {len(data)} bytes is shorter than block_size + 1 = {block_size + 1}")
        self.data, self.block_size = data, block_size
        self.stride = stride or block_size
        self.num_windows = (len(data) - block_size - 1) // self.stride + 1

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.num_windows:
            raise IndexError(i)
        chunk = self.data[i * self.stride : i * self.stride + self.block_size + 1].long()
        return chunk[:-1], chunk[1:]


def build_datasets(
    block_size: int = 64, max_bytes: int = 1_500_000, val_windows: int = 512, train_stride: int | None = None
) -> tuple[TextWindows, TextWindows]:
    """Train windows start every `train_stride` bytes (default: half a block, so they overlap by half);
    about `val_windows` validation windows are spread evenly over the validation text."""
    train, val = load_corpus(max_bytes)
    val_stride = max(block_size, (len(val) - block_size - 1) // max(1, val_windows - 1))
    train_stride = train_stride or max(1, block_size // 2)
    return TextWindows(train, block_size, train_stride), TextWindows(val, block_size, val_stride)


# ---------------------------------------------------------------------------------------------- model


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True  # the head is the token embedding (nanoGPT's); False gives a pipeline's last stage its own


GPT_PRESETS: dict[str, GPTConfig] = {
    "quickstart": GPTConfig(),  # ~0.8M parameters
    "30m": GPTConfig(block_size=256, n_layer=8, n_head=8, n_embd=576),  # ~32M
    "100m": GPTConfig(block_size=256, n_layer=14, n_head=12, n_embd=768),  # ~100M
}


class Linear(nn.Linear):
    """nn.Linear with GPT-2's initialisation (normal weights, zero bias) in `reset_parameters`, torch's
    convention, so a model built on the meta device and materialized layer by layer gets the same values."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = 0.02) -> None:
        self.std = std  # set first: nn.Linear's constructor calls reset_parameters
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=0.02)


def residual_std(config: GPTConfig) -> float:
    """GPT-2 scales the init of projections into the residual stream down by depth."""
    return 0.02 / math.sqrt(2 * config.n_layer)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
        self.n_head, self.dropout = config.n_head, config.dropout
        self.c_attn = Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = Linear(config.n_embd, config.n_embd, bias=config.bias, std=residual_std(config))
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        dropout = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.c_proj = Linear(4 * config.n_embd, config.n_embd, bias=config.bias, std=residual_std(config))
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """nanoGPT's model: token and position embeddings, pre-norm blocks, final norm, head tied to the input (unless
    config.tie_weights is False)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = Embedding(config.vocab_size, config.n_embd)
        self.wpe = Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @staticmethod
    def count_parameters(config: GPTConfig) -> int:
        with torch.device("meta"):
            return GPT(config).num_parameters()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """The logits of the tokens `idx`. Under pipeline parallel a stage holds some of the modules, the others are
        None and skipped: the first stage takes tokens, the later ones the activations of the stage before."""
        x = idx
        if self.wte is not None:
            t = idx.shape[1]
            if t > self.config.block_size:
                raise ValueError(f"sequence length {t} exceeds block_size {self.config.block_size}")
            pos = sequence_positions(t, idx.device)  # arange(t), or this rank's part's under context parallel
            x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x) if self.ln_f is not None else x
        return self.lm_head(x) if self.lm_head is not None else x

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.8, top_k: int = 40):
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.block_size :])[:, -1, :] / temperature
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
            logits[logits < kth] = -float("inf")
            idx = torch.cat((idx, torch.multinomial(F.softmax(logits, dim=-1), 1)), dim=1)
        return idx


def gpt_quickstart() -> GPT:
    """Factories for `python -m strategies.plan examples.gpt:gpt_100m` (one per preset)."""
    return GPT(GPT_PRESETS["quickstart"])


def gpt_30m() -> GPT:
    return GPT(GPT_PRESETS["30m"])


def gpt_100m() -> GPT:
    return GPT(GPT_PRESETS["100m"])


# --------------------------------------------------------------------------------------------- module


def next_byte_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


class GPTModule(TrainModule):
    """Next-byte prediction with AdamW (no decay on biases and norms) and linear warmup then cosine decay."""

    def __init__(
        self,
        config: GPTConfig,
        lr: float = 2e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        max_steps: int = 400,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        self.config = config
        self.lr, self.weight_decay, self.min_lr_ratio = lr, weight_decay, min_lr_ratio
        self.warmup_steps, self.max_steps = warmup_steps, max_steps
        self.save_hyperparameters(
            **asdict(config),
            lr=lr,
            weight_decay=weight_decay,
            warmup_steps=warmup_steps,
            max_steps=max_steps,
            min_lr_ratio=min_lr_ratio,
        )
        self.model: GPT | None = None

    def configure_model(self) -> None:
        if self.model is None:  # built here so sharded strategies can create it shard by shard
            self.model = GPT(self.config)

    def example_input(self, batch_size: int, seq_len: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch of the shape training sees (the memory plan runs training_step on it)."""
        x = torch.randint(0, self.config.vocab_size, (batch_size, seq_len or self.config.block_size))
        return x, x

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The training loss of the logits. Under pipeline parallel the schedule calls it on the last stage in
        place of training_step (docs/strategies.md, "Deep models"), so it is what logs the loss."""
        loss = next_byte_loss(logits, targets)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.pipeline_loss(self(x), y)

    def validation_step(self, batch, batch_idx: int) -> None:
        x, y = batch
        self.log("val/loss", next_byte_loss(self(x), y), prog_bar=True, sync_dist=True)

    def lr_factor(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = min(1.0, (step - self.warmup_steps) / max(1, self.max_steps - self.warmup_steps))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        opt = torch.optim.AdamW(groups, lr=self.lr, betas=(0.9, 0.99))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, self.lr_factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PrintValLoss(Callback):
    """One line per validation on rank 0, so the loss curve is visible without TensorBoard."""

    def on_validation_end(self, trainer, module) -> None:
        loss = trainer.callback_metrics.get("val/loss")
        if trainer.is_global_zero and loss is not None and not trainer.sanity_checking:
            tqdm.write(f"step {trainer.global_step:5d}  val/loss {float(loss):.4f}")


# ----------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--strategy",
        default="ddp",
        choices=["auto", "ddp", "zero1", "zero2", "fsdp", "hsdp"],
        help="fsdp and hsdp make each Block a unit",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each Block (fsdp, hsdp) or the whole GPT")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument(
        "--preset", choices=sorted(GPT_PRESETS), default="quickstart", help="model size; the flags below override it"
    )
    p.add_argument("--block-size", type=int)
    p.add_argument("--n-layer", type=int)
    p.add_argument("--n-head", type=int)
    p.add_argument("--n-embd", type=int)
    p.add_argument("--dropout", type=float)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--precision", default="32", choices=["32", "bf16-mixed", "16-mixed", "bf16-true"])
    p.add_argument("--val-check-interval", type=int, default=50, help="training batches between validations")
    p.add_argument("--val-windows", type=int, default=512, help="validation windows, spread over the text")
    p.add_argument("--data-bytes", type=int, default=1_500_000, help="bytes of stdlib source to use")
    p.add_argument("--sample-tokens", type=int, default=300, help="bytes to generate at the end (0: none)")
    p.add_argument("--root-dir", default="runs", help="TensorBoard logs and checkpoints go here")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args(argv)


def model_config(args: argparse.Namespace) -> GPTConfig:
    overrides = {k: getattr(args, k) for k in ("block_size", "n_layer", "n_head", "n_embd", "dropout")}
    return replace(GPT_PRESETS[args.preset], **{k: v for k, v in overrides.items() if v is not None})


def sample(checkpoint: str, config: GPTConfig, num_tokens: int, prompt: bytes = b"def ") -> str:
    """Reload the saved weights in this one process, as a user would, and let the model write some Python."""
    from trainer.checkpoint import load_full_state_dict

    model = GPT(config)
    state = {k.removeprefix("model."): v for k, v in load_full_state_dict(checkpoint).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # the tied head may be stored once, as wte.weight
        raise ValueError(f"{checkpoint} does not hold this GPT: missing {missing}, unexpected {unexpected}")
    model.eval()
    torch.manual_seed(0)
    out = model.generate(torch.tensor([list(prompt)]), num_tokens)
    return bytes(out[0].tolist()).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    seed_everything(args.seed)
    config = model_config(args)
    train_set, val_set = build_datasets(config.block_size, args.data_bytes, args.val_windows)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    val_loader = DataLoader(val_set, batch_size=args.batch_size)
    module = GPTModule(config, lr=args.lr, warmup_steps=args.warmup_steps, max_steps=args.max_steps)

    strategy = args.strategy
    if strategy in ("fsdp", "hsdp"):
        strategy = FSDPStrategy(auto_wrap_policy={Block}, hybrid_shard="node" if strategy == "hsdp" else None)
    trainer = Trainer(
        strategy=strategy,
        compile=args.compile,
        devices=args.devices,
        accelerator=args.accelerator,
        precision=args.precision,
        max_steps=args.max_steps,
        max_epochs=1000,
        val_check_interval=args.val_check_interval,
        gradient_clip_val=1.0,
        log_every_n_steps=10,
        default_root_dir=args.root_dir,
        callbacks=[
            ModelCheckpoint(monitor="val/loss", mode="min", save_last=True),
            LearningRateMonitor(),
            PrintValLoss(),
        ],
    )
    if trainer.is_global_zero:
        print(
            f"data: {len(train_set.data):,} train / {len(val_set.data):,} val bytes of stdlib source; "
            f"model: {GPT.count_parameters(config):,} parameters; "
            f"{trainer.world_size} rank(s), strategy {args.strategy}"
        )
        print(
            f"an untrained model scores val/loss ~{math.log(config.vocab_size):.2f} (a uniform guess over "
            f"{config.vocab_size} byte values); watch it go down:"
        )
    start = time.perf_counter()
    trainer.fit(module, train_loader, val_loader)
    elapsed = time.perf_counter() - start

    if not trainer.is_global_zero:
        return
    ckpt = trainer.checkpoint_callback
    best = ckpt.best_model_path or ckpt.last_model_path
    print(f"\ntraining took {elapsed:.1f} s for {trainer.global_step} steps")
    print(f"TensorBoard logs: {trainer.logger.log_dir}\n  open them with: tensorboard --logdir {args.root_dir}")
    print(f"checkpoint (best val/loss): {best}\n  last: {ckpt.last_model_path}")
    if args.sample_tokens > 0 and best:
        print(f"\nsample from {best}:\n{sample(best, config, args.sample_tokens)}")


if __name__ == "__main__":
    main()
