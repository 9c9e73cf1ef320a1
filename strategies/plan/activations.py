"""Activation bytes: one training forward and backward on fake tensors (shapes and dtypes, no memory), counting
- the distinct storages autograd saves for backward (torch.autograd.graph.saved_tensors_hooks): `saved`;
- every storage alive at any moment, whatever holds it (LiveBytes sees each op's outputs and when they die): `live`,
  whose peak adds to the saved tensors what exists only for a while: a gradient being formed while the input it
  needs is still saved, the loss's and the logits' gradients, the output of an op before its input is freed.
Parameters and buffers are model state, counted by model_bytes.py, and so are the parameters' gradients: each is
dropped once accumulated (the strategies move it into a bucket or reduce it), so `live` counts it only while it
is being formed.

Fake tensors (torch's FakeTensorMode, as torch.compile traces with) rather than meta ones, because autocast acts on
a device type: the fake tensors say "cpu", so bf16-mixed and 16-mixed cast as they would in training.
A module chosen for activation checkpointing keeps only its inputs; its other saved tensors are let go in forward
and, as torch.utils.checkpoint recomputes them, come back together at the first one backward reads, each freed
once backward has used it; so the largest one's saved tensors come back on top of what is kept.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map

from ..sharding.hooks import cast_floating
from ..sharding.unit import NORM_LAYERS
from .activation_checkpointing import checkpoint_modules

AUTOCAST = {"32": None, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16, "bf16-true": None, "16-true": None}
TRUE_DTYPES = {"bf16-true": torch.bfloat16, "16-true": torch.float16}  # the whole model in this dtype


def _storage(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage._cdata, storage.nbytes()


class _Held:
    """A saved tensor as autograd holds it; dropping it (the graph is freed) releases its storage's count."""

    __slots__ = ("tensor", "release")

    def __init__(self, tensor: torch.Tensor, release: Callable[[], None]) -> None:
        self.tensor, self.release = tensor, release

    def __del__(self) -> None:
        self.release()


class LiveBytes(FakeTensorMode):
    """A FakeTensorMode that also counts the bytes of the storages alive (outside `excluded`), and their peak: each
    op's outputs are counted until the last tensor on their storage is freed. Counts only while `counting`."""

    def __init__(self) -> None:
        super().__init__()
        self.excluded: set[int] = set()
        self.counting = False
        self.depth = 0
        self.tensors: dict[int, int] = {}  # storage -> tensors alive on it
        self.live = self.peak = 0
        self.segment_peak = 0  # the peak since the last gradient was accumulated (see cut)
        self.region_peak = 0  # the peak since a checkpointed module's forward began
        self.segment_peaks: list[int] = []

    def cut(self) -> None:
        """A parameter's gradient was accumulated: the peak so far is that of the segment before it."""
        self.segment_peaks.append(self.segment_peak)
        self.segment_peak = self.live

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # An op the mode has not seen before may run as a decomposition into other ops, dispatched here too;
        # their tensors are the op's insides, not a kernel's allocations: only the outermost op's outputs count.
        self.depth += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.depth -= 1
        if self.counting and self.depth == 0:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.track(t)
        return out

    def track(self, t: torch.Tensor) -> None:
        key, nbytes = _storage(t)
        if key in self.excluded:
            return
        if not self.tensors.get(key):
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            self.segment_peak = max(self.segment_peak, self.live)
            self.region_peak = max(self.region_peak, self.live)
        self.tensors[key] = self.tensors.get(key, 0) + 1
        # a fake tensor's Python object lives as long as its TensorImpl, wherever that is held (autograd's graph)
        weakref.finalize(t, self._release, self.tensors, key, nbytes)

    def _release(self, pass_tensors: dict[int, int], key: int, nbytes: int) -> None:
        if pass_tensors is not self.tensors:
            return  # a tensor of an earlier pass (a batch form that failed), forgotten when the next one began
        self.tensors[key] -= 1
        if not self.tensors[key]:
            del self.tensors[key]
            self.live -= nbytes


