"""A Llama-shaped decoder (RMSNorm, rotary attention with grouped key/value heads, SwiGLU) with no dependency.

It is here to be planned, at sizes this machine could never train:

    python -m strategies.plan examples.llama:llama_7b --world-size 8 --batch-size 1 --seq-len 4096 \
        --precision bf16-mixed --device-memory 80GiB --wrap Block

The factories build the model eagerly; the plan calls them on the meta device, so no memory is used. The module
also trains (it is an ordinary nn.Module). `tensor_parallel(model, mesh)` applies torchtitan's tensor-parallel plan
to it (attention and feed-forward column- then row-wise, norms sequence-parallel), as a module does in
`configure_model` under a strategy with `tensor_parallel_size` (docs/strategies.md, "Tensor parallel").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from strategies import sequence_positions


@dataclass
class LlamaConfig:
    vocab_size: int = 32000
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    hidden_dim: int = 11008
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


LLAMA_PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=176, max_seq_len=64),
    "7b": LlamaConfig(),  # Llama 2 7B: 6.74B parameters
    "70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, hidden_dim=28672),  # 68.98B
    "3.1-8b": LlamaConfig(
        vocab_size=128256, n_kv_heads=8, hidden_dim=14336, max_seq_len=8192, rope_theta=500000.0
    ),  # Llama 3.1 8B: 8.03B
    "3.1-70b": LlamaConfig(
        vocab_size=128256,
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        hidden_dim=28672,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),  # Llama 3.1 70B: 70.55B
    "3.1-405b": LlamaConfig(
        vocab_size=128256,
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        hidden_dim=53248,
        max_seq_len=8192,
        rope_theta=500000.0,
    ),  # Llama 3.1 405B: 405.85B
}


def rotate(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of x (batch, heads, time, head_dim), computed on the fly (no buffer)."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    # this rank's global positions under context parallel (torch.arange of the length otherwise)
    angles = sequence_positions(x.shape[-2], x.device).to(torch.float32)[:, None] * freqs
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if config.dim % config.n_heads or config.n_heads % config.n_kv_heads:
            raise ValueError("LlamaConfig: dim must divide by n_heads, and n_heads by n_kv_heads")
        self.n_heads, self.n_kv_heads, self.theta = config.n_heads, config.n_kv_heads, config.rope_theta
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallel each rank computes its share of the heads
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        q, k = rotate(q, self.theta), rotate(k, self.theta)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden_dim, bias=False)
        self.w2 = nn.Linear(config.hidden_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """The logits of `tokens`. Under pipeline parallel a stage holds some of the modules, the others are None
        and skipped: the first stage takes tokens, the later ones the activations of the stage before."""
        if tokens.shape[1] > self.config.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {self.config.max_seq_len}")
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x) if self.norm is not None else x
        return self.output(x) if self.output is not None else x


def tensor_parallel_plan(model: Llama | None = None, loss_parallel: bool = False) -> dict[str, ParallelStyle]:
    """torchtitan's tensor-parallel plan of Llama, as `parallelize_module` takes it: in each block the query, key,
    value and the feed-forward's first projections column-wise and the output projections row-wise, the norms and
    the activations between blocks sequence-parallel (split along the sequence), the embedding row-wise and the
    output projection column-wise, its logits gathered whole, or with `loss_parallel` left split over the
    vocabulary as a DTensor. `python -m strategies.plan examples.llama:llama_70b --tensor-parallel 8` plans it."""
    sequence = (Shard(1),)  # activations between blocks: split along the sequence
    return {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
        "layers.*.attention_norm": SequenceParallel(),
        "layers.*.attention": PrepareModuleInput(input_layouts=sequence, desired_input_layouts=(Replicate(),)),
        "layers.*.attention.wq": ColwiseParallel(),
        "layers.*.attention.wk": ColwiseParallel(),
        "layers.*.attention.wv": ColwiseParallel(),
        "layers.*.attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "layers.*.ffn_norm": SequenceParallel(),
        "layers.*.feed_forward": PrepareModuleInput(input_layouts=sequence, desired_input_layouts=(Replicate(),)),
        "layers.*.feed_forward.w1": ColwiseParallel(),
        "layers.*.feed_forward.w3": ColwiseParallel(),
        "layers.*.feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }


def tensor_parallel(model: Llama, mesh: DeviceMesh, loss_parallel: bool = False) -> Llama:
    """Split `model` over the ranks of `mesh` (a 1-D tensor-parallel mesh) with torch's tensor parallel, by
    `tensor_parallel_plan`: with `loss_parallel`, compute the loss and run backward inside torch's `loss_parallel()`
    (in a TrainModule: `training_step` and an overridden `backward`).

    The heads and the feed-forward width must divide by the mesh's size. Returns `model`, split in place.
    """
    size = mesh.size()
    config = model.config
    if config.n_kv_heads % size or config.hidden_dim % size:
        raise ValueError(
            f"tensor_parallel: n_kv_heads={config.n_kv_heads} and hidden_dim={config.hidden_dim} must divide by "
            f"the tensor-parallel size {size}"
        )
    parallelize_module(model, mesh, tensor_parallel_plan(model, loss_parallel))
    return model


def llama_tiny() -> Llama:
    return Llama(LLAMA_PRESETS["tiny"])


def llama_7b() -> Llama:
    return Llama(LLAMA_PRESETS["7b"])


def llama_70b() -> Llama:
    return Llama(LLAMA_PRESETS["70b"])


def llama3_8b() -> Llama:
    """Llama 3.1 8B's shape (8.03B parameters): what torchtitan's published H100 table trains."""
    return Llama(LLAMA_PRESETS["3.1-8b"])


def llama3_70b() -> Llama:
    """Llama 3.1 70B's shape (70.55B parameters), which torchtitan trains as FSDP x tensor parallel 8."""
    return Llama(LLAMA_PRESETS["3.1-70b"])
