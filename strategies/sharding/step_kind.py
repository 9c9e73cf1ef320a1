"""What an optimizer's step reads: each element on its own, each tensor whole, or every tensor together.

The engine hands an optimizer this rank's flat pieces of the parameters only when that gives one process's
numbers, which is when the step is element-wise: every element of the update depends on that element's value,
gradient and state alone (SGD, Adam, AdamW, ...). A step that reads a whole tensor (Adafactor's row and column
factors, Muon's orthogonalisation, LAMB's trust ratio, SOAP's preconditioners) is stepped on whole tensors
(whole_tensors.py); a step that reads every tensor at once (LBFGS's one vector of all parameters) cannot run on
sharded state at all.

torch's own optimizers are classified from their code (`KNOWN`, the table in docs/optimizers.md). Any other class
is checked before its first step (`probe`): the same optimizer, with the same hyperparameters, steps small tensors
whole, cut into flat pieces, and each tensor in an optimizer of its own; the runs that agree with the whole one
tell what the step reads. A class the check cannot build is stepped on whole tensors, which is exact for every
optimizer that steps each tensor on its own.
"""

from __future__ import annotations

import enum
import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch


class StepKind(enum.Enum):
    ELEMENTWISE = "element-wise"  # may step any flat pieces of the parameters
    PER_TENSOR = "per tensor"  # needs each parameter whole, its own shape
    WHOLE_MODEL = "whole model"  # reads every parameter at once


def _known() -> dict[type, StepKind]:
    optim = torch.optim
    elementwise = [
        optim.SGD,
        optim.Adam,
        optim.AdamW,
        optim.Adamax,
        optim.NAdam,
        optim.RAdam,
        optim.Adagrad,
        optim.Adadelta,
        optim.RMSprop,
        optim.Rprop,
        optim.ASGD,
    ]
    known = dict.fromkeys(elementwise, StepKind.ELEMENTWISE)
    known[optim.LBFGS] = StepKind.WHOLE_MODEL
    for name in ("Adafactor", "Muon"):  # (in every torch this project supports; looked up by name all the same)
        if hasattr(optim, name):
            known[getattr(optim, name)] = StepKind.PER_TENSOR
    return known


KNOWN: dict[type, StepKind] = _known()
"""torch's optimizers by what their step reads (exact classes: a subclass may step otherwise, so it is checked)."""

PROBE_STEPS = 4  # steps of the check: SOAP-like optimizers start preconditioning after the first
_TOLERANCE = 1e-9  # float64: cutting an element-wise step into pieces changes nothing but rounding


class OptimizerCheckError(ValueError):
    """An optimizer declared element-wise whose step is not."""


def step_kind(optimizer: torch.optim.Optimizer, declared_elementwise: Iterable[type] = ()) -> StepKind:
    """What `optimizer`'s step reads: from `KNOWN` for torch's classes, else from `probe`. A class in
    `declared_elementwise` is checked all the same, and refused if the check finds otherwise."""
    cls = type(optimizer)
    declared = cls in tuple(declared_elementwise)
    if cls in KNOWN and not declared:
        return KNOWN[cls]
    found = probe(optimizer)
    if declared and found not in (None, StepKind.ELEMENTWISE):
        raise OptimizerCheckError(
            f"elementwise_optimizers names {cls.__name__}, but its step is not element-wise: stepped on flat "
            f"pieces it gives other numbers than on whole tensors ({found.value}). Leave it out of "
            "elementwise_optimizers; the engine then steps it on whole tensors."
        )
    if found is None:
        return StepKind.ELEMENTWISE if declared else StepKind.PER_TENSOR
    return found


def probe(optimizer: torch.optim.Optimizer) -> StepKind | None:
    """Step small float64 tensors with `optimizer`'s class and each of its groups' hyperparameters: whole, in
    flat pieces, and one optimizer per tensor. None if the class cannot be built or stepped on them."""
    kinds = [_probe_group(optimizer, group) for group in optimizer.param_groups]
    if any(kind is None for kind in kinds):
        return None
    for kind in (StepKind.WHOLE_MODEL, StepKind.PER_TENSOR):
        if kind in kinds:
            return kind
    return StepKind.ELEMENTWISE