class _Region:
    """The tensors one checkpointed module saved, by storage: let go in forward, all recomputed at the first one
    backward reads."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}  # key -> nbytes
        self.originals: list[Any] = []  # the saved storages' objects: no other storage takes their key meanwhile
        self.handles: dict[int, int] = {}  # key -> what autograd still holds on it
        self.recomputed: dict[int, torch.Tensor] | None = None
        self.forward_rise = 0  # the most the module's forward held at once above what it was given

    def storage(self, key: int) -> torch.Tensor:
        if self.recomputed is None:
            # the recomputing forward holds, at its peak, as much as the first one did
            self.recomputed = {k: torch.empty(n, dtype=torch.uint8) for k, n in self.storages.items()}
            passing = self.forward_rise - sum(self.storages.values())
            if passing > 0:
                torch.empty(passing, dtype=torch.uint8)  # made and freed: the recomputation's other tensors
        return self.recomputed[key]

    def release(self, key: int) -> None:
        self.handles[key] -= 1
        if not self.handles[key] and self.recomputed is not None:  # backward is done with it
            self.recomputed.pop(key, None)


class _Recomputed:
    """What autograd holds for a tensor saved inside a checkpointed module: its shape, not its storage."""

    __slots__ = ("region", "key", "dtype", "size", "stride", "offset")

    def __init__(self, region: _Region, t: torch.Tensor) -> None:
        self.region, self.key = region, _storage(t)[0]
        self.dtype, self.size, self.stride, self.offset = t.dtype, t.shape, t.stride(), t.storage_offset()
        region.handles[self.key] = region.handles.get(self.key, 0) + 1

    def tensor(self) -> torch.Tensor:
        base = self.region.storage(self.key)
        return torch.empty(0, dtype=self.dtype).set_(base.untyped_storage(), self.offset, self.size, self.stride)

    def __del__(self) -> None:
        self.region.release(self.key)


class SavedBytes:
    """Live bytes of the storages autograd holds, counted once each however many ops save them, and their peak."""

    def __init__(self, excluded: set[int], mode: LiveBytes | None = None) -> None:
        self.excluded = excluded  # parameters and buffers: model state, not activations
        self.mode = mode  # whose live bytes a checkpointed module's forward raises
        self.region_start = 0
        self.counts: dict[int, int] = {}
        self.live = self.peak = 0
        self.depth = 0  # > 0 inside a checkpointed module
        self.region = _Region()  # storages saved inside the current checkpointed module
        self.largest_region = 0
        self.kept: list[_Held] = []  # inputs of checkpointed modules

    def hold(self, t: torch.Tensor) -> _Held | torch.Tensor:
        key, nbytes = _storage(t)
        if key in self.excluded:
            return t
        if self.counts.get(key, 0) == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self.counts[key] = self.counts.get(key, 0) + 1

        def release() -> None:
            self.counts[key] -= 1
            if self.counts[key] == 0:
                self.live -= nbytes

        return _Held(t, release)

    def pack(self, t: torch.Tensor) -> Any:
        if self.depth == 0:
            return self.hold(t)
        key, nbytes = _storage(t)
        if key in self.excluded or self.counts.get(key):
            return t  # model state, or a tensor kept anyway (the module's input)
        if key not in self.region.storages:
            self.region.storages[key] = nbytes  # recomputed in backward, not kept
            self.region.originals.append(t.untyped_storage())
        return _Recomputed(self.region, t)

    @staticmethod
    def unpack(held: Any) -> torch.Tensor:
        if isinstance(held, _Recomputed):
            return held.tensor()
        return held.tensor if isinstance(held, _Held) else held

    def enter_checkpointed(self, _module: nn.Module, args: tuple) -> None:
        if self.depth == 0:
            self.kept += [self.hold(a) for a in tree_leaves(args) if isinstance(a, torch.Tensor)]
            self.region = _Region()
            if self.mode is not None:
                self.region_start = self.mode.region_peak = self.mode.live
        self.depth += 1

    def leave_checkpointed(self, _module: nn.Module, _args: tuple, _output: Any) -> None:
        self.depth -= 1
        if self.depth == 0:
            self.largest_region = max(self.largest_region, sum(self.region.storages.values()))
            if self.mode is not None:
                self.region.forward_rise = self.mode.region_peak - self.region_start


def to_fake(model: nn.Module, mode: FakeTensorMode, param_dtype: torch.dtype | None) -> set[int]:
    """Swap every parameter and buffer for a fake CPU tensor (in `param_dtype` if given, except in normalization
    layers, as the engine keeps them); returns their storages."""
    swapped: dict[int, torch.Tensor] = {}
    for module in model.modules():
        keep_dtype = isinstance(module, NORM_LAYERS)
        for table in (module._parameters, module._buffers):
            for key, t in table.items():
                if t is None:
                    continue
                if id(t) not in swapped:
                    dtype = param_dtype if param_dtype and t.is_floating_point() and not keep_dtype else t.dtype
                    with mode:
                        swapped[id(t)] = torch.empty(t.shape, dtype=dtype).requires_grad_(t.requires_grad)
                table[key] = swapped[id(t)]
    return {_storage(t)[0] for t in swapped.values()}


def _norms_in_full_precision(model: nn.Module) -> list[Any]:
    """As the engine runs normalization units under a param dtype: inputs cast up, outputs back down."""
    handles = []
    for module in model.modules():
        if isinstance(module, NORM_LAYERS):
            dtype = next(module.parameters(), torch.empty(0)).dtype

            def cast_up(_m: nn.Module, args: tuple, dtype: torch.dtype = dtype) -> tuple:
                _m._plan_input_dtype = next((a.dtype for a in args if torch.is_tensor(a)), dtype)
                return cast_floating(args, dtype)

            handles.append(module.register_forward_pre_hook(cast_up))
            handles.append(module.register_forward_hook(lambda m, _a, out: cast_floating(out, m._plan_input_dtype)))
    return handles


def first_parameter_module(model: nn.Module) -> nn.Module | None:
    return next((m for m in model.modules() if any(True for _ in m.parameters(recurse=False))), None)


def example_batches(model: nn.Module, batch_size: int, seq_len: int | None, sample: Any) -> list[tuple[Any, Any]]:
    """(batch, targets) candidates, the first that runs is used: the module's example_input, else a batch of
    `sample`'s shapes, else for a token model (its first parameter an Embedding) int64 tokens, whose targets are
    the tokens; a TrainModule's training_step gets them as (inputs, targets), as one tensor, or as a dict of
    HuggingFace's names, whichever it takes. Call under the fake mode."""
    if callable(getattr(model, "example_input", None)):
        return [(model.example_input(batch_size, seq_len), None)]
    if sample is not None:
        return [(tree_map(lambda v: _batched(v, batch_size), sample), None)]
    if isinstance(first_parameter_module(model), nn.Embedding):
        if seq_len is None:
            raise ValueError("seq_len: give the sequence length of the planned batch (--seq-len)")
        tokens = torch.zeros(batch_size, seq_len, dtype=torch.long)
        if not callable(getattr(model, "training_step", None)):
            return [(tokens, tokens)]
        return [((tokens, tokens), None), (tokens, None), ({"input_ids": tokens, "labels": tokens}, None)]
    raise ValueError(_no_batch(model))


