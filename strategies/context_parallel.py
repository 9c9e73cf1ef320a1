"""Context parallel: the ranks of a context-parallel group read the same samples, each holds one part of every
sequence, and attention is exact over the whole sequence.

Per step, for the Trainer (strategies/base.py calls these):
- `split`: every tensor of the batch that has the sequence dimension (by default dimension 1 of every tensor of two
  or more dimensions whose size there is the sequence's) is cut into C equal consecutive parts; rank r keeps part
  r. The counted tokens of each part (targets other than -100, the `ignore_index` of torch and HuggingFace) are
  shared over the group, so that
- `weigh_loss` makes the ranks' losses (each the mean over its own tokens) average to the mean over every counted
  token of the sequences, and `combine` gives a value logged in a step (each rank's over its tokens) as the group's,
  each token counted once;
- `active`: while a step method runs, `F.scaled_dot_product_attention` becomes exact attention over the whole
  sequence ("ulysses", as DeepSpeed Ulysses: an all-to-all gives each rank all of the sequence for 1/C of the
  heads, attention runs as it is, and a second all-to-all gives back this rank's part for every head), and
  `sequence_positions` gives this rank's global positions.

A model computes positions with `sequence_positions(length)` where it would write `torch.arange(length)` (the
examples' GPT and Llama do); a HuggingFace model takes `position_ids` in the batch, which are split with it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._pytree import tree_flatten, tree_map

METHODS = ("ulysses", "ring")
IGNORE_INDEX = -100  # the targets a loss does not count (torch's cross_entropy, HuggingFace's labels)


def check_method(owner: str, method: Any) -> str:
    if method not in METHODS:
        raise ValueError(f"{owner}: context_parallel_method={method!r}; choose one of {list(METHODS)}")
    return method


class _Active:
    """The context-parallel group of the step method now running (one at a time in a process)."""

    parallel: ContextParallel | None = None


def sequence_positions(length: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The positions of a sequence of `length` tokens in the whole sequence: `torch.arange(length)`, except under
    context parallel, where a rank holding part r of C equal parts of a sequence gets r * length + arange(length).
    A model that takes its positions from this (rotary tables, position embeddings) trains as on one process."""
    parallel = _Active.parallel
    offset = 0 if parallel is None else parallel.rank * length
    return torch.arange(offset, offset + length, device=device)


