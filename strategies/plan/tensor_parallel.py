"""Tensor parallel in the plan: one rank's share of a model split by a torch tensor-parallel plan, and the
collectives the split adds to each step.

The plan is what `parallelize_module` takes, `{module path: ParallelStyle}` (paths may hold `*` wildcards, matched
level by level as torch matches them). There is no process group at planning time, so no DTensor either: the meta
copy of the model is changed in place into what one of the `size` ranks computes:

- `ColwiseParallel` / `RowwiseParallel` parameters get the shape of the largest local piece (a `Linear`'s weight
  split along its output or input features, its bias along the output or replicated; an `Embedding`'s weight along
  the embedding or the vocabulary dimension), as DTensor's `Shard` splits them;
- activations follow the layouts the styles give them: a sequence-split input gathered whole (`Shard(1)` to
  `Replicate`) is repeated `size` times along the sequence, a row-wise output reduce-scattered onto the sequence
  (`Shard(1)`) is cut to its local part, a column-wise output gathered whole (`Replicate`, the logits without loss
  parallel) is repeated along the last dimension. Sequence-parallel norms then run on their part of the sequence.

So the fake passes of the plan (activations.py, compute.py) see each rank's parameters, activations and matmuls.
Each change of layout is a collective, recorded with its bytes (`TensorParallelCollectives`), as the engine runs
torch's tensor parallel (checked against torch's CommDebugMode in tests/test_plan.py): in forward as the layout
changes, in backward its dual (a sequence gathered whole is reduce-scattered back, a reduce-scatter's gradient
gathered; a column-wise output gathered whole, or a row-wise output summed whole, needs nothing back; a column-wise
layer given a plain replicated input all-reduces that input's gradient), and the sequence-parallel norms' weight
gradients all-reduced in backward. torch runs these on the compute stream, so they add to the step, overlapped
with nothing (async tensor parallel, which overlaps them, is not planned).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

from .compute import ComputeCost
from .hardware import Link
from .link import collective_seconds

SEQUENCE_DIM = 1  # activations are (batch, sequence, features)
LOSS_PARALLEL_REDUCTIONS = 3  # all-reduces of torch's loss_parallel cross entropy, one fp32 value per token each
STYLES = (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput, PrepareModuleOutput)


def resolve_plan(model: nn.Module, plan: dict[str, Any] | Callable[[nn.Module], dict[str, Any]]) -> dict[str, Any]:
    """`plan` (or what it returns for `model`) with every path matched to the modules it names, as torch's
    parallelize_module matches it: {module name: style}."""
    plan = plan(model) if callable(plan) else plan
    if not isinstance(plan, dict):
        raise ValueError(
            f"tensor_parallel_plan: a dict {{module path: ParallelStyle}} (what parallelize_module takes) or a "
            f"function of the model returning one; got {type(plan).__name__}"
        )
    resolved = {}
    for path, style in plan.items():
        if not isinstance(style, STYLES):
            raise ValueError(
                f"tensor_parallel_plan[{path!r}]: {type(style).__name__} is not one of the styles the plan "
                f"knows ({', '.join(s.__name__ for s in STYLES)})"
            )
        matched = [name for name, _ in model.named_modules() if _matches(name, path)]
        if not matched:
            raise ValueError(f"tensor_parallel_plan[{path!r}]: no module of {type(model).__name__} has that path")
        resolved.update(dict.fromkeys(matched, style))
    return resolved


def _matches(name: str, path: str) -> bool:
    tokens, parts = path.split(".") if path else [], name.split(".") if name else []
    return len(tokens) == len(parts) and all(fnmatch(part, token) for part, token in zip(parts, tokens))


def _split_dims(module: nn.Module, style: Any, name: str) -> dict[str, int]:
    """The parameters of `module` that `style` splits, and along which dimension."""
    colwise = isinstance(style, ColwiseParallel)
    if isinstance(module, nn.Linear):
        return {"weight": 0, "bias": 0} if colwise else {"weight": 1}
    if isinstance(module, nn.Embedding):
        return {"weight": 1 if colwise else 0}
    raise ValueError(
        f"tensor_parallel_plan[{name!r}]: {type(style).__name__} splits nn.Linear and nn.Embedding only (as torch's "
        f"does); the module there is a {type(module).__name__}"
    )


@dataclass
class TensorParallelCollectives:
    """The collectives of one rank's step over its tensor-parallel group: (kind, bytes) in forward and backward."""

    size: int
    forward: list[tuple[str, int]] = field(default_factory=list)
    backward: list[tuple[str, int]] = field(default_factory=list)
    _seen: set[str] = field(default_factory=set)
    replicated: set[int] = field(default_factory=set)  # ids of inputs made whole by a module above (DTensors)

    def record(self, where: str, kind: str | None, nbytes: int, dual: str | None) -> None:
        """A layout change at `where`: `kind` of `nbytes` in forward (None: none), `dual` in backward (None:
        none). A recomputation of the forward (activation checkpointing) runs `kind` again, in backward."""
        if where in self._seen:
            if kind is not None:
                self.backward.append((kind, nbytes))
            return
        self._seen.add(where)
        if kind is not None:
            self.forward.append((kind, nbytes))
        if dual is not None:
            self.backward.append((dual, nbytes))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _is_sequence(layout: Any) -> bool:
    return isinstance(layout, Shard) and layout.dim in (SEQUENCE_DIM, SEQUENCE_DIM - 3)


