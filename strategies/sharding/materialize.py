"""Meta-device initialisation: build the model without memory, then give each rank only its own shards.

Modules created on the meta device are materialized one at a time, in registration order: each gets fresh
storage for its own parameters, runs its own initialisation (see `initialise`), rank 0's values are broadcast,
each rank copies out the pieces it owns, and the full-size copy is dropped. Peak memory is one module's
parameters on top of the shards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from .placeholder import readable


def replace_meta_parameters(root: nn.Module, device: torch.device) -> dict[int, torch.Tensor]:
    """Swap every meta parameter for an uninitialised one on `device` (the same object in every module holding
    it, so tied weights stay tied); returns their ids. torch cannot re-point a meta tensor at real storage, and
    untouched pages of torch.empty cost no resident memory until the engine moves them into its buffers.
    Returns {id: the meta parameter it replaced}: its shape and dtype are the master's, whatever the engine points
    the new parameter at while sharded (a placeholder of the compute dtype under mixed precision)."""
    replaced: dict[int, nn.Parameter] = {}
    metas: dict[int, torch.Tensor] = {}
    for module in root.modules():
        for key, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in replaced:
                    replaced[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), p.requires_grad)
                    metas[id(replaced[id(p)])] = p
                module._parameters[key] = replaced[id(p)]
    return metas


def has_meta_buffers(root: nn.Module) -> bool:
    return any(b.is_meta for b in root.buffers())


def _broadcast(tensor: torch.Tensor, group: object) -> None:
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.broadcast(tensor, src=dist.get_global_rank(group, 0) if group else 0, group=group)


def materialize(
    root: nn.Module,
    meta_params: dict[int, torch.Tensor],
    device: torch.device,
    write_back: Callable[[nn.Parameter, torch.Tensor], None],
    group: object = None,
) -> None:
    """Initialise every meta parameter and buffer of `root`; `write_back(param, full_value)` stores a parameter."""
    done: set[int] = set()
    for name, module in root.named_modules():
        own = [p for p in module._parameters.values() if p is not None and id(p) in meta_params]
        buffers = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
        if not own and not buffers:
            continue
        init = initialiser(root, name, module)
        for key in buffers:
            module._buffers[key] = torch.empty_like(module._buffers[key], device=device)
        resting = [p.data for p in own]
        with torch.no_grad(), readable(own):
            for p in own:
                p.data = torch.empty_like(meta_params[id(p)], device=device)  # the master dtype, not p's
            init()
            for p, rest in zip(own, resting):
                if id(p) not in done:  # a tied parameter keeps its first holder's initialisation
                    _broadcast(p.data, group)
                    write_back(p, p.data)
                    done.add(id(p))
                p.data = rest
            for key in buffers:
                _broadcast(module._buffers[key], group)


def initialiser(root: nn.Module, name: str, module: nn.Module) -> Callable[[], None]:
    """How `module` initialises its own parameters and buffers: its `reset_parameters()` (torch's convention, and
    what every built-in layer runs in its constructor, so with the same seed the values equal an eagerly built
    model's), then, inside a HuggingFace model, that model's `_init_weights(module)` (what its `post_init()` runs
    on each module; it also covers layers without reset_parameters, such as `Conv1D` or `LlamaRMSNorm`)."""
    reset = getattr(module, "reset_parameters", None)
    owner = next((m for m in _ancestors(root, name) if callable(getattr(m, "_init_weights", None))), None)
    if reset is None and owner is None:
        raise ValueError(
            f"module {name or '<root>'!r} ({type(module).__name__}) was created on the meta device but has no "
            "reset_parameters() to initialise it; define one, or build it outside configure_model"
        )

    def init() -> None:
        if reset is not None:
            reset()
        if owner is not None:
            owner._init_weights(module)

    return init


def _ancestors(root: nn.Module, name: str) -> list[nn.Module]:
    """`root`'s modules on the path to `name`, the closest first (the module itself included)."""
    path, parts = [root], name.split(".") if name else []
    for part in parts:
        path.append(path[-1].get_submodule(part))
    return path[::-1]