class ContextParallel:
    """This rank's context-parallel group: `size` ranks, this one `rank` among them, splitting by `method`."""

    def __init__(self, size: int, method: str, group: Any, device: torch.device) -> None:
        if method == "ring" and device.type != "cuda":
            raise ValueError(
                "context_parallel_method='ring' runs torch's ring attention, which has CUDA kernels only; on "
                f"{device.type} use context_parallel_method='ulysses' (all-to-all around attention, any device)"
            )
        if method == "ring":
            raise ValueError(
                "context_parallel_method='ring' is not available yet; use 'ulysses' (exact, on every device)"
            )
        self.size, self.method, self.group, self.device = size, method, group, device
        self.rank = dist.get_rank(group)
        self._share = 1.0  # this rank's counted tokens over the group's mean, for the running step
        self._part = 0  # the length of this rank's part of the running step's sequences

    # ---- the batch ------------------------------------------------------------------------------------
    def split(self, batch: Any, dims: Any = None) -> Any:
        """This rank's part of every sequence in `batch`; learns each part's counted tokens (collective). `dims`:
        the sequence dimension of each tensor (a structure like the batch's, an int or None for each tensor), or
        None for the default rule (the module docstring's)."""
        if dims is not None:
            return self._split_by(batch, dims)
        length = _sequence_length(batch)
        if length % self.size:
            raise ValueError(
                f"context_parallel_size={self.size}: the batch's sequences have {length} tokens, which do not "
                f"split into {self.size} equal parts; pad them to a multiple of {self.size} (targets -100 in the "
                "padding, so that the loss does not count it)"
            )
        if isinstance(batch, dict) and "input_ids" in batch and "position_ids" not in batch:
            raise ValueError(
                "context parallel: the batch has input_ids but no position_ids. Under context parallel each rank "
                "holds part of every sequence, and a HuggingFace model derives positions from the length of its "
                "input; put position_ids (torch.arange(sequence length) for each sequence) in the batch, and "
                "they are split with it"
            )
        part = self._part = length // self.size

        def cut(t: Any) -> Any:
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == length:
                return t[:, self.rank * part : (self.rank + 1) * part]
            return t

        batch = tree_map(cut, batch)
        self._learn_shares(_counted_tokens(batch))
        return batch

    def _split_by(self, batch: Any, dims: Any) -> Any:
        """`split` with the sequence dimension of each tensor given (TrainModule.sequence_dims)."""
        lengths = {t.shape[d] for t, d in _with_dims(batch, dims)}
        if len(lengths) != 1:
            raise ValueError(
                f"sequence_dims: the dimensions named as the sequence have sizes {sorted(lengths)}; name the same "
                "sequence in every tensor (one length), None for tensors to keep whole"
            )
        length = lengths.pop()
        if length % self.size:
            raise ValueError(
                f"context_parallel_size={self.size}: the batch's sequences have {length} tokens, which do not "
                f"split into {self.size} equal parts; pad them to a multiple of {self.size}"
            )
        part = self._part = length // self.size
        batch = _cut_by(batch, dims, lambda t, d: t.narrow(d, self.rank * part, part))
        self._learn_shares(_counted_tokens(batch))
        return batch

    def join(self, output: Any) -> Any:
        """Whole sequences from every rank's part of them, in `output` (a prediction): each tensor whose
        dimension 1 is a part's length. Collective over the group."""

        def whole(t: Any) -> Any:
            if not (isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] == self._part):
                return t
            parts = [torch.empty_like(t) for _ in range(self.size)]
            dist.all_gather(parts, t.contiguous(), group=self.group)
            return torch.cat(parts, dim=1)

        return tree_map(whole, output)

    def _learn_shares(self, counted: int | None) -> None:
        if counted is None:
            self._share = 1.0
            return
        counts = torch.tensor([float(counted)], device=self.device)
        total = counts.clone()
        dist.all_reduce(total, group=self.group)
        self._share = float(counts) * self.size / float(total) if float(total) > 0 else 1.0

    # ---- the step ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Attention over the whole sequence and global positions while a step method (or its backward, which
        activation checkpointing recomputes blocks in) runs: `F.scaled_dot_product_attention`, looked up by the
        model's code when it calls it, is `_attention` meanwhile."""
        previous, _Active.parallel = _Active.parallel, self
        F.scaled_dot_product_attention = _attention
        try:
            yield
        finally:
            _Active.parallel = previous
            if previous is None:
                F.scaled_dot_product_attention = _SDPA

    @property
    def is_active(self) -> bool:
        """Whether a step method is running under it (`active`)."""
        return _Active.parallel is self

    def weigh_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss (this rank's mean over its counted tokens) weighed by its share of the group's tokens: the
        average over the group is the mean over all of them."""
        return loss if self._share == 1.0 else loss * self._share

    def combine(self, value: torch.Tensor) -> torch.Tensor:
        """A value logged in a step (this rank's, over its tokens) as the group's: weighed by each part's tokens.
        Collective over the group."""
        weighed = value.detach().to(self.device, torch.float64 if value.is_floating_point() else torch.float32)
        weighed = weighed * self._share / self.size
        dist.all_reduce(weighed, group=self.group)
        return weighed.to(value.dtype) if value.is_floating_point() else weighed


_SDPA = F.scaled_dot_product_attention  # torch's own, which the attention below calls


def _attention(*args: Any, **kwargs: Any) -> torch.Tensor:
    """F.scaled_dot_product_attention while a context-parallel step runs: over the whole sequence, for inputs of
    (batch, heads, this rank's part of the sequence, head dim)."""
    parallel = _Active.parallel
    if parallel is None:
        return _SDPA(*args, **kwargs)
    return ulysses_attention(parallel, *args, **kwargs)


def ulysses_attention(
    parallel: ContextParallel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    size, heads = parallel.size, query.shape[-3]
    if attn_mask is not None:
        raise ValueError(
            "context parallel: scaled_dot_product_attention was given an attn_mask, which is made for one part of "
            "the sequence; use is_causal=True (and targets -100 for padding) instead of a mask"
        )
    if heads % size:
        raise ValueError(
            f"context_parallel_size={size}: attention has {heads} heads on this rank, which do not split over "
            f"{size} ranks; the heads (over tensor_parallel_size) must divide by context_parallel_size"
        )
    if key.shape[-3] % size:  # too few key/value heads to split: give every query head its own (as GQA does)
        key, value = (t.repeat_interleave(heads // t.shape[-3], dim=-3) for t in (key, value))
        enable_gqa = False
    q, k, v = (_whole_sequence(t, parallel) for t in (query, key, value))
    scale = scale if scale is not None else 1.0 / math.sqrt(query.shape[-1])
    out = _SDPA(q, k, v, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    return _own_part(out, parallel)


class _Exchange(torch.autograd.Function):
    """An all-to-all of equal chunks along dimension 0, through autograd: its backward is the same exchange of the
    gradient. On gloo a CUDA tensor goes through host memory (gloo's all-to-all carries host tensors)."""

    @staticmethod
    def forward(ctx: Any, chunks: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(chunks, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_to_all(grad.contiguous(), ctx.group), None


def _all_to_all(chunks: torch.Tensor, group: Any) -> torch.Tensor:
    if chunks.device.type != "cpu" and dist.get_backend(group) == "gloo":
        host = chunks.cpu()
        received = torch.empty_like(host)
        dist.all_to_all_single(received, host, group=group)
        return received.to(chunks.device)
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)
    return received


def _whole_sequence(x: torch.Tensor, parallel: ContextParallel) -> torch.Tensor:
    """(batch, heads, part, dim) on each rank -> (batch, heads / C, whole sequence, dim): rank j gets heads j."""
    c = parallel.size
    b, h, s, d = x.shape
    chunks = x.reshape(b, c, h // c, s, d).transpose(0, 1).contiguous()  # chunk j: heads j, for rank j
    received = _Exchange.apply(chunks, parallel.group)  # from j: its part
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)


def _own_part(y: torch.Tensor, parallel: ContextParallel) -> torch.Tensor:
    """(batch, heads / C, whole sequence, dim) -> (batch, heads, this rank's part, dim)."""
    c = parallel.size
    b, hc, whole, d = y.shape
    chunks = y.reshape(b, hc, c, whole // c, d).permute(2, 0, 1, 3, 4).contiguous()  # chunk j: part j
    received = _Exchange.apply(chunks, parallel.group)  # from j: heads j
    return received.permute(1, 0, 2, 3, 4).reshape(b, c * hc, whole // c, d)


def _with_dims(batch: Any, dims: Any) -> list[tuple[torch.Tensor, int]]:
    """(tensor, its sequence dimension) for every tensor of `batch` that `dims` names a dimension of."""
    out: list[tuple[torch.Tensor, int]] = []
    _cut_by(batch, dims, lambda t, d: out.append((t, d)) or t)
    if not out:
        raise ValueError("sequence_dims named no tensor of the batch: give the sequence dimension of at least one")
    return out


def _cut_by(batch: Any, dims: Any, cut: Any) -> Any:
    """`batch` with `cut(tensor, dim)` for each tensor whose place in `dims` (a structure like the batch's: dicts,
    lists, tuples) is an int; None keeps that part whole."""
    if dims is None:
        return batch
    if isinstance(dims, int) and not isinstance(dims, bool):
        if not isinstance(batch, torch.Tensor):
            raise ValueError(f"sequence_dims names dimension {dims} of a {type(batch).__name__}, not of a tensor")
        return cut(batch, dims)
    if isinstance(batch, dict) and isinstance(dims, dict):
        return {k: _cut_by(v, dims.get(k), cut) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)) and isinstance(dims, (list, tuple)) and len(batch) == len(dims):
        return type(batch)(_cut_by(b, d, cut) for b, d in zip(batch, dims))
    raise ValueError(
        f"sequence_dims returned {dims!r} for a {type(batch).__name__} of the batch; give the batch's structure "
        "(a dict, list or tuple alike) with an int (the sequence dimension) or None for each tensor"
    )


def _sequence_length(batch: Any) -> int:
    """Dimension 1 of the batch's first tensor of two or more dimensions."""
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2:
            return leaf.shape[1]
    raise ValueError(
        "context parallel: no tensor in the batch has a sequence dimension (dimension 1 of a tensor of shape "
        "(batch, sequence, ...)); give batches of such tensors, or say which dimension is the sequence with the "
        "module's sequence_dims"
    )


def _counted_tokens(batch: Any) -> int | None:
    """The tokens the loss counts in this part: the targets (a dict's "labels", else the last tensor of a tuple or
    list) other than IGNORE_INDEX; None when the batch has no integer targets."""
    if isinstance(batch, dict):
        targets = batch.get("labels", batch.get("targets"))
    elif isinstance(batch, (list, tuple)) and batch:
        targets = batch[-1]
    else:
        targets = None
    if not isinstance(targets, torch.Tensor) or targets.is_floating_point() or targets.dim() < 2:
        return None
    return int((targets != IGNORE_INDEX).sum())


# ---- for the memory plan and the forecast (strategies/plan/) --------------------------------------------------
@contextlib.contextmanager
def planned_attention(size: int, exchanged: list[int] | None = None) -> Iterator[None]:
    """Attention as a rank of `size` computes it under "ulysses", for a plan's fake step of one rank's part of the
    sequence (no communication): all of the sequence for 1/size of the heads, with the buffers each exchange
    sends and receives; the bytes each exchange sends go in `exchanged` (four per attention in forward, and as
    many in backward)."""

    def exchange(t: torch.Tensor, heads: int, length: int) -> torch.Tensor:
        sent = t.contiguous()
        if exchanged is not None:
            exchanged.append(sent.numel() * sent.element_size())
        received = sent.clone()  # (the receive buffer; the layout's order does not change a shape's cost)
        return received.reshape(t.shape[0], heads, length, t.shape[-1])

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kwargs: Any):
        b, h, s, d = query.shape
        if key.shape[-3] % size:
            key, value = (t.repeat_interleave(h // t.shape[-3], dim=-3) for t in (key, value))
            kwargs["enable_gqa"] = False
        q, k, v = (exchange(t, t.shape[-3] // size, s * size) for t in (query, key, value))
        return exchange(_SDPA(q, k, v, *args, **kwargs), h, s)

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = _SDPA