def _probe_group(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> StepKind | None:
    options = {k: v for k, v in group.items() if k not in ("params", "param_names")}
    shapes = _probe_shapes(group["params"])
    device = group["params"][0].device if group["params"] else torch.device("cpu")
    with torch.random.fork_rng(devices=[]):  # an optimizer that draws random numbers leaves the user's alone
        whole = _run(optimizer, options, _values(shapes, device))
        if whole is None:
            return None
        # As two ranks would: one optimizer steps the first piece of every tensor, another the rest.
        cuts = [_cut(t) for t in _values(shapes, device)]
        firsts = _run(optimizer, options, [c[0] for c in cuts])
        rests = _run(optimizer, options, [c[-1] for c in cuts if len(c) > 1])
        if firsts is not None and rests is not None:
            rest = iter(rests)
            stepped = [torch.cat([a.reshape(-1)] + ([next(rest)] if len(c) > 1 else [])) for a, c in zip(firsts, cuts)]
            if _close(_flat(stepped), _flat(whole)):
                return StepKind.ELEMENTWISE
        alone = [_run(optimizer, options, [t]) for t in _values(shapes, device)]
        if all(a is not None for a in alone) and _close(_flat([a[0] for a in alone]), _flat(whole)):
            return StepKind.PER_TENSOR
        return StepKind.WHOLE_MODEL


def _probe_shapes(params: list[torch.Tensor]) -> list[tuple[int, ...]]:
    """Small shapes with each number of dimensions among the group's parameters (a matrix and a vector when the
    group is empty), two of them at least: what tells a step per tensor from one over every tensor."""
    shapes = {0: [()], 1: [(7,)], 2: [(5, 6)], 3: [(2, 3, 4)]}
    dims = sorted({p.dim() for p in params}) or [2, 1]
    out = [s for d in dims for s in shapes.get(d, [(2,) * d])]
    if len(out) == 1:
        out.append(tuple(n + 1 for n in out[0]) if out[0] else ())
    return out


def _values(shapes: list[tuple[int, ...]], device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g, dtype=torch.float64).to(device) for s in shapes]


def _cut(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A tensor as two flat pieces of uneven length (a rank's slices straddle tensors so)."""
    flat = tensor.reshape(-1)
    if flat.numel() < 2:
        return [flat.clone()]
    cut = max(1, flat.numel() // 3)
    return [flat[:cut].clone(), flat[cut:].clone()]


def _run(optimizer: torch.optim.Optimizer, options: dict[str, Any], tensors: list[torch.Tensor]):
    """`tensors` after PROBE_STEPS steps (of one optimizer of `optimizer`'s class) of a separable quadratic loss,
    or None if the class refuses them."""
    tensors = [torch.nn.Parameter(t.clone()) for t in tensors]
    try:
        probe_optimizer = _build(type(optimizer), optimizer.defaults, options, tensors)
        if probe_optimizer is None:
            return None
        closure = _closure(tensors)
        takes_closure = _takes_closure(probe_optimizer.step)
        for _ in range(PROBE_STEPS):
            closure()
            probe_optimizer.step(closure) if takes_closure else probe_optimizer.step()
    except Exception:  # noqa: BLE001 - whatever refuses these tensors: the answer is "not this way"
        return None
    return [t.detach() for t in tensors]


def _build(cls: type, defaults: dict[str, Any], options: dict[str, Any], tensors: list[torch.Tensor]):
    for kwargs in (defaults, {}):
        try:
            built = cls([{"params": tensors}], **kwargs)
        except Exception:  # noqa: BLE001 - a constructor that takes other arguments: try the next way
            continue
        built.param_groups[0].update(options)
        return built
    return None


def _closure(tensors: list[torch.Tensor]) -> Callable[[], torch.Tensor]:
    """Sets each tensor's gradient of a loss that is a sum of one term per element (so any cut of the tensors
    gives every element the same gradient) and returns the loss."""

    def closure() -> torch.Tensor:
        loss = torch.zeros((), dtype=torch.float64)
        for t in tensors:
            with torch.no_grad():
                flat = t.reshape(-1)
                weight = 1.0 + 0.1 * torch.cos(flat * 3.0)
                t.grad = (weight * (flat - 0.3)).reshape(t.shape)
                loss = loss + (0.5 * weight * (flat - 0.3) ** 2).sum()
        return loss

    return closure


def _takes_closure(step: Callable[..., Any]) -> bool:
    try:
        parameter = inspect.signature(step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return parameter is not None and parameter.default is inspect.Parameter.empty


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return False
    scale = max(b.abs().max().item(), 1e-12)
    return (a - b).abs().max().item() / scale <= _TOLERANCE and not math.isnan(scale)