def _no_batch(model: nn.Module) -> str:
    return (
        f"{type(model).__name__}: the plan cannot make a batch for it; define example_input(batch_size, seq_len) "
        "on the module (it returns the forward's input, or training_step's batch for a TrainModule)"
        + (", or pass train_dataloaders" if callable(getattr(model, "training_step", None)) else "")
    )


def _batched(value: Any, batch_size: int) -> Any:
    """What a DataLoader's default collate makes of `batch_size` samples like `value`."""
    if isinstance(value, torch.Tensor):
        return torch.empty((batch_size, *value.shape), dtype=value.dtype)
    if isinstance(value, (bool, int, float)):
        dtype = {bool: torch.bool, int: torch.long, float: torch.float64}[type(value)]
        return torch.zeros(batch_size, dtype=dtype)
    return value


def training_loss(model: nn.Module, batch: Any, targets: Any) -> torch.Tensor:
    """training_step's loss for a TrainModule (its logging switched off), else the forward's output reduced:
    next-token cross-entropy for token models (of the output's `logits` where it has them, as HuggingFace's
    models return them), the mean of every floating output otherwise."""
    if callable(getattr(model, "training_step", None)):
        model.log = model.log_dict = lambda *args, **kwargs: None
        out = model.training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out
    out = model(*batch) if isinstance(batch, tuple) else model(batch)
    if targets is not None:
        logits = getattr(out, "logits", out)
        return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten())
    return sum(t.float().mean() for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point())


@dataclass(frozen=True)
class StepActivations:
    """Peak bytes of one training forward and backward beside the model state: what autograd saves (`saved`), and
    everything alive (`live`: saved tensors, gradients being formed, the loss's and logits' gradients, ...)."""

    saved: int
    live: int
    # The live peak between gradients: segment_peaks[i] is the peak before the parameter gradient_order[i] had its
    # gradient accumulated (and after the one before), the last entry the peak after the last one. Strategies
    # that hold gradients per unit add what they hold at each moment (model_bytes.py).
    segment_peaks: tuple[int, ...] = ()
    gradient_order: tuple[str, ...] = ()

    @property
    def temporaries(self) -> int:
        """What the live peak holds beyond the saved tensors' peak."""
        return max(0, self.live - self.saved)