def _gathered(t: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    return torch.cat([t] * size, dim=dim)


def _local_part(t: torch.Tensor, size: int, dim: int) -> torch.Tensor:
    return t.narrow(dim, 0, math.ceil(t.shape[dim] / size)).clone()  # its own storage: the whole one is freed


def split_for_one_rank(model: nn.Module, plan: dict[str, Any], size: int) -> TensorParallelCollectives:
    """Change `model` (a meta copy) in place into one rank's share under `plan` (resolve_plan's) over `size`
    ranks; the returned record fills as forward passes run through it."""
    collectives = TensorParallelCollectives(size)
    for name, style in plan.items():
        module = model.get_submodule(name)
        if isinstance(style, (ColwiseParallel, RowwiseParallel)):
            for param_name, dim in _split_dims(module, style, name).items():
                _shrink(module, param_name, dim, size)
        _follow_layouts(module, name, style, size, collectives)
    return collectives


def _shrink(module: nn.Module, param_name: str, dim: int, size: int) -> None:
    param = getattr(module, param_name, None)
    if param is None:
        return
    shape = list(param.shape)
    shape[dim] = math.ceil(shape[dim] / size)
    local = torch.empty(shape, dtype=param.dtype, device="meta")
    setattr(module, param_name, nn.Parameter(local, requires_grad=param.requires_grad))


def _follow_layouts(module: nn.Module, name: str, style: Any, size: int, record: TensorParallelCollectives) -> None:
    """Hooks that give `module`'s inputs and outputs the shapes `style`'s layouts give them on one rank, recording
    each change as a collective."""
    if isinstance(style, ColwiseParallel):
        gather_input = _is_sequence(style.input_layouts[0])
        gather_output = isinstance(style.output_layouts[0], Replicate)
        loss_parallel = not style.use_local_output and isinstance(module, nn.Linear)  # logits left as a DTensor

        def colwise_input(_module: nn.Module, args: tuple) -> tuple:
            x = args[0]
            if gather_input:  # sequence-split input gathered whole; its gradient reduce-scattered back
                x = _gathered(x, size, SEQUENCE_DIM)
                record.record(name, "all_gather", _nbytes(x), "reduce_scatter")
            elif id(x) not in record.replicated:  # a plain replicated input: its gradient summed over the ranks
                record.record(name, None, _nbytes(x), "all_reduce")
            # (a DTensor made whole above sums its gradients once, where it was made: _prepare)
            return (x, *args[1:])

        def colwise_output(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            if not gather_output:
                if loss_parallel:  # cross entropy over split logits: max, sum of exponentials, target's logit
                    for i in range(LOSS_PARALLEL_REDUCTIONS):
                        record.record(f"{name}:loss{i}", "all_reduce", out[..., 0].numel() * 4, None)
                return out
            whole = _gathered(out, size, -1)  # its gradient needs no collective: each rank keeps its columns
            record.record(f"{name}:out", "all_gather", _nbytes(whole), None)
            return whole

        module.register_forward_pre_hook(colwise_input)
        module.register_forward_hook(colwise_output)
    elif isinstance(style, RowwiseParallel):
        scatter = _is_sequence(style.output_layouts[0])
        cut_input = isinstance(style.input_layouts[0], Replicate) and isinstance(module, nn.Linear)

        def rowwise_input(_module: nn.Module, args: tuple) -> tuple:  # a replicated input: each rank its part
            return (_local_part(args[0], size, -1), *args[1:])

        if cut_input:
            module.register_forward_pre_hook(rowwise_input)

        def rowwise_output(_module: nn.Module, _args: tuple, out: torch.Tensor) -> torch.Tensor:
            if scatter:  # partial sums reduce-scattered onto the sequence; the gradient gathered back
                record.record(name, "reduce_scatter", _nbytes(out), "all_gather")
                return _local_part(out, size, SEQUENCE_DIM)
            record.record(name, "all_reduce", _nbytes(out), None)
            return out

        module.register_forward_hook(rowwise_output)
    elif isinstance(style, SequenceParallel):  # replicated weights, sequence-split inputs: gradients summed

        def sequence_parallel(_module: nn.Module, _args: tuple, out: Any) -> Any:
            for param_name, param in _module.named_parameters(recurse=False):
                if param.requires_grad:
                    record.record(f"{name}.{param_name}", None, _nbytes(param), "all_reduce")
            return out

        module.register_forward_hook(sequence_parallel)
    elif isinstance(style, PrepareModuleInput):
        module.register_forward_pre_hook(_prepare(name, style.input_layouts, style.desired_input_layouts, size, record))
    elif isinstance(style, PrepareModuleOutput):

        def prepare_output(_module: nn.Module, _args: tuple, out: Any) -> Any:
            change = _prepare(name, style.output_layouts, style.desired_output_layouts, size, record)
            result = change(_module, out if isinstance(out, tuple) else (out,))
            return result if isinstance(out, tuple) else result[0]

        module.register_forward_hook(prepare_output)


def _prepare(name: str, layouts: Any, desired: Any, size: int, record: TensorParallelCollectives) -> Callable:
    """A hook changing positional tensors from `layouts` to `desired` (sequence-split <-> replicated)."""

    def change(_module: nn.Module, args: tuple) -> tuple:
        out = list(args)
        for i, (have, want) in enumerate(zip(layouts or (), desired or ())):
            if i >= len(out) or not isinstance(out[i], torch.Tensor) or have is None:
                continue
            if _is_sequence(have) and isinstance(want, Replicate):
                out[i] = _gathered(out[i], size, SEQUENCE_DIM)
                record.record(f"{name}:{i}", "all_gather", _nbytes(out[i]), "reduce_scatter")
                record.replicated.add(id(out[i]))
            elif isinstance(have, Replicate) and _is_sequence(want):  # no collective; gathered back in backward
                record.record(f"{name}:{i}", None, _nbytes(out[i]), "all_gather")
                out[i] = _local_part(out[i], size, SEQUENCE_DIM)
        return tuple(out)

    return change


def with_collectives(
    cost: ComputeCost, record: TensorParallelCollectives, link: Link, slowdown: float = 1.0
) -> tuple[ComputeCost, float]:
    """`cost` with the tensor-parallel collectives on its clock (forward's spread over forward's modules in
    proportion to their time, backward's added to backward), and their seconds: the link's, times `slowdown`
    (Hardware.tensor_parallel_slowdown)."""
    forward_s = slowdown * sum(collective_seconds(k, nbytes, record.size, link) for k, nbytes in record.forward)
    backward_s = slowdown * sum(collective_seconds(k, nbytes, record.size, link) for k, nbytes in record.backward)
    scale = 1 + forward_s / cost.forward_total if cost.forward_total else 1.0
    timed = replace(
        cost, forward=[(owner, s * scale) for owner, s in cost.forward], backward=cost.backward + backward_s
    )
    return timed, forward_s + backward_s