def step_activations(
    model: nn.Module,
    batch_size: int,
    seq_len: int | None = None,
    precision: str = "32",
    param_dtype: torch.dtype | None = None,
    checkpointed: Callable[[nn.Module, str], bool] | None = None,
    sample: Any = None,
    selective: bool = False,
) -> StepActivations:
    """Peak bytes autograd holds for backward in one training step of `model` (whose parameters are swapped for
    fake tensors: pass a copy; `checkpointed` is an activation-checkpointing policy (module, name) -> bool), with
    the peak of everything alive in it as well. `selective`: the checkpointed
    modules run under torch.utils.checkpoint with torchtitan's per-op policy (activation_checkpointing.py), whose saved
    outputs count as alive."""
    if selective and checkpointed is not None:
        checkpoint_modules(model, checkpointed, "selective")
        checkpointed = None
    mode = LiveBytes()
    excluded = to_fake(model, mode, param_dtype)
    mode.excluded = excluded
    model.train()
    with mode:
        candidates = example_batches(model, batch_size, seq_len, sample)
    failures = []
    for batch, targets in candidates:
        try:
            with _collector_paused():
                return _step_bytes(model, mode, excluded, batch, targets, precision, param_dtype, checkpointed)
        except (TypeError, ValueError, IndexError, KeyError, RuntimeError) as error:
            if len(candidates) == 1:
                raise
            failures.append(f"{_shape_of(batch)}: {type(error).__name__}: {error}")
    raise ValueError(_no_batch(model) + "; its training_step took none of " + "; ".join(failures))


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Tensors are counted until they are freed; one caught in a reference cycle is freed whenever Python's cycle
    collector happens to run, which depends on everything the process allocated before. With the collector
    paused for the pass such a tensor counts until the pass ends, the same in every run (the first plan of a
    process gave a different peak from the next one, now and then, before)."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _shape_of(batch: Any) -> str:
    return str(tree_map(lambda v: f"{v.dtype} {tuple(v.shape)}" if isinstance(v, torch.Tensor) else v, batch))


def _drop_gradients(model: nn.Module, mode: LiveBytes, order: list[str]) -> list[Any]:
    """Each parameter's gradient is let go once accumulated: the strategies hold gradients in their own buffers
    (model_bytes.py counts them), so here a gradient is alive only while it is being formed. Records the order
    in which the gradients come, by parameter name."""
    names = {id(p): name for name, p in model.named_parameters()}

    def drop(p: torch.Tensor) -> None:
        p.grad = None
        mode.cut()
        order.append(names[id(p)])

    return [p.register_post_accumulate_grad_hook(drop) for p in model.parameters() if p.requires_grad]


def _step_bytes(
    model: nn.Module,
    mode: LiveBytes,
    excluded: set[int],
    batch: Any,
    targets: Any,
    precision: str,
    param_dtype: torch.dtype | None,
    checkpointed: Any,
) -> StepActivations:
    saved = SavedBytes(excluded, mode)
    mode.live = mode.peak = mode.segment_peak = 0
    mode.tensors = {}
    mode.segment_peaks.clear()
    order: list[str] = []
    with ExitStack() as stack:
        handles = _norms_in_full_precision(model) if param_dtype is not None else []
        handles += _drop_gradients(model, mode, order)
        for name, module in model.named_modules():
            if name and checkpointed is not None and checkpointed(module, name):
                handles.append(module.register_forward_pre_hook(saved.enter_checkpointed))
                handles.append(module.register_forward_hook(saved.leave_checkpointed))
        stack.callback(lambda: [h.remove() for h in handles])
        stack.enter_context(mode)
        mode.counting = True
        stack.callback(setattr, mode, "counting", False)
        for t in tree_leaves(batch):  # the batch is alive through the step
            if isinstance(t, torch.Tensor):
                mode.track(t)
        autocast = AUTOCAST[precision]
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
            with torch.autocast("cpu", dtype=autocast) if autocast else nullcontext():
                loss = training_loss(model, batch, targets)
            at_backward = saved.live
            loss.backward()
        saved.kept.clear()
    segments = (*mode.segment_peaks, mode.segment_peak)
    return StepActivations(max(saved.peak, at_backward + saved.largest_region), mode.peak, segments, tuple(order))
